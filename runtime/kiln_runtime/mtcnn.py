"""The MTCNN cascade (Zhang et al. 2016) around its three nets, numpy only: what a deployment host runs.

The nets themselves are engines here (the build's PyTorch modules live in pipeline/models/mtcnn.py). Everything
else (pyramid, crops, box maths, NMS: "the glue") is numpy and talks to the nets only through a ``Runner``:
``np.ndarray (N,3,H,W) float32, normalised -> tuple[np.ndarray, ...]``, so ONNX Runtime sessions can replace the
torch modules (see ``torch_runner``).

Net outputs, in this order (same as facenet-pytorch):
    PNet  (N,3,H,W)   -> bbox_reg (N,4,H',W'), prob (N,2,H',W')      H' = ceil((H-2)/2) - 4
    RNet  (N,3,24,24) -> bbox_reg (N,4), prob (N,2)
    ONet  (N,3,48,48) -> bbox_reg (N,4), landmarks (N,10), prob (N,2)
``prob[:, 1]`` is P(face); landmarks are 5 x values then 5 y values, relative to the input box.

Resizing (pyramid levels and R/O-Net crops) is "area" resampling, bit-for-bit the binning of torch's
``F.interpolate(mode="area")`` (= adaptive average pooling) that facenet-pytorch uses, computed here
from one integral image per photo (OpenCV's ``cv2.integral``, one per colour plane: exact integers, ~40x numpy's
cumsum): a pyramid level gathers whole rows of it and then columns; crops gather the four corners of every output
cell at once. Crops that stick out of the photo are zero-padded (original MTCNN); facenet-pytorch clamps them to
the photo instead. Box arithmetic otherwise follows facenet-pytorch.

The glue is vectorised, so that its cost is a few passes of compiled numpy/OpenCV loops over the pixels rather
than Python: per pyramid level four ``np.take`` gathers for all its pixels and channels, and the mean and the
nets' normalisation in one float32 division and one subtraction (``_net_input`` says why that is bit-exact); per
R-/O-Net batch four gathers for every cell of every crop; P-Net's hits on all levels decoded at once; NMS as
boolean overlap matrices for blocks of boxes (``_greedy``), with one call for the per-level NMS of all levels.
Python loops remain over pyramid levels, R-/O-Net batches and the boxes NMS keeps. The detections are the same,
bit for bit, as those of the plain per-level, per-box loops this replaced (tests/runtime/test_mtcnn_glue.py keeps such a
reference and compares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

Runner = Callable[[np.ndarray], tuple[np.ndarray, ...]]


def preprocess(rgb: np.ndarray) -> np.ndarray:
    """(H,W,3) or (N,H,W,3) RGB pixels in 0..255 (uint8 or float) -> (N,3,H,W) float32, (x-127.5)/128."""
    x = np.asarray(rgb, dtype=np.float32)
    x = x[None] if x.ndim == 3 else x
    return np.ascontiguousarray(((x - 127.5) * 0.0078125).transpose(0, 3, 1, 2))


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields make == ambiguous
class Face:
    """One detection. ``box`` is (x1, y1, x2, y2) as facenet-pytorch reports it; ``landmarks`` is (5, 2)
    (x, y) in 0-based pixel coordinates: left eye, right eye, nose, mouth left, mouth right, where
    left/right are as seen in the image (left eye = smaller x for a frontal face)."""

    box: tuple[float, float, float, float]
    score: float
    landmarks: np.ndarray


@dataclass(frozen=True)
class DetectorConfig:
    min_face_size: float = 20.0
    thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7)  # P-, R-, O-Net face probability
    factor: float = 0.709  # pyramid step
    # IoU thresholds: P-Net within one scale, P-Net across scales, R-Net, O-Net (O-Net uses "min" overlap).
    nms_thresholds: tuple[float, float, float, float] = (0.5, 0.7, 0.7, 0.7)
    batch_size: int = 256  # R-/O-Net crops per runner call


# ---------------------------------------------------------------------------------------------- the cascade

def pyramid_scales(h: int, w: int, cfg: DetectorConfig = DetectorConfig()) -> list[float]:
    """Scales at which P-Net's 12 px window covers faces from min_face_size up to the shorter side."""
    scale, minl, scales = 12.0 / cfg.min_face_size, min(h, w) * 12.0 / cfg.min_face_size, []
    while minl >= 12:
        scales.append(scale)
        scale, minl = scale * cfg.factor, minl * cfg.factor
    return scales


