"""How closely a rebuilt graph's outputs agree with the golden outputs — max |Δ| and per-sample cosine over every
feed and output (numpy only, so a stage that compares a non-ONNX graph does not depend on onnx) — and the deps of a
stage that rebuilds a model and compares it with golden. pipeline/gates/parity.py adds the ONNX checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipeline import models, paths, samples

if TYPE_CHECKING:
    from pipeline.config import Config


def model_deps(cfg: Config, key: str) -> list[str]:
    """What a stage that rebuilds a model and compares it with its golden outputs reads."""
    return [*models.weight_deps(cfg.model(key)), paths.golden(key).as_posix(), *samples.deps(cfg, key, "golden")]


def compare(run_feed, feeds, reference: list[list[np.ndarray]]) -> dict[str, float]:
    """`run_feed(feed) -> outputs` vs the reference on every feed and output: max |Δ| and per-sample cosine.
    A NaN or infinite value on either side makes max |Δ| infinite and the cosine -1, so no gate can pass it."""
    max_abs, cosines, n = 0.0, [], 0
    for feed, ref in zip(feeds, reference):
        got = run_feed(feed)
        n += next(iter(feed.values())).shape[0]
        for g, r in zip(got, ref):
            g2, r2 = g.reshape(len(g), -1).astype(np.float64), r.reshape(len(r), -1).astype(np.float64)
            if not (np.isfinite(g2).all() and np.isfinite(r2).all()):
                max_abs = float("inf")
                cosines.append(np.full(len(g2), -1.0))
                continue
            max_abs = max(max_abs, float(np.abs(g2 - r2).max()))
            cosines.append(np.sum(g2 * r2, 1) / np.maximum(np.linalg.norm(g2, axis=1) * np.linalg.norm(r2, axis=1),
                                                            1e-30))
    cos = np.concatenate(cosines)
    return {"max_abs": max_abs, "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()), "samples": n}


def print_parity(p: dict) -> None:
    print(f"  parity vs PyTorch on {p['samples']} golden samples: max |Δ| {p['max_abs']:.2e}, "
          f"cosine min {p['cosine_min']:.7f}")
