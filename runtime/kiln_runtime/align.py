"""5-point similarity alignment, numpy only: the landmark → template fit, and the reference warp for an embedder
that has its own chip geometry and so no aligner engine.

`fit_similarity` solves (least squares, closed form) the similarity that maps template points onto the detected
landmarks; `chip_transform` is the chip→image 2×3 transform a face's chip is sampled with. Coordinates are pixel
centres: chip pixel (u, v) samples the image at `M @ [u, v, 1]`. `warp` samples as the build's exported aligner
graph does (pipeline/models/align.py: grid_sample, bilinear, border padding, align_corners=False), in float32.
"""

from __future__ import annotations

import numpy as np


def fit_similarity(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """2×3 matrix M of the similarity (rotation, uniform scale, translation) with M @ [src, 1] ≈ dst.

    Solves x' = a·x − b·y + tx, y' = b·x + a·y + ty in the least-squares sense.
    """
    src, dst = np.asarray(src, np.float64), np.asarray(dst, np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or len(src) < 2:
        raise ValueError(f"need two matching (N≥2, 2) point sets, got {src.shape} and {dst.shape}")
    n = len(src)
    a = np.zeros((2 * n, 4))
    a[0::2] = np.column_stack([src[:, 0], -src[:, 1], np.ones(n), np.zeros(n)])
    a[1::2] = np.column_stack([src[:, 1], src[:, 0], np.zeros(n), np.ones(n)])
    (p, q, tx, ty), *_ = np.linalg.lstsq(a, dst.reshape(-1), rcond=None)
    return np.array([[p, -q, tx], [q, p, ty]])


def chip_transform(landmarks: np.ndarray, template: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """The chip→image 2×3 transform for one face: template fitted onto landmarks, then an optional chip jitter."""
    m = np.vstack([fit_similarity(template, landmarks), [0, 0, 1]])
    if extra is not None:
        m = m @ extra
    return m[:2].astype(np.float32)


def warp(rgb: np.ndarray, thetas: np.ndarray, size: int) -> np.ndarray:
    """An HWC image → N chips (N, S, S, 3) float32 in 0..255: chip pixel (u, v) is the bilinear sample of the image
    at theta @ [u, v, 1], coordinates clamped to the border (grid_sample's `border` padding)."""
    img = np.asarray(rgb, np.float32)
    h, w = img.shape[:2]
    v, u = np.meshgrid(np.arange(size, dtype=np.float32), np.arange(size, dtype=np.float32), indexing="ij")
    base = np.stack([u, v, np.ones_like(u)], -1).reshape(size * size, 3)
    pts = np.einsum("pk,njk->npj", base, np.asarray(thetas, np.float32))          # (N, S*S, 2) image pixels
    x = np.clip(pts[..., 0], 0, w - 1)
    y = np.clip(pts[..., 1], 0, h - 1)
    x0, y0 = np.floor(x).astype(np.intp), np.floor(y).astype(np.intp)
    x1, y1 = np.minimum(x0 + 1, w - 1), np.minimum(y0 + 1, h - 1)
    fx, fy = (x - x0)[..., None], (y - y0)[..., None]
    top = img[y0, x0] * (1 - fx) + img[y0, x1] * fx
    bottom = img[y1, x0] * (1 - fx) + img[y1, x1] * fx
    return (top * (1 - fy) + bottom * fy).reshape(len(pts), size, size, 3).astype(np.float32)
