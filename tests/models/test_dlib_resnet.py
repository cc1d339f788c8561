"""DlibResNet vs dlib itself, the .dat reader's rejection of bad files, and ONNX export with a dynamic batch."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.models.dlib_resnet import DAT_NAME, BLOCKS, DatFormatError, DlibResNet, build_embedder, read_dat

PARITY_TOL = 1e-5


@pytest.fixture(scope="module")
def dat(assets_dir: Path) -> Path:
    return assets_dir / DAT_NAME


@pytest.fixture(scope="module")
def model(dat: Path) -> DlibResNet:
    return build_embedder(dat)


def _photos(dat: Path) -> list[Path]:
    """The pinned test photos, fetched beside the .dat under photos/<identity>/."""
    return sorted((dat.parent / "photos").rglob("*.jpg"), key=lambda p: p.name)


def _chips(dat: Path) -> list[np.ndarray]:
    """150x150 uint8 RGB chips: centre crops of up to 6 photos (colour ramps stand in if <4 exist), plus noise."""
    from PIL import Image

    chips = []
    for photo in _photos(dat)[:6]:
        img = Image.open(photo).convert("RGB")
        side = min(img.size)
        left, top = (img.width - side) // 2, (img.height - side) // 2
        chips.append(np.asarray(img.crop((left, top, left + side, top + side)).resize((150, 150), Image.BILINEAR)))
    ramp = np.linspace(0, 255, 150)
    for i in range(len(chips), 4):
        chips.append(np.stack([np.add.outer(ramp, ramp * i) % 256, np.add.outer(ramp * i, ramp) % 256,
                               np.full((150, 150), 40.0 * i)], axis=-1).astype(np.uint8))
    chips.append(np.random.default_rng(0).integers(0, 256, (150, 150, 3), dtype=np.uint8))
    return chips


def test_reader_finds_the_architecture(dat: Path) -> None:
    w = read_dat(dat)
    assert len(w.convs) == 1 + 2 * len(BLOCKS) == 29 and len(w.affines) == 29
    assert [c[0].shape for c in w.convs[:2]] == [(32, 3, 7, 7), (32, 32, 3, 3)] and w.fc.shape == (128, 256)
    assert all(c[1] is not None and c[1].shape == (c[0].shape[0],) for c in w.convs)
    assert np.allclose(w.input_mean, (122.782, 117.001, 104.298), atol=1e-4)
    assert w.dist_thresh == pytest.approx(0.6) and w.margin == pytest.approx(0.04)
    assert w.layers.count("add_prev") == 14 and w.layers.count("relu") == 29


def test_matches_dlib(dat: Path, model: DlibResNet) -> None:
    import dlib  # dlib-bin is in the test lock: a missing one fails this test, it never skips
    chips = _chips(dat)
    ref = np.array([np.array(d) for d in dlib.face_recognition_model_v1(str(dat)).compute_face_descriptor(chips)])
    with torch.no_grad():
        x = torch.from_numpy(np.stack(chips)).permute(0, 3, 1, 2).float()
        ours = model(x).numpy()
    assert ours.shape == ref.shape == (len(chips), 128)
    diff = float(np.abs(ours - ref).max())
    print(f"max |DlibResNet - dlib| over {len(chips)} chips: {diff:.3e} (descriptor scale {np.abs(ref).max():.3f})")
    assert diff <= PARITY_TOL
    # batch composition must not matter
    with torch.no_grad():
        single = model(x[:1]).numpy()
    assert np.abs(single - ours[:1]).max() <= PARITY_TOL


@pytest.mark.parametrize("mutation", ["first_1mb", "minus_10_bytes", "trailing_junk", "jpeg", "random_bytes"])
def test_reader_rejects_bad_files(dat: Path, tmp_path: Path, mutation: str) -> None:
    data = dat.read_bytes()
    bad = tmp_path / f"{mutation}.dat"
    if mutation == "first_1mb":
        bad.write_bytes(data[: 1 << 20])
    elif mutation == "minus_10_bytes":
        bad.write_bytes(data[:-10])
    elif mutation == "trailing_junk":
        bad.write_bytes(data + b"junk")
    elif mutation == "jpeg":
        photos = _photos(dat)
        bad.write_bytes(photos[0].read_bytes() if photos else b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(5000))
    else:
        bad.write_bytes(np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    with pytest.raises(DatFormatError) as err:
        read_dat(bad)
    assert str(bad) in err.value.message and "expected" in err.value.message
    assert "kiln assets" in err.value.hint and "sha256" in err.value.hint
    if mutation == "trailing_junk":
        assert "4 unexpected trailing bytes" in err.value.message
    if mutation in ("first_1mb", "minus_10_bytes"):
        assert "truncated" in err.value.message


def test_onnx_export_dynamic_batch(model: DlibResNet) -> None:
    buf = io.BytesIO()
    x = torch.rand(2, 3, 150, 150) * 255
    torch.onnx.export(model, (x,), buf, dynamo=False, opset_version=17, input_names=["input"],
                      output_names=["embedding"], dynamic_axes={"input": {0: "batch"}, "embedding": {0: "batch"}})
    import onnxruntime as ort

    session = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    for n in (1, 3):
        xn = torch.rand(n, 3, 150, 150) * 255
        with torch.no_grad():
            want = model(xn).numpy()
        (got,) = session.run(None, {"input": xn.numpy()})
        assert got.shape == (n, 128) and np.abs(got - want).max() <= 1e-4
