"""MTCNN face detector (Zhang et al. 2016): P-, R- and O-Net plus the cascade around them.

The nets are small torch modules that load facenet-pytorch 2.6.0's state dicts (MIT) unchanged; each
exports to ONNX on its own. Everything else (pyramid, crops, box maths, NMS) is plain numpy and talks to
the nets only through a ``Runner``: ``np.ndarray (N,3,H,W) float32, normalised -> tuple[np.ndarray, ...]``,
so ONNX Runtime sessions can replace the torch modules (see ``torch_runner``).

Net outputs, in this order (same as facenet-pytorch):
    PNet  (N,3,H,W)   -> bbox_reg (N,4,H',W'), prob (N,2,H',W')      H' = ceil((H-2)/2) - 4
    RNet  (N,3,24,24) -> bbox_reg (N,4), prob (N,2)
    ONet  (N,3,48,48) -> bbox_reg (N,4), landmarks (N,10), prob (N,2)
``prob[:, 1]`` is P(face); landmarks are 5 x values then 5 y values, relative to the input box.

Resizing (pyramid levels and R/O-Net crops) is "area" resampling, bit-for-bit the binning of torch's
``F.interpolate(mode="area")`` (= adaptive average pooling) that facenet-pytorch uses, computed here
from one integral image per photo (OpenCV's ``cv2.integral``: exact integers, ~40x numpy's cumsum): a pyramid
level gathers whole rows of it and then columns; crops gather the four corners of every output cell at once. Crops that stick out of the photo are zero-padded (original MTCNN);
facenet-pytorch clamps them to the photo instead. Box arithmetic otherwise follows facenet-pytorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

Runner = Callable[[np.ndarray], tuple[np.ndarray, ...]]


def _conv(cin: int, cout: int, k: int) -> tuple[nn.Conv2d, nn.PReLU]:
    return nn.Conv2d(cin, cout, kernel_size=k), nn.PReLU(cout)


def _tf_flatten(x: torch.Tensor) -> torch.Tensor:
    # The weights come from TensorFlow, whose dense layers see features in (W, H, C) order.
    return x.permute(0, 3, 2, 1).flatten(1)


class PNet(nn.Module):
    """Proposal net, fully convolutional (12x12 receptive field, stride 2). 6,632 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = _conv(3, 10, 3)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2, self.prelu2 = _conv(10, 16, 3)
        self.conv3, self.prelu3 = _conv(16, 32, 3)
        self.conv4_1 = nn.Conv2d(32, 2, kernel_size=1)
        self.conv4_2 = nn.Conv2d(32, 4, kernel_size=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.prelu3(self.conv3(self.prelu2(self.conv2(x))))
        return self.conv4_2(x), torch.softmax(self.conv4_1(x), dim=1)


class RNet(nn.Module):
    """Refinement net on 24x24 crops. 100,178 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = _conv(3, 28, 3)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = _conv(28, 48, 3)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = _conv(48, 64, 2)
        self.dense4, self.prelu4 = nn.Linear(576, 128), nn.PReLU(128)
        self.dense5_1 = nn.Linear(128, 2)
        self.dense5_2 = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.prelu3(self.conv3(x))
        x = self.prelu4(self.dense4(_tf_flatten(x)))
        return self.dense5_2(x), torch.softmax(self.dense5_1(x), dim=1)


class ONet(nn.Module):
    """Output net on 48x48 crops: box, 5 landmarks, score. 389,040 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = _conv(3, 32, 3)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = _conv(32, 64, 3)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = _conv(64, 64, 3)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4, self.prelu4 = _conv(64, 128, 2)
        self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu4(self.conv4(x))
        x = self.prelu5(self.dense5(_tf_flatten(x)))
        return self.dense6_2(x), self.dense6_3(x), torch.softmax(self.dense6_1(x), dim=1)


def load_nets(pnet_pt: str | Path, rnet_pt: str | Path, onet_pt: str | Path) -> tuple[PNet, RNet, ONet]:
    """Build the three nets from their state dicts (strict) and put them in eval mode."""
    return build_pnet(pnet_pt), build_rnet(rnet_pt), build_onet(onet_pt)


def torch_runner(module: nn.Module) -> Runner:
    """Wrap a net as a numpy-in, numpy-out callable (eval mode, no autograd)."""
    module.eval()

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        with torch.inference_mode():
            out = module(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
        return tuple(o.numpy() for o in out)

    return run


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


def pyramid_scales(h: int, w: int, cfg: DetectorConfig = DetectorConfig()) -> list[float]:
    """Scales at which P-Net's 12 px window covers faces from min_face_size up to the shorter side."""
    scale, minl, scales = 12.0 / cfg.min_face_size, min(h, w) * 12.0 / cfg.min_face_size, []
    while minl >= 12:
        scales.append(scale)
        scale, minl = scale * cfg.factor, minl * cfg.factor
    return scales


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """Greedy NMS; returns kept indices, best score first. A box is dropped when its overlap with a kept
    one is > threshold; overlap = intersection / union ("union") or / smaller area ("min")."""
    x1, y1, x2, y2 = np.asarray(boxes, dtype=np.float64).T[:4]
    area = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
    order, keep = np.argsort(-np.asarray(scores), kind="stable"), []
    while order.size:
        i, rest = order[0], order[1:]
        keep.append(i)
        inter = (np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]))
                 * np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest])))
        denom = np.minimum(area[i], area[rest]) if mode == "min" else area[i] + area[rest] - inter
        order = rest[inter <= threshold * denom]  # overlap <= threshold, without dividing by zero
    return np.asarray(keep, dtype=np.int64)


