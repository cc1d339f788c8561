"""Any single-shot face detector whose head is declared, not coded: priors per stride, box and landmark encoding,
score, which graph outputs hold what, and the input it wants. numpy + OpenCV (the resize) only: the same decode runs
on the reference's outputs, on every engine's, in `kiln identify` and on a deployment host.

The declaration (params.yaml `models.<m>.decode` for `samples: singleshot`; a system.json carries it whole):

    strides         the heads' strides, e.g. [8, 16, 32]; per stride the graph emits one row per prior, cell by
                    cell (row-major), the priors of a cell together
    anchor_sizes    per stride, the square anchor sizes in pixels of each cell's priors (RetinaFace: [[16, 32],
                    [64, 128], [256, 512]]); empty: anchor-free, one prior per cell whose size is the stride (YuNet,
                    SCRFD)
    anchor_offset   a prior's centre is ((col, row) + offset) × stride: 0.5 (RetinaFace) or 0 (YuNet, SCRFD)
    box             centre-size: centre = prior + d_xy × v0 × size, size = prior size × exp(d_wh × v1) (SSD,
                    RetinaFace, YuNet); distance: x1, y1, x2, y2 = prior ∓ d × v0 × size (FCOS, SCRFD)
    variances       (v0, v1) above; landmarks are prior + d × v0 × size, x and y interleaved, 5 points
    score           class: the class output's `score_column`; class-x-objectness: class × objectness;
                    sqrt-class-x-objectness: sqrt(clip(class) × clip(objectness)) (YuNet)
    outputs         {class, objectness, box, landmarks}: the graph outputs holding each, one name per stride, or one
                    name for all strides concatenated (RetinaFace's loc / conf / landmarks)
    channels, mean, std   the input: channels (bgr | rgb) of 0..255 pixels, then (x − mean) / std
    pad_to          the input is padded (bottom, right, zeros) to a multiple of this (YuNet's FPN adds levels: 32)
    input_size      [width, height] the frame is scaled to fit before detection (keeping its aspect; boxes and
                    landmarks mapped back), a system's choice; empty: the frame's own size
    score_threshold, nms_threshold, top_k   as every detector

Outputs are read by name (a runner's `output_names`; OpenVINO need not keep the ONNX order). A declaration that
does not fit the graph (a name it lacks, a row count the strides and priors do not predict, a row too narrow) is one
`DecodeError` line, not a crash inside numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np

from kiln_runtime.mtcnn import Face, nms

BOXES = ("centre-size", "distance")
SCORES = ("class", "class-x-objectness", "sqrt-class-x-objectness")
HEADS = ("class", "objectness", "box", "landmarks")
WIDTH = {"box": 4, "landmarks": 10}     # the least row width a head's output must have


class DecodeError(ValueError):
    """The declared decode does not fit what the graph returned."""


@dataclass(frozen=True)
class Decode:
    strides: tuple[int, ...]
    outputs: tuple[tuple[str, tuple[str, ...]], ...]      # (head, names), heads in HEADS order
    anchor_sizes: tuple[tuple[float, ...], ...] = ()
    anchor_offset: float = 0.0
    box: str = "centre-size"
    variances: tuple[float, float] = (1.0, 1.0)
    score: str = "class"
    score_column: int = -1
    channels: str = "bgr"
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    pad_to: int = 1
    input_size: tuple[int, ...] = ()                       # (width, height) or ()
    score_threshold: float = 0.9
    nms_threshold: float = 0.3
    top_k: int = 5000

    def __post_init__(self):
        heads = dict(self.outputs)
        if self.box not in BOXES or self.score not in SCORES:
            raise DecodeError(f"box {self.box!r} / score {self.score!r}: known {BOXES} / {SCORES}")
        need = {"class", "box", "landmarks", *(("objectness",) if "objectness" in self.score else ())}
        if missing := sorted(need - set(heads)):
            raise DecodeError(f"outputs name no {', '.join(missing)} head")
        for head, names in heads.items():
            if head not in HEADS or len(names) not in (1, len(self.strides)):
                raise DecodeError(f"outputs.{head}: one name, or one per stride ({len(self.strides)})")
        if self.anchor_sizes and len(self.anchor_sizes) != len(self.strides):
            raise DecodeError(f"anchor_sizes: one list per stride ({len(self.strides)})")
        if self.input_size and (len(self.input_size) != 2 or min(self.input_size) < 16):
            raise DecodeError("input_size: [width, height], each at least 16")

    @classmethod
    def from_doc(cls, doc: dict) -> "Decode":
        """From a system.json's detector settings (lists as JSON gives them)."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(doc) - known):
            raise DecodeError(f"setting {str(unknown[0])[:40]!r} is not one this runtime's decode has")
        d = dict(doc)
        d["outputs"] = tuple((h, tuple(n)) for h, n in dict(d["outputs"]).items())
        d["anchor_sizes"] = tuple(tuple(float(s) for s in row) for row in d.get("anchor_sizes", ()))
        for k in ("strides", "variances", "mean", "std", "input_size"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def doc(self) -> dict:
        """The JSON form `from_doc` reads."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["outputs"] = {h: list(n) for h, n in self.outputs}
        return out

    @property
    def heads(self) -> dict[str, tuple[str, ...]]:
        return dict(self.outputs)

    @property
    def per_cell(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self.anchor_sizes) if self.anchor_sizes else (1,) * len(self.strides)


def scale_for(height: int, width: int, d: Decode) -> float:
    """The factor the frame is scaled by before detection: to fit `input_size`, else 1."""
    if not d.input_size:
        return 1.0
    w, h = d.input_size
    return min(w / width, h / height)


def preprocess(rgb: np.ndarray, d: Decode) -> tuple[np.ndarray, float]:
    """(H, W, 3) RGB 0..255 → ((1, 3, H', W') float32 input, the scale applied): scaled to fit input_size (area
    resampling down, bilinear up), channels ordered, (x − mean) / std, padded to a multiple of pad_to."""
    import cv2

    h, w = rgb.shape[:2]
    s = scale_for(h, w, d)
    if s != 1.0:
        size = (max(1, round(w * s)), max(1, round(h * s)))
        rgb = cv2.resize(np.ascontiguousarray(rgb), size, interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR)
    h2, w2 = rgb.shape[:2]
    p = d.pad_to
    H, W = -(-h2 // p) * p, -(-w2 // p) * p
    out = np.zeros((1, 3, H, W), np.float32)
    order = (2, 1, 0) if d.channels == "bgr" else (0, 1, 2)
    for c, src in enumerate(order):
        plane = out[0, c, :h2, :w2]
        np.subtract(rgb[:, :, src], d.mean[c], out=plane, dtype=np.float32)
        if d.std[c] != 1.0:
            plane /= d.std[c]
    return out, s


@lru_cache(maxsize=64)
def _priors(strides: tuple[int, ...], sizes: tuple[tuple[float, ...], ...], offset: float,
            height: int, width: int) -> tuple[np.ndarray, ...]:
    """Per stride, (rows, 4) priors (cx, cy, w, h) in input pixels, in the graph's row order (read-only)."""
    out = []
    for k, stride in enumerate(strides):
        ny, nx = math.ceil(height / stride), math.ceil(width / stride)
        yy, xx = np.meshgrid(np.arange(ny), np.arange(nx), indexing="ij")
        centres = np.stack([(xx.ravel() + offset) * stride, (yy.ravel() + offset) * stride], 1)
        cell = sizes[k] if sizes else (float(stride),)
        a = np.stack([np.column_stack([centres, np.full((len(centres), 2), s, np.float64)]) for s in cell], 1)
        a = a.reshape(-1, 4)
        a.setflags(write=False)
        out.append(a)
    return tuple(out)


def priors(d: Decode, height: int, width: int) -> np.ndarray:
    return np.concatenate(_priors(d.strides, d.anchor_sizes, d.anchor_offset, height, width))


def _rows(outs: dict[str, np.ndarray], head: str, d: Decode, counts: list[int]) -> np.ndarray:
    """One head's rows over every stride, (A, k): per-stride outputs stacked, batch axis dropped, checked."""
    names = d.heads[head]
    parts = []
    for name in names:
        if name not in outs:
            raise DecodeError(f"outputs.{head} names {name!r}; the graph's outputs are {', '.join(outs)}")
        a = np.asarray(outs[name])
        a = a[0] if a.ndim == 3 else a
        if a.ndim == 1:
            a = a[:, None]
        if a.ndim != 2:
            raise DecodeError(f"output {name!r} has shape {np.asarray(outs[name]).shape}; a head output is "
                              "(1, rows, values) or (rows, values)")
        parts.append(a)
    want = counts if len(names) > 1 else [sum(counts)]
    for name, a, n in zip(names, parts, want):
        if len(a) != n:
            raise DecodeError(f"output {name!r} has {len(a)} rows, the declared strides {list(d.strides)} and "
                              f"{d.per_cell[0]} prior(s) a cell predict {n} for this input")
        if a.shape[1] < WIDTH.get(head, 1):
            raise DecodeError(f"output {name!r} has {a.shape[1]} values a row; a {head} head needs "
                              f"{WIDTH.get(head, 1)}")
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def scores(outs: dict[str, np.ndarray], d: Decode, counts: list[int] | None = None) -> np.ndarray:
    """(A,) face scores of every prior. `counts`: rows per stride (checked), None: not checked (a batch of crops,
    whose rows are per sample: (N, rows, k) outputs give (N, A))."""
    if counts is None:      # batched: per sample, heads concatenated over strides
        def cat(head):
            return np.concatenate([np.asarray(outs[n]).reshape(len(np.asarray(outs[n])), -1,
                                                                np.asarray(outs[n]).shape[-1])
                                   for n in d.heads[head]], 1)
        cls = cat("class")[..., d.score_column].astype(np.float64)
        obj = cat("objectness")[..., 0].astype(np.float64) if "objectness" in d.score else None
    else:
        cls = _rows(outs, "class", d, counts)[:, d.score_column].astype(np.float64)
        obj = _rows(outs, "objectness", d, counts)[:, 0].astype(np.float64) if "objectness" in d.score else None
    if d.score == "class":
        return cls
    if d.score == "class-x-objectness":
        return cls * obj
    return np.sqrt(np.clip(cls, 0, 1) * np.clip(obj, 0, 1))


def decode(named: dict[str, np.ndarray], height: int, width: int, d: Decode, scale: float = 1.0) -> list[Face]:
    """One input's outputs by name → faces, best score first, in the frame's pixels (input pixels / `scale`)."""
    pri = _priors(d.strides, d.anchor_sizes, d.anchor_offset, height, width)
    counts = [len(p) for p in pri]
    s = scores(named, d, counts)
    keep = np.flatnonzero(s > d.score_threshold)
    keep = keep[np.argsort(-s[keep], kind="stable")][:d.top_k]
    a = np.concatenate(pri)[keep]
    box = _rows(named, "box", d, counts)[keep, :4].astype(np.float64)
    marks = _rows(named, "landmarks", d, counts)[keep, :10].astype(np.float64)
    v0, v1 = d.variances
    if d.box == "centre-size":
        centre = a[:, :2] + box[:, :2] * v0 * a[:, 2:]
        size = a[:, 2:] * np.exp(np.clip(box[:, 2:] * v1, -20, 20))
        boxes = np.concatenate([centre - size / 2, centre + size / 2], 1)
    else:
        boxes = np.concatenate([a[:, :2] - box[:, :2] * v0 * a[:, 2:], a[:, :2] + box[:, 2:] * v0 * a[:, 2:]], 1)
    points = a[:, None, :2] + marks.reshape(-1, 5, 2) * v0 * a[:, None, 2:]
    kept = nms(boxes, s[keep], d.nms_threshold)
    boxes, points = boxes / scale, points / scale
    return [Face(tuple(float(v) for v in boxes[i]), float(s[keep][i]), points[i]) for i in kept]


Runner = Callable[[np.ndarray], dict]


def detect(rgb: np.ndarray, run: Runner, d: Decode) -> list[Face]:
    """Faces in one RGB frame; `run` maps the preprocessed input to the graph's outputs by name."""
    x, s = preprocess(rgb, d)
    return decode(run(x), x.shape[2], x.shape[3], d, s)
