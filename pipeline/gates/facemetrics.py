"""Face-task comparison of two sets of embeddings, and the embedder gate on it (numpy only, so GPU-side scripts can
import it as is and apply the same limits, params.yaml `validate:`)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from pipeline.vectors import as_l2

# metric, comparison, limit key in params.yaml `validate:`
EMBEDDER_GATE = (("cosine_min", ">=", "cosine_min"), ("cosine_mean", ">=", "cosine_mean"), ("l2_max", "<=", "l2_max"),
                 ("top1_agreement", ">=", "top1_agreement_min"),
                 ("decision_agreement", ">=", "decision_agreement_min"),
                 ("tar_delta", "<=", "tar_delta_max"), ("far_delta", "<=", "far_delta_max"))


def check(m: Mapping[str, float], checks, limits: Mapping[str, Any]) -> list[str]:
    """One failure line per (metric, op, limit key) not met; a NaN metric never passes."""
    out = []
    for k, op, key in checks:
        lim = limits[key]
        ok = m[k] >= lim if op == ">=" else m[k] <= lim
        if not ok:
            out.append(f"{k} {m[k]:.6g} (limit {op} {lim:g})")
    return out


def gate(m: Mapping[str, float], limits: Mapping[str, Any]) -> list[str]:
    """The embedder gate: `limits` is params.yaml's `validate:` section."""
    return check(m, EMBEDDER_GATE, limits)


def _pairwise(e: np.ndarray) -> np.ndarray:
    return np.linalg.norm(e[:, None] - e[None], axis=-1)


def face_metrics(got: np.ndarray, ref: np.ndarray, labels: np.ndarray, gallery: np.ndarray,
                 threshold: float, metric: str = "l2") -> dict[str, float]:
    """Compare engine outputs `got` with reference outputs `ref` on the same chips, as a face system would; for a
    cosine model every distance (l2_*, pairs, top-1) is between unit-normalized embeddings."""
    ref, _ = as_l2(ref, threshold, metric)
    got, threshold = as_l2(got, threshold, metric)
    cos = np.sum(got * ref, 1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    l2 = np.linalg.norm(got - ref, axis=1)
    # identity top-1 through the gallery: reference queries vs reference gallery, engine queries vs engine gallery
    top_ref = labels[gallery][np.argmin(_pairwise(np.vstack([ref, ref[gallery]]))[:len(ref), len(ref):], 1)]
    top_got = labels[gallery][np.argmin(_pairwise(np.vstack([got, got[gallery]]))[:len(got), len(got):], 1)]
    iu = np.triu_indices(len(ref), 1)
    d_ref, d_got = _pairwise(ref)[iu], _pairwise(got)[iu]
    same = (labels[:, None] == labels[None])[iu]
    acc_ref, acc_got = d_ref < threshold, d_got < threshold
    rate = lambda acc, mask: float(acc[mask].mean()) if mask.any() else 0.0  # noqa: E731
    return {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()), "l2_max": float(l2.max()),
            "l2_mean": float(l2.mean()), "top1_agreement": float((top_ref == top_got).mean()),
            "top1_accuracy": float((top_got == labels).mean()),
            "decision_agreement": float((acc_ref == acc_got).mean()),
            "tar_ref": rate(acc_ref, same), "tar": rate(acc_got, same),
            "far_ref": rate(acc_ref, ~same), "far": rate(acc_got, ~same),
            "tar_delta": abs(rate(acc_got, same) - rate(acc_ref, same)),
            "far_delta": abs(rate(acc_got, ~same) - rate(acc_ref, ~same)),
            "pairs": int(len(d_ref)), "samples": int(len(ref))}