def _integral(rgb: np.ndarray) -> np.ndarray:
    """(H+1, W+1, C) exact integer sums with a zero first row and column: OpenCV's integral image (int32 while the
    total fits, else float64, which is exact up to 2**53), ~40x numpy's cumsum on a 1 Mpx photo, same values."""
    import cv2

    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    fits = rgb.shape[0] * rgb.shape[1] * 255 < 2**31
    return cv2.integral(rgb, sdepth=cv2.CV_32S if fits else cv2.CV_64F)


def _bins(lo: np.ndarray, hi: np.ndarray, out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's adaptive-pooling bins of [lo, hi) into `out` cells: rows [floor(k*n/out), ceil((k+1)*n/out))."""
    n, k = (hi - lo)[:, None], np.arange(out)[None]
    return lo[:, None] + k * n // out, lo[:, None] - (-(k + 1) * n // out)


def _resize_image(s: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """The whole photo area-resampled to (1, out_h, out_w, C) float32 from its integral image: whole rows are
    gathered first (row copies), then the columns of the much smaller row-bin differences."""
    h, w = s.shape[0] - 1, s.shape[1] - 1
    (ys, ye), (xs, xe) = (b[0] for b in _bins(np.array([0]), np.array([h]), out_h)), \
        (b[0] for b in _bins(np.array([0]), np.array([w]), out_w))
    rows = np.take(s, ye, axis=0) - np.take(s, ys, axis=0)      # (out_h, W+1, C): each row-bin's column integral
    sums = np.take(rows, xe, axis=1) - np.take(rows, xs, axis=1)
    return _mean(sums, (ye - ys)[:, None] * (xe - xs)[None, :])[None]


def _mean(sums: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """sums / cnt as float32, divided in float64 (what torch's area interpolation gives, bit for bit)."""
    out = np.empty(sums.shape, np.float32)
    np.divide(sums, cnt.astype(np.float64)[..., None], out=out, casting="unsafe")
    return out


def _area_resize(s: np.ndarray, y0, y1, x0, x1, out_h: int, out_w: int) -> np.ndarray:
    """Area-resample the windows [y0,y1) x [x0,x1) (int arrays, one per window, may leave the image:
    outside is 0) to (N, out_h, out_w, C) float32. Output cell k averages input rows
    [floor(k*n/out), ceil((k+1)*n/out)) like torch's adaptive_avg_pool2d. The four corners of every cell are
    read with one gather from the flattened integral image."""
    (ys, ye), (xs, xe) = _bins(np.asarray(y0), np.asarray(y1), out_h), _bins(np.asarray(x0), np.asarray(x1), out_w)
    cnt = (ye - ys)[:, :, None] * (xe - xs)[:, None, :]
    h1, w1, c = s.shape
    ye, ys = (np.clip(ye, 0, h1 - 1) * w1)[:, :, None], (np.clip(ys, 0, h1 - 1) * w1)[:, :, None]
    xe, xs = np.clip(xe, 0, w1 - 1)[:, None, :], np.clip(xs, 0, w1 - 1)[:, None, :]
    corners = np.take(s.reshape(-1, c), np.stack([ye + xe, ys + xs, ys + xe, ye + xs]).reshape(4, -1), axis=0)
    sums = (corners[0] + corners[1]) - (corners[2] + corners[3])
    return _mean(sums.reshape(len(ys), out_h, out_w, c), cnt)


def _run_on_crops(s: np.ndarray, boxes: np.ndarray, size: int, net: Runner, batch: int) -> list[np.ndarray]:
    """Crop facenet-pytorch's pixel window for each box (cols floor(x1)-1 .. floor(x2)-1), resize, run."""
    b = np.floor(boxes[:, :4]).astype(np.int64)
    outs = []
    for i in range(0, len(b), batch):
        c = b[i:i + batch]
        crops = _area_resize(s, c[:, 1] - 1, c[:, 3], c[:, 0] - 1, c[:, 2], size, size)
        outs.append(net(preprocess(crops)))
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


def _proposals(s: np.ndarray, h: int, w: int, pnet: Runner, cfg: DetectorConfig) -> np.ndarray:
    """Stage 1: P-Net over the pyramid -> (N, 5) squared boxes + score."""
    found = []
    for scale in pyramid_scales(h, w, cfg):
        img = _resize_image(s, int(h * scale + 1), int(w * scale + 1))
        reg, prob = pnet(preprocess(img))
        yy, xx = np.nonzero(prob[0, 1] >= cfg.thresholds[0])
        if yy.size == 0:
            continue
        xy = np.stack([xx, yy], 1).astype(np.float64)
        boxes = np.concatenate([np.floor((2 * xy + 1) / scale), np.floor((2 * xy + 12) / scale),
                                prob[0, 1, yy, xx, None], reg[0][:, yy, xx].T], axis=1)
        found.append(boxes[nms(boxes, boxes[:, 4], cfg.nms_thresholds[0])])
    if not found:
        return np.zeros((0, 5))
    boxes = np.concatenate(found)
    boxes = boxes[nms(boxes, boxes[:, 4], cfg.nms_thresholds[1])]
    return _square(_bbreg(boxes[:, :5], boxes[:, 5:9], plus_one=False))


def detect(rgb: np.ndarray, pnet: Runner | nn.Module, rnet: Runner | nn.Module, onet: Runner | nn.Module,
           cfg: DetectorConfig = DetectorConfig()) -> list[Face]:
    """Find faces in an (H, W, 3) RGB uint8 image; best score first. Nets may be runners or torch modules."""
    rgb = np.asarray(rgb)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"detect() needs an (H, W, 3) RGB image, got shape {rgb.shape}")
    pnet, rnet, onet = (torch_runner(n) if isinstance(n, nn.Module) else n for n in (pnet, rnet, onet))
    h, w = rgb.shape[:2]
    s = _integral(rgb)

    boxes = _proposals(s, h, w, pnet, cfg)
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


# Factories named in params.yaml (`models.<net>.factory`): one exportable graph each, outputs named for ONNX.
PNet.output_names = ("bbox_reg", "prob")
RNet.output_names = ("bbox_reg", "prob")
ONet.output_names = ("bbox_reg", "landmarks", "prob")


def _build(cls: type[nn.Module], weights: str | Path) -> nn.Module:
    net = cls()
    net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=True)
    return net.eval()


def build_pnet(weights: str | Path) -> PNet:
    return _build(PNet, weights)


def build_rnet(weights: str | Path) -> RNet:
    return _build(RNet, weights)


def build_onet(weights: str | Path) -> ONet:
    return _build(ONet, weights)
