"""MTCNN: weights load, detection on the test portraits, O-Net on lfw_subset, NMS, ONNX parity."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kiln_runtime import mtcnn as glue
from pipeline.models import mtcnn as M

PHOTOS = ["person_a_1", "person_a_2", "person_b_1", "person_b_2", "impostor_1", "impostor_2"]


@pytest.fixture(scope="module")
def photos(assets_dir: Path) -> dict[str, Path]:
    return {p.stem: p for p in (assets_dir / "photos").rglob("*.jpg")}


@pytest.fixture(scope="module")
def weights(assets_dir: Path) -> list[Path]:
    return [assets_dir / "mtcnn" / f"{n}.pt" for n in ("pnet", "rnet", "onet")]


@pytest.fixture(scope="module")
def nets(weights: list[Path]) -> tuple[M.PNet, M.RNet, M.ONet]:
    return M.load_nets(*weights)


def _photo(photos: dict[str, Path], name: str) -> np.ndarray:
    return np.asarray(Image.open(photos[name]).convert("RGB"))


def test_parameter_counts_and_strict_load(weights, nets):
    counts = [sum(p.numel() for p in net.parameters()) for net in nets]
    assert counts == [6_632, 100_178, 389_040]
    for net, path in zip(nets, weights):
        state = torch.load(path, map_location="cpu", weights_only=True)
        result = type(net)().load_state_dict(state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        assert not net.training


@pytest.mark.parametrize("name", PHOTOS)
def test_one_face_per_portrait(nets, photos, name):
    faces = M.detect(_photo(photos, name), *nets)
    assert len(faces) == 1, [f.score for f in faces]
    face = faces[0]
    assert face.score > 0.9
    x1, y1, x2, y2 = face.box
    lm = face.landmarks
    assert lm.shape == (5, 2)
    assert np.all((lm[:, 0] > x1) & (lm[:, 0] < x2) & (lm[:, 1] > y1) & (lm[:, 1] < y2))
    left_eye, right_eye, nose, mouth_l, mouth_r = lm
    assert left_eye[0] < right_eye[0] and mouth_l[0] < mouth_r[0]
    assert max(left_eye[1], right_eye[1]) < min(mouth_l[1], mouth_r[1])
    assert min(left_eye[1], right_eye[1]) < nose[1] < max(mouth_l[1], mouth_r[1])


def test_onet_separates_lfw_subset_faces_from_non_faces(nets):
    from skimage import data as skimage_data
    grey = skimage_data.lfw_subset()  # 100 faces, then 100 non-faces; 25x25 floats in [0, 1]
    assert grey.shape == (200, 25, 25)
    rgb = np.stack([
        np.asarray(Image.fromarray(np.round(g * 255).astype(np.uint8)).resize((48, 48), Image.BILINEAR).convert("RGB"))
        for g in grey
    ])
    prob = M.torch_runner(nets[2])(M.preprocess(rgb))[-1][:, 1]
    assert (prob[:100] > 0.7).sum() >= 95
    assert (prob[100:] > 0.7).sum() <= 5


def test_nms_hand_made_case():
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 5, 5]], dtype=float)
    scores = np.array([0.9, 0.8, 0.7, 0.95])
    # IoU(A,B) = 81/119 = 0.68; IoU(A,D) = 0.25 but D lies inside A (min-overlap 1.0); C overlaps nothing.
    assert M.nms(boxes, scores, 0.5).tolist() == [3, 0, 2]
    assert M.nms(boxes, scores, 0.7).tolist() == [3, 0, 1, 2]
    assert M.nms(boxes, scores, 0.5, mode="min").tolist() == [3, 2]
    assert M.nms(np.zeros((0, 4)), np.zeros(0), 0.5).size == 0


def _torch_area(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    t = torch.from_numpy(img).permute(2, 0, 1)[None].double()
    return torch.nn.functional.interpolate(t, (out_h, out_w), mode="area")[0].permute(1, 2, 0).float().numpy()


@pytest.mark.parametrize("shape, out", [((57, 83, 3), (13, 29)), ((900, 716, 3), (271, 216)), ((40, 31, 3), (40, 31)),
                                        ((20, 17, 3), (47, 33)), ((1000, 31, 3), (12, 12))])
def test_area_resampling_is_torch_area_interpolation_bit_for_bit(shape, out):
    """The integral images (OpenCV, one per colour plane), a pyramid level (rows, then columns) and a crop (four
    corners per cell) give exactly torch's area interpolation — what facenet-pytorch runs — up- and downsampling
    alike, normalised as ``preprocess`` normalises."""
    img = np.random.default_rng(shape[0]).integers(0, 256, shape).astype(np.uint8)
    s = glue.integral_image(img)
    exact = np.zeros((shape[0] + 1, shape[1] + 1, 3), np.int64)
    exact[1:, 1:] = img.astype(np.int64).cumsum(0).cumsum(1)
    assert np.array_equal(s, exact.transpose(2, 0, 1))
    (level,) = glue.area_levels(s, [out])
    assert np.array_equal(level, M.preprocess(_torch_area(img, *out)))
    crop = glue.area_crops(s, *(np.array([v]) for v in (0, shape[0], 0, shape[1])), out[0])
    assert np.array_equal(crop, M.preprocess(_torch_area(img, out[0], out[0])))


def test_crops_that_leave_the_photo_are_zero_padded():
    img = np.random.default_rng(7).integers(0, 256, (60, 50, 3)).astype(np.uint8)
    padded = np.zeros((60 + 40, 50 + 40, 3), np.uint8)
    padded[20:80, 20:70] = img
    s = glue.integral_image(img)
    boxes = [(-10, 30, -15, 20), (40, 75, 30, 61), (-20, 80, -20, 70), (5, 17, 9, 40)]    # y0, y1, x0, x1
    crops = glue.area_crops(s, *(np.array(v) for v in zip(*boxes)), 24)
    for (y0, y1, x0, x1), crop in zip(boxes, crops):
        want = M.preprocess(_torch_area(padded[y0 + 20:y1 + 20, x0 + 20:x1 + 20], 24, 24))[0]
        assert np.array_equal(crop, want), (y0, x0)


def test_pyramid_and_empty_image(nets):
    cfg = M.DetectorConfig(min_face_size=40)
    scales = M.pyramid_scales(400, 300, cfg)
    assert scales[0] == pytest.approx(0.3) and 300 * scales[-1] >= 12 > 300 * scales[-1] * cfg.factor
    assert M.detect(np.zeros((120, 160, 3), np.uint8), *nets, cfg) == []


@pytest.fixture(scope="module")
def onnx_runners(nets, tmp_path_factory):
    import onnxruntime as ort
    out, runners = tmp_path_factory.mktemp("onnx"), []
    specs = [(nets[0], (1, 3, 40, 30), ["reg", "prob"], {0: "n", 2: "h", 3: "w"}),
             (nets[1], (2, 3, 24, 24), ["reg", "prob"], {0: "n"}),
             (nets[2], (2, 3, 48, 48), ["reg", "landmarks", "prob"], {0: "n"})]
    for net, shape, names, axes in specs:
        path = out / f"{type(net).__name__}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter is "legacy"
            torch.onnx.export(net, (torch.zeros(shape),), str(path), dynamo=False, opset_version=17,
                              input_names=["x"], output_names=names,
                              dynamic_axes={"x": axes, **{n: {0: "n"} for n in names}})
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        runners.append(lambda x, s=sess: tuple(s.run(None, {"x": x})))
    return runners


@pytest.mark.parametrize("index, shapes", [(0, [(1, 3, 12, 12), (3, 3, 97, 61)]),
                                           (1, [(1, 3, 24, 24), (7, 3, 24, 24)]),
                                           (2, [(1, 3, 48, 48), (5, 3, 48, 48)])])
def test_onnx_export_matches_torch(nets, onnx_runners, index, shapes):
    rng = np.random.default_rng(index)
    for shape in shapes:
        x = rng.uniform(-1, 1, shape).astype(np.float32)
        expected, got = M.torch_runner(nets[index])(x), onnx_runners[index](x)
        assert [e.shape for e in expected] == [g.shape for g in got]
        for e, g in zip(expected, got):
            np.testing.assert_allclose(g, e, atol=1e-4, rtol=0)


def test_onnx_runtime_sessions_plug_into_detect(nets, onnx_runners, photos):
    rgb = _photo(photos, "person_b_1")
    (expected,), (got,) = M.detect(rgb, *nets), M.detect(rgb, *onnx_runners)
    np.testing.assert_allclose(got.box, expected.box, atol=0.01)
    np.testing.assert_allclose(got.landmarks, expected.landmarks, atol=0.01)