def box_iou(a, b) -> float:
    """Intersection over union of two [x1, y1, x2, y2] boxes: how a gate (system@, the detector gate) and a shadow
    rollout pair one detector's face with another's."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """Greedy NMS; returns kept indices, best score first (equal scores: lower index first). A box is dropped
    when its overlap with a kept one is > threshold; overlap = intersection / union ("union") or / smaller area
    ("min")."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    return order[_greedy(np.asarray(boxes, dtype=np.float64)[order], threshold, mode)]


_NMS_BLOCK = 128    # boxes whose overlaps with the boxes still alive are computed at once


def _greedy(boxes: np.ndarray, threshold: float, mode: str = "union", group: np.ndarray | None = None) -> np.ndarray:
    """Greedy NMS of (N, >=4) float64 boxes already in priority order -> the kept positions, in that order.
    With `group` (N ints, ascending), a box only suppresses boxes of its own group: NMS within each group at once.

    The textbook loop (keep the first alive box, drop every alive box it overlaps by more than the threshold,
    repeat), a block at a time: the overlaps of up to _NMS_BLOCK boxes with every box still alive from the block on
    (in the block's groups) are one boolean matrix, and the walk through the block only ANDs its rows. Each
    overlap is the float64 expression the one-box-at-a-time loop evaluates, so exactly the same boxes survive.
    """
    alive, keep = np.ones(len(boxes), dtype=bool), []
    for start in range(0, len(boxes), _NMS_BLOCK):
        end = min(start + _NMS_BLOCK, len(boxes))
        stop = len(boxes) if group is None else int(np.searchsorted(group, group[end - 1], side="right"))
        cols = start + np.flatnonzero(alive[start:stop])        # the boxes still alive, from this block on
        k = int(np.searchsorted(cols, end))                     # ... of which the first k are the block's
        x1, y1, x2, y2 = boxes[cols, :4].T
        area = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
        b = slice(0, k), None                                   # the block's boxes, as a column
        inter = (np.maximum(0.0, np.minimum(x2[b], x2) - np.maximum(x1[b], x1))
                 * np.maximum(0.0, np.minimum(y2[b], y2) - np.maximum(y1[b], y1)))
        denom = np.minimum(area[b], area) if mode == "min" else area[b] + area - inter
        spares = inter <= threshold * denom                     # [i, j]: keeping box i leaves box j alive
        if group is not None:
            spares |= group[cols[b]] != group[cols]
        live = np.ones(len(cols), dtype=bool)
        for i in range(k):
            if live[i]:
                keep.append(cols[i])
                live &= spares[i]
        alive[cols] = live
    return np.asarray(keep, dtype=np.int64)


def integral_image(rgb: np.ndarray) -> np.ndarray:
    """(3, H+1, W+1): each colour plane's exact integral image, with a zero first row and column (OpenCV's
    cv2.integral: int32 while a plane's total fits, else float64, which is exact up to 2**53)."""
    import cv2

    h, w = rgb.shape[:2]
    fits = h * w * 255 < 2**31
    s = np.empty((3, h + 1, w + 1), np.int32 if fits else np.float64)
    for c, plane in enumerate(cv2.split(rgb)):
        got = cv2.integral(plane, s[c], sdepth=cv2.CV_32S if fits else cv2.CV_64F)   # written in place ...
        if not np.may_share_memory(got, s):                                            # ... or else copied
            s[c] = got
    return s


