"""validate@<engine>: a face-task gate against the golden embeddings, not a tensor tolerance.

Per-sample cosine (min/mean) and L2 (max) against the FP32 PyTorch reference; identity top-1 through the golden
gallery (the un-augmented chip of each photo) compared with the reference's top-1; same/different decisions at the
model's verification threshold for every pair of golden chips, and the change in true- and false-accept rates.
The verdict and every number are written either way; a failing gate then exits non-zero so the DAG stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import paths, targets
from pipeline.config import Config, ValidateConfig
from pipeline.data import load_set, to_nchw
from pipeline.manifest import atomic_dir, manifest_path, identity_digest, read_manifest, write_json_atomic

BATCH = 8


@dataclass(frozen=True)
class Verdict:
    engine: str
    passed: bool
    metrics: dict[str, float]
    failures: list[str]


def _pairwise(e: np.ndarray) -> np.ndarray:
    return np.linalg.norm(e[:, None] - e[None], axis=-1)


def face_metrics(got: np.ndarray, ref: np.ndarray, labels: np.ndarray, gallery: np.ndarray,
                 threshold: float) -> dict[str, float]:
    """Compare engine outputs `got` with reference outputs `ref` on the same chips, as a face system would."""
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


def gate(m: dict[str, float], v: ValidateConfig) -> list[str]:
    checks = [("cosine_min", ">=", v.cosine_min), ("cosine_mean", ">=", v.cosine_mean), ("l2_max", "<=", v.l2_max),
              ("top1_agreement", ">=", v.top1_agreement_min), ("decision_agreement", ">=", v.decision_agreement_min),
              ("tar_delta", "<=", v.tar_delta_max), ("far_delta", "<=", v.far_delta_max)]
    return [f"{k} {m[k]:.6g} (limit {op} {lim:g})" for k, op, lim in checks
            if not (m[k] >= lim if op == ">=" else m[k] <= lim)]


def run(cfg: Config, engine_name: str, root: Path = Path(".")) -> Verdict:
    spec = cfg.engine(engine_name)
    engine_dir = paths.engine(engine_name, root)
    engine_manifest = read_manifest(manifest_path(engine_dir, engine_name))
    gset = load_set(paths.data_set("golden", root))
    ref = np.load(paths.golden(spec.model, root) / "embeddings.npy", allow_pickle=False)
    runner = targets.get(spec.target).load(engine_dir)
    x = to_nchw(gset.chips)
    got = np.concatenate([runner.run(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
    gallery = np.array([s["augmentation"] is None for s in gset.index["samples"]])
    metrics = face_metrics(got, ref, gset.labels, np.flatnonzero(gallery), cfg.model(spec.model).verify_threshold)
    failures = gate(metrics, cfg.validate)
    report = {"engine": engine_name, "verdict": "fail" if failures else "pass", "failures": failures,
              "metrics": {k: round(v, 7) if isinstance(v, float) else v for k, v in metrics.items()},
              "limits": cfg.section("validate"), "engine_manifest_xxh3_128": identity_digest(engine_manifest),
              "golden_set_xxh3_128": gset.content_hash}
    out = paths.validation(engine_name, root)
    with atomic_dir(out) as d:
        write_json_atomic(d / "validation.json", report)
    return Verdict(engine_name, not failures, metrics, failures)
