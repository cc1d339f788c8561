"""Embedding vectors in the space a face system decides in: `as_l2` (numpy only), shared by golden@, the
end-to-end gate and the face-task metrics."""

from __future__ import annotations

import numpy as np


def as_l2(emb: np.ndarray, threshold: float, metric: str = "l2") -> tuple[np.ndarray, float]:
    """(embeddings, L2 threshold) in which a face system with this metric decides by L2 distance: cosine models
    compare unit-normalized embeddings, where cosine ≥ t is exactly L2 < sqrt(2 − 2t)."""
    if metric == "l2":
        return emb, threshold
    if metric != "cosine":
        raise ValueError(f"unknown metric {metric!r}")
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-30)
    return unit, float(np.sqrt(max(0.0, 2.0 - 2.0 * threshold)))
