"""The vectorised MTCNN glue (kiln_runtime/mtcnn.py) against a plain reference cascade kept here.

The reference is the cascade as facenet-pytorch writes it: torch's area interpolation for every pyramid level and
every crop (zero-padded outside the photo), P-Net's hits decoded and NMS'd one level at a time, NMS one kept box at
a time. Both run the same torch nets, so every input each net receives and every detection (box, score,
landmarks) must be identical to the last bit — on every pinned photo and on synthetic frames.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kiln_runtime import mtcnn as M
from pipeline.models import mtcnn as torch_nets

PHOTOS = ["person_a_1", "person_a_2", "person_b_1", "person_b_2", "impostor_1", "impostor_2"]


# ------------------------------------------------------------------------------------------ the plain reference
def area(pixels: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """(H, W, 3) pixels -> (out_h, out_w, 3) float32 by torch's area interpolation in float64 (facenet-pytorch's
    imresample, at full precision)."""
    t = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float64))[None]
    return torch.nn.functional.interpolate(t, (out_h, out_w), mode="area").float()[0].permute(1, 2, 0).numpy()


def plain_nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """Greedy NMS one kept box at a time: keep the best box left, drop those it overlaps by more than threshold."""
    x1, y1, x2, y2 = np.asarray(boxes, dtype=np.float64).T[:4]
    areas = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
    order, keep = np.argsort(-np.asarray(scores), kind="stable"), []
    while order.size:
        i, rest = order[0], order[1:]
        keep.append(i)
        inter = (np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]))
                 * np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest])))
        denom = np.minimum(areas[i], areas[rest]) if mode == "min" else areas[i] + areas[rest] - inter
        order = rest[inter <= threshold * denom]
    return np.asarray(keep, dtype=np.int64)


def plain_crops(rgb: np.ndarray, boxes: np.ndarray, size: int) -> np.ndarray:
    """Each box's window (rows floor(y1)-1 .. floor(y2)-1, likewise columns), zero-padded where it leaves the
    photo, area-resized to size x size and normalised: (N, 3, size, size)."""
    h, w = rgb.shape[:2]
    b = np.floor(boxes[:, :4]).astype(np.int64)
    pad = int(max(1, -b[:, :2].min() + 1, b[:, 2].max() - w, b[:, 3].max() - h))
    padded = np.zeros((h + 2 * pad, w + 2 * pad, 3), np.uint8)
    padded[pad:pad + h, pad:pad + w] = rgb
    return M.preprocess(np.stack([area(padded[y1 - 1 + pad:y2 + pad, x1 - 1 + pad:x2 + pad], size, size)
                                  for x1, y1, x2, y2 in b]))


def bbreg(boxes: np.ndarray, reg: np.ndarray, plus_one: bool = True) -> np.ndarray:
    wh = boxes[:, 2:4] - boxes[:, 0:2] + (1 if plus_one else 0)
    out = boxes.copy()
    out[:, :4] = boxes[:, :4] + reg * np.tile(wh, 2)
    return out


def square(boxes: np.ndarray) -> np.ndarray:
    wh = boxes[:, 2:4] - boxes[:, 0:2]
    side = wh.max(1, keepdims=True)
    out = boxes.copy()
    out[:, 0:2] = boxes[:, 0:2] + wh * 0.5 - side * 0.5
    out[:, 2:4] = out[:, 0:2] + side
    return out


def run_batched(net, crops: np.ndarray, batch: int) -> list[np.ndarray]:
    outs = [net(crops[i:i + batch]) for i in range(0, len(crops), batch)]
    return [np.concatenate(o) for o in zip(*outs)]


def plain_detect(rgb: np.ndarray, pnet, rnet, onet, cfg: M.DetectorConfig) -> list[M.Face]:
    h, w = rgb.shape[:2]
    found = []
    for scale in M.pyramid_scales(h, w, cfg):
        reg, prob = pnet(M.preprocess(area(rgb, int(h * scale + 1), int(w * scale + 1))))
        yy, xx = np.nonzero(prob[0, 1] >= cfg.thresholds[0])
        if yy.size == 0:
            continue
        xy = np.stack([xx, yy], 1).astype(np.float64)
        boxes = np.concatenate([np.floor((2 * xy + 1) / scale), np.floor((2 * xy + 12) / scale),
                                prob[0, 1, yy, xx, None], reg[0][:, yy, xx].T], axis=1)
        found.append(boxes[plain_nms(boxes, boxes[:, 4], cfg.nms_thresholds[0])])
    if not found:
        return []
    boxes = np.concatenate(found)
    boxes = boxes[plain_nms(boxes, boxes[:, 4], cfg.nms_thresholds[1])]
    boxes = square(bbreg(boxes[:, :5], boxes[:, 5:9], plus_one=False))
    boxes = boxes[(boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)]
    if len(boxes) == 0:
        return []
    reg, prob = run_batched(rnet, plain_crops(rgb, boxes, 24), cfg.batch_size)
    ok = prob[:, 1] > cfg.thresholds[1]
    boxes, reg = np.concatenate([boxes[ok, :4], prob[ok, 1:2]], 1), reg[ok]
    pick = plain_nms(boxes, boxes[:, 4], cfg.nms_thresholds[2])
    boxes = square(bbreg(boxes[pick], reg[pick]))
    boxes = boxes[(boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)]
    if len(boxes) == 0:
        return []
    reg, lm, prob = run_batched(onet, plain_crops(rgb, boxes, 48), cfg.batch_size)
    ok = prob[:, 1] > cfg.thresholds[2]
    boxes, reg, lm = np.concatenate([boxes[ok, :4], prob[ok, 1:2]], 1), reg[ok], lm[ok]
    wh = boxes[:, 2:4] - boxes[:, 0:2] + 1
    points = np.stack([wh[:, :1] * lm[:, :5] + boxes[:, :1] - 1, wh[:, 1:] * lm[:, 5:] + boxes[:, 1:2] - 1], 2)
    boxes = bbreg(boxes, reg)
    pick = plain_nms(boxes, boxes[:, 4], cfg.nms_thresholds[3], mode="min")
    return [M.Face(tuple(float(v) for v in boxes[i, :4]), float(boxes[i, 4]), points[i]) for i in pick]


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def nets(assets_dir: Path) -> list:
    weights = (assets_dir / "mtcnn" / f"{n}.pt" for n in ("pnet", "rnet", "onet"))
    return [torch_nets.torch_runner(n) for n in torch_nets.load_nets(*weights)]


@pytest.fixture(scope="module")
def photos(assets_dir: Path) -> dict[str, np.ndarray]:
    return {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in (assets_dir / "photos").rglob("*.jpg")}


def recorded(nets: list) -> tuple[list, list]:
    """The nets, each also keeping a copy of every input it receives."""
    feeds: list = [[], [], []]

    def wrap(k):
        def run(x):
            feeds[k].append(np.array(x, copy=True))
            return nets[k](x)
        return run
    return [wrap(k) for k in range(3)], feeds


def assert_same_cascade(rgb: np.ndarray, nets: list, cfg: M.DetectorConfig) -> list[M.Face]:
    fast_nets, fast_feeds = recorded(nets)
    plain_nets, plain_feeds = recorded(nets)
    got, want = M.detect(rgb, *fast_nets, cfg), plain_detect(rgb, *plain_nets, cfg)
    for name, f, p in zip(("P-Net", "R-Net", "O-Net"), fast_feeds, plain_feeds):
        assert len(f) == len(p), f"{name}: {len(f)} calls, the reference made {len(p)}"
        for k, (a, b) in enumerate(zip(f, p)):
            assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, (name, k, a.shape, b.shape)
            assert a.tobytes() == b.tobytes(), f"{name} input {k} {a.shape}: {int((a != b).sum())} values differ"
    assert len(got) == len(want)
    for g, r in zip(got, want):
        assert bits(g.box, g.score) == bits(r.box, r.score), (g.box, r.box, g.score, r.score)
        assert g.landmarks.dtype == r.landmarks.dtype and g.landmarks.tobytes() == r.landmarks.tobytes()
    return got


def bits(box: tuple[float, ...], score: float) -> bytes:
    return np.array([*box, score], np.float64).tobytes()


# ------------------------------------------------------------------------------------------ the cascade
@pytest.mark.parametrize("min_face", [40, 20])
@pytest.mark.parametrize("name", PHOTOS)
def test_every_photo_matches_the_plain_cascade_bit_for_bit(nets, photos, name, min_face):
    faces = assert_same_cascade(photos[name], nets, M.DetectorConfig(min_face_size=min_face))
    assert len(faces) == 1


def frame(photos: dict[str, np.ndarray]) -> np.ndarray:
    """Three portraits side by side (bench/e2e.py's multi-face frame), then a fourth, larger one whose face is cut
    by the frame's right and bottom edges (its crops leave the photo: zero padding)."""
    tiles = [np.asarray(Image.fromarray(photos[n]).resize((300, 380), Image.BILINEAR))
             for n in ("person_a_2", "person_b_2", "impostor_1")]
    cut = np.asarray(Image.fromarray(photos["person_a_1"]).resize((400, 500), Image.BILINEAR))[:380, :260]
    return np.ascontiguousarray(np.concatenate([*tiles, cut], 1))


def test_multi_face_frame_matches_the_plain_cascade_bit_for_bit(nets, photos):
    faces = assert_same_cascade(frame(photos), nets, M.DetectorConfig(min_face_size=40))
    assert len(faces) >= 3


def test_odd_frames_match_the_plain_cascade(nets, photos):
    rng = np.random.default_rng(34)
    cfg = M.DetectorConfig(min_face_size=40)
    assert assert_same_cascade(rng.integers(0, 256, (301, 433, 3), dtype=np.uint8), nets, cfg) == []   # noise
    assert assert_same_cascade(np.zeros((30, 45, 3), np.uint8), nets, cfg) == []       # below one pyramid level
    # a face at the top-left corner, cut by two edges; a low threshold lets many boxes through to O-Net
    corner = np.ascontiguousarray(np.asarray(Image.fromarray(photos["person_b_1"]).resize((358, 450)))[60:, 70:])
    assert_same_cascade(corner, nets, M.DetectorConfig(min_face_size=20, thresholds=(0.5, 0.5, 0.5)))


# ------------------------------------------------------------------------------------------ NMS
def random_boxes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Clustered boxes with repeated scores and some zero-area ones."""
    centre = rng.uniform(0, 200, (6, 2))[rng.integers(0, 6, n)] + rng.normal(0, 8, (n, 2))
    wh = rng.uniform(0, 40, (n, 2)) * (rng.uniform(size=(n, 1)) > 0.05)
    boxes = np.concatenate([centre - wh / 2, centre + wh / 2], 1).round(1)
    return boxes, rng.integers(0, 40, n) / 40.0


@pytest.mark.parametrize("n", [0, 1, 7, 127, 128, 129, 600])
def test_nms_matches_the_one_box_at_a_time_loop(n):
    rng = np.random.default_rng(n)
    boxes, scores = random_boxes(rng, n)
    for mode in ("union", "min"):
        for threshold in (0.0, 0.3, 0.5, 0.7, 1.0):
            got = M.nms(boxes, scores, threshold, mode)
            assert got.dtype == np.int64 and np.array_equal(got, plain_nms(boxes, scores, threshold, mode)), \
                (mode, threshold)


def test_grouped_nms_is_nms_within_each_group():
    rng = np.random.default_rng(7)
    boxes, scores = random_boxes(rng, 700)
    group = np.sort(rng.integers(0, 9, len(boxes)))             # 9 groups of ~78, one of them spanning blocks
    order = np.lexsort((-scores, group))
    got = order[M._greedy(boxes[order], 0.5, group=group[order])]
    want = np.concatenate([np.flatnonzero(group == g)[plain_nms(boxes[group == g], scores[group == g], 0.5)]
                           for g in range(9)])
    assert np.array_equal(got, want)


# ------------------------------------------------------------------------------------------ resampling
@pytest.mark.parametrize("shape, out", [((800, 700, 3), (3, 2)), ((57, 83, 3), (13, 29)), ((300, 200, 3), (24, 24))])
def test_levels_and_crops_from_an_int32_or_float64_integral_are_torch_area(shape, out):
    """Both integral dtypes (float64 is what photos too large for int32 get) and both division paths of
    _net_input: float32 while every bin sums below 2**24, float64 for the (3, 2) level's ~93,000-pixel bins of
    bright pixels (sums ~2.2e7: not all exact in float32)."""
    img = np.random.default_rng(shape[0]).integers(200 if out == (3, 2) else 0, 256, shape).astype(np.uint8)
    want = M.preprocess(area(img, *out))
    s = M.integral_image(img)
    assert s.dtype == np.int32
    for integral in (s, s.astype(np.float64)):
        (level,) = M.area_levels(integral, [out])
        assert np.array_equal(level, want)
        if out[0] == out[1]:
            crop = M.area_crops(integral, *(np.array([v]) for v in (0, shape[0], 0, shape[1])), out[0])
            assert np.array_equal(crop, want)