def _bins(lo, hi, out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's adaptive-pooling bins of [lo, hi) into `out` cells: rows lo + [floor(k*n/out), ceil((k+1)*n/out)),
    n = hi - lo. lo, hi: ints -> (out,) starts and ends; (N, 1) arrays (one window a row) -> (N, out) each."""
    k, n = np.arange(out), hi - lo
    return lo + k * n // out, lo - (-(k + 1) * n // out)


def _net_input(sums: np.ndarray, cnt: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[...] = what ``preprocess`` makes of the mean pixel sums / cnt (cnt broadcasts against sums), bit for bit:
    float32(float32(sums / cnt) - 127.5) / 128, the quotient taken in float64 (torch's area interpolation).

    Computed as float32(sums / (128 * cnt)) - float32(127.5 / 128), one pass less: scaling by a power of two
    commutes with rounding. While every sum is below 2**24 (exact in float32) the division runs in float32: the
    quotient of two floats rounded to float32 directly or via float64 is the same (53 >= 2 * 24 + 2 bits)."""
    exact = 255 * int(cnt.max(initial=0)) < 2**24
    np.divide(sums, cnt * 128, out=out, dtype=np.float32 if exact else np.float64, casting="unsafe")
    np.subtract(out, np.float32(127.5 / 128), out=out)
    return out


def area_levels(s: np.ndarray, sizes: list[tuple[int, int]]) -> Iterator[np.ndarray]:
    """The photo whose integral image is `s` area-resampled to each (out_h, out_w) in `sizes`, one at a time, as
    P-Net inputs (1, 3, out_h, out_w) float32. Output cell (i, j) averages input rows [floor(i*H/out_h),
    ceil((i+1)*H/out_h)) and likewise columns, like torch's adaptive_avg_pool2d. Per level, two gathers of whole
    rows of the integral give every row bin's running column sums (3, out_h, W+1); two gathers of columns of
    those give the cells' sums."""
    h, w = s.shape[1] - 1, s.shape[2] - 1
    for oh, ow in sizes:
        (ys, ye), (xs, xe) = _bins(0, h, oh), _bins(0, w, ow)
        rows = s.take(ye, axis=1, mode="clip")                  # mode="clip": indices are in range, skip the check
        rows -= s.take(ys, axis=1, mode="clip")
        sums = rows.take(xe, axis=2, mode="clip")
        sums -= rows.take(xs, axis=2, mode="clip")
        level = np.empty((1, 3, oh, ow), np.float32)
        _net_input(sums, (ye - ys)[:, None] * (xe - xs), level[0])
        yield level


def area_crops(s: np.ndarray, y0: np.ndarray, y1: np.ndarray, x0: np.ndarray, x1: np.ndarray,
                size: int) -> np.ndarray:
    """The windows [y0,y1) x [x0,x1) (int arrays, one per window; they may leave the photo, outside is 0) of the
    photo whose integral image is `s`, area-resampled to size x size as R-/O-Net inputs (N, 3, size, size)
    float32. Output cell k averages input rows [floor(k*n/size), ceil((k+1)*n/size)) like torch's
    adaptive_avg_pool2d. The four corners of every cell of every window are one gather each; a corner outside
    the photo is moved onto its edge, where the integral holds what zero padding would sum to."""
    (ys, ye), (xs, xe) = _bins(y0[:, None], y1[:, None], size), _bins(x0[:, None], x1[:, None], size)
    cnt = (ye - ys)[:, :, None] * (xe - xs)[:, None, :]
    h1, w1 = s.shape[1:]
    ye, ys = (np.clip(v, 0, h1 - 1) * w1 for v in (ye, ys))                 # offsets in a flattened plane
    xe, xs = (np.clip(v, 0, w1 - 1) for v in (xe, xs))
    planes = s.reshape(3, -1)

    def corner(y: np.ndarray, x: np.ndarray) -> np.ndarray:                 # (3, N, size, size)
        return planes.take(y[:, :, None] + x[:, None, :], axis=1, mode="clip")

    sums = (corner(ye, xe) + corner(ys, xs)) - (corner(ys, xe) + corner(ye, xs))
    out = np.empty((len(cnt), 3, size, size), np.float32)
    _net_input(sums, cnt, out.transpose(1, 0, 2, 3))
    return out


def _run_on_crops(s: np.ndarray, boxes: np.ndarray, size: int, net: Runner, batch: int) -> list[np.ndarray]:
    """Crop facenet-pytorch's pixel window for each box (cols floor(x1)-1 .. floor(x2)-1), resize, run."""
    b = np.floor(boxes[:, :4]).astype(np.int64)
    outs = [net(area_crops(s, c[:, 1] - 1, c[:, 3], c[:, 0] - 1, c[:, 2], size))
            for c in (b[i:i + batch] for i in range(0, len(b), batch))]
    return [np.concatenate(o) for o in zip(*outs)]


def _bbreg(boxes: np.ndarray, reg: np.ndarray, plus_one: bool = True) -> np.ndarray:
    wh = boxes[:, 2:4] - boxes[:, 0:2] + (1 if plus_one else 0)
    out = boxes.copy()
    out[:, :4] = boxes[:, :4] + reg * np.tile(wh, 2)
    return out


def _square(boxes: np.ndarray) -> np.ndarray:
    wh = boxes[:, 2:4] - boxes[:, 0:2]
    side = wh.max(1, keepdims=True)
    out = boxes.copy()
    out[:, 0:2] = boxes[:, 0:2] + wh * 0.5 - side * 0.5
    out[:, 2:4] = out[:, 0:2] + side
    return out


def _proposals(s: np.ndarray, pnet: Runner, cfg: DetectorConfig) -> np.ndarray:
    """Stage 1: P-Net over the pyramid -> (N, 5) squared boxes + score.

    P-Net runs on every level first; then the hits of all levels are decoded at once. NMS runs within each level
    (boxes sorted level by level, best first), then across levels over the survivors (best first; equal scores
    in level order, then by raster position), as facenet-pytorch does it."""
    h, w = s.shape[1] - 1, s.shape[2] - 1
    scales = pyramid_scales(h, w, cfg)
    out = [pnet(img) for img in area_levels(s, [(int(h * sc + 1), int(w * sc + 1)) for sc in scales])]
    if not out:
        return np.zeros((0, 5))
    face = np.concatenate([prob[0, 1].ravel() for _, prob in out])          # P(face) on every level, flat
    hit = np.flatnonzero(face >= cfg.thresholds[0])
    start = np.cumsum([0] + [prob[0, 1].size for _, prob in out])
    level = np.searchsorted(start, hit, side="right") - 1
    yy, xx = np.divmod(hit - start[level], np.array([prob.shape[3] for _, prob in out])[level])
    xy = np.stack([xx, yy], 1).astype(np.float64)
    scale = np.array(scales)[level, None]
    reg = np.concatenate([r[0].reshape(4, -1) for r, _ in out], axis=1)      # (4, all cells)
    boxes = np.concatenate([np.floor((2 * xy + 1) / scale), np.floor((2 * xy + 12) / scale), face[hit, None],
                            reg[:, hit].T], axis=1)
    order = np.lexsort((-boxes[:, 4], level))                               # level by level, best first
    boxes = boxes[order][_greedy(boxes[order], cfg.nms_thresholds[0], group=level[order])]
    boxes = boxes[nms(boxes, boxes[:, 4], cfg.nms_thresholds[1])]
    return _square(_bbreg(boxes[:, :5], boxes[:, 5:9], plus_one=False))


def detect(rgb: np.ndarray, pnet: Runner, rnet: Runner, onet: Runner,
           cfg: DetectorConfig = DetectorConfig()) -> list[Face]:
    """Find faces in an (H, W, 3) RGB uint8 image; best score first."""
    rgb = np.asarray(rgb)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"detect() needs an (H, W, 3) RGB image, got shape {rgb.shape}")
    s = integral_image(np.ascontiguousarray(rgb, dtype=np.uint8))

    boxes = _proposals(s, pnet, cfg)
    boxes = boxes[(boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)]
    if len(boxes) == 0:
        return []
    reg, prob = _run_on_crops(s, boxes, 24, rnet, cfg.batch_size)  # stage 2: R-Net
    ok = prob[:, 1] > cfg.thresholds[1]
    boxes, reg = np.concatenate([boxes[ok, :4], prob[ok, 1:2]], 1), reg[ok]
    pick = nms(boxes, boxes[:, 4], cfg.nms_thresholds[2])
    boxes = _square(_bbreg(boxes[pick], reg[pick]))
    boxes = boxes[(boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)]
    if len(boxes) == 0:
        return []
    reg, lm, prob = _run_on_crops(s, boxes, 48, onet, cfg.batch_size)  # stage 3: O-Net
    ok = prob[:, 1] > cfg.thresholds[2]
    boxes, reg, lm = np.concatenate([boxes[ok, :4], prob[ok, 1:2]], 1), reg[ok], lm[ok]
    wh = boxes[:, 2:4] - boxes[:, 0:2] + 1
    points = np.stack([wh[:, :1] * lm[:, :5] + boxes[:, :1] - 1, wh[:, 1:] * lm[:, 5:] + boxes[:, 1:2] - 1], 2)
    boxes = _bbreg(boxes, reg)
    pick = nms(boxes, boxes[:, 4], cfg.nms_thresholds[3], mode="min")
    return [Face(tuple(float(v) for v in boxes[i, :4]), float(boxes[i, 4]), points[i]) for i in pick]
