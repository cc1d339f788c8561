"""Face-task comparison of two sets of embeddings (numpy only, so GPU-side scripts can import it as is)."""

from __future__ import annotations

import numpy as np


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
