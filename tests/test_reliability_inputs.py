"""Reliability, issue 37: what a user's files really contain — classes [external data] (2: a user ONNX model's
external-data files pinned like the model), [odd inputs] (7: a FIFO named like a photo, a Loop with 2^62 trips,
16-bit and float images) and [layouts] (8: an NHWC embedder, checked before anything runs it, built with
`layout: nhwc` like an NCHW one).

The user models are small real ONNX graphs made here with onnx.helper; the stages run on a scratch project whose
golden chips are the `built` session fixture's."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from conftest import make_root, write_params
from reliability import clean_error, kiln
from pipeline import config, onnx_import
from pipeline.dagtools import dag
from pipeline.data import list_photos, load_rgb
from pipeline.errors import KilnError

SIZE = 150                      # data.chip_size: the default golden chips


def _embedder(nhwc: bool = False, loop: bool = False, opset: int = 13) -> onnx.ModelProto:
    """Conv → Relu → GlobalAveragePool → Flatten → Gemm: an 8-d embedder on 150×150 chips, the same weights every
    call. `nhwc`: the TensorFlow export (channels-last input, a Transpose first); `loop`: a Loop of 2^62 trips that
    passes the features through."""
    rng = np.random.default_rng(37)
    inits = [numpy_helper.from_array(rng.normal(0, 0.05, (4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "b"),
             numpy_helper.from_array(rng.normal(0, 0.5, (8, 4)).astype(np.float32), "fc")]
    shape = [1, SIZE, SIZE, 3] if nhwc else [1, 3, SIZE, SIZE]
    nodes = [helper.make_node("Transpose", ["image"], ["x"], perm=[0, 3, 1, 2])] if nhwc else \
        [helper.make_node("Identity", ["image"], ["x"])]
    nodes += [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[4, 4]), helper.make_node("Relu", ["c"], ["r"]),
              helper.make_node("GlobalAveragePool", ["r"], ["g"]), helper.make_node("Flatten", ["g"], ["f"])]
    if loop:
        inits += [numpy_helper.from_array(np.array(2 ** 62, np.int64), "trips"),
                  numpy_helper.from_array(np.array(True), "go")]
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
             helper.make_node("Identity", ["v_in"], ["v_out"])],
            "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                     helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                     helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4])])
        nodes.append(helper.make_node("Loop", ["trips", "go", "f"], ["f2"], body=body))
    nodes.append(helper.make_node("Gemm", ["f2" if loop else "f", "fc"], ["emb"], transB=1))
    graph = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("image", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _save(folder: Path, proto: onnx.ModelProto, name: str, external: bool = False) -> dict:
    """The model saved under folder/name (external: its weights in name.data beside it); its params.yaml `onnx:`."""
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    if external:
        onnx.save_model(proto, str(p), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{name}.data", size_threshold=0)
        return {"path": str(p), "sha256": _sha(p), "external": {f"{name}.data": _sha(folder / f"{name}.data")}}
    onnx.save_model(proto, str(p))
    return {"path": str(p), "sha256": _sha(p)}


@pytest.fixture
def user_project(tmp_path, assets_dir, built):
    """make(models) → a scratch root with the golden chips and params.yaml plus these user ONNX models
    ({name: (proto, extra params, external?)}), their files under models/."""
    def make(models: dict) -> tuple[Path, config.Config]:
        root = make_root(tmp_path, assets_dir)
        (root / "artifacts" / "data").mkdir(parents=True, exist_ok=True)
        os.symlink(built / "artifacts" / "data" / "golden", root / "artifacts" / "data" / "golden")
        specs = {}
        for name, (proto, extra, external) in models.items():
            src = _save(root / "models", proto, f"{name}.onnx", external)
            src["path"] = Path(src["path"]).relative_to(root).as_posix()
            specs[name] = {"onnx": src, "input_shape": [3, SIZE, SIZE], "metric": "cosine", "verify_threshold": 0.5,
                           **extra}
        params = write_params(root, lambda raw: raw["models"].update(specs))
        return root, config.load(params)
    return make


# ---------------------------------------------------------------------------------------------- [external data]
def test_every_external_data_file_a_model_reads_is_pinned(tmp_path):
    """[external data] A model whose weights sit in model.onnx.data: unpinned it is refused (naming the file to
    pin), pinned it loads with those weights, and a rewritten data file is a sha256 mismatch — not other weights."""
    src = _save(tmp_path, _embedder(), "ext.onnx", external=True)
    path, data = Path(src["path"]), tmp_path / "ext.onnx.data"
    with pytest.raises(KilnError, match=r"reads external data 'ext.onnx.data', which models.ext.onnx.external") as e:
        onnx_import.verify_source(path, src["sha256"], "ext")
    assert "models.ext.onnx.external: {ext.onnx.data:" in e.value.hint
    proto = onnx_import.verify_source(path, src["sha256"], "ext", src["external"])
    assert not onnx_import.external_files(proto)                      # every weight read in, from the pinned bytes
    with pytest.raises(KilnError, match="pins 'other.bin', which .* does not read"):
        onnx_import.verify_source(path, src["sha256"], "ext", {**src["external"], "other.bin": "0" * 64})
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x55
    data.write_bytes(bytes(raw))
    with pytest.raises(KilnError, match=r"ext.onnx.data: sha256 [0-9a-f]{64} differs from models.ext.onnx.external"):
        onnx_import.verify_source(path, src["sha256"], "ext", src["external"])
    data.unlink()
    os.mkfifo(data)                                                   # nor is a FIFO in its place waited on
    with pytest.raises(KilnError, match="not a regular file"):
        onnx_import.verify_source(path, src["sha256"], "ext", src["external"])


def test_golden_and_import_record_external_data_and_verify_sees_it_rewritten(user_project):
    """[external data] golden@ and import@ depend on the data file (dvc.yaml) and list it in their manifests with its
    digests; after the file is rewritten `kiln verify` reports the change and golden@ refuses to run."""
    from pipeline.stages import golden, import_

    root, cfg = user_project({"ext": (_embedder(), {}, True)})
    data = "models/ext.onnx.data"
    for s in ("golden", "import"):
        assert data in dag.deps_of(dag.find(s), cfg, "ext"), s
    golden.run(cfg, "ext", root)
    import_.run(cfg, "ext", root)
    for d in ("artifacts/golden/ext", "artifacts/export/ext"):
        (m,) = (root / d).glob("*.manifest.json")
        ref = next(i for i in json.loads(m.read_text())["inputs"] if i.get("path") == data)
        assert ref["role"] == "onnx_external_data" and ref["sha256"] == _sha(root / data)
    r = kiln(root, "verify", "artifacts/golden/ext", "--root", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    raw = bytearray((root / data).read_bytes())
    raw[-5] ^= 0x55                                                   # another weight, same size
    (root / data).write_bytes(bytes(raw))
    r = kiln(root, "verify", "artifacts/golden/ext", "--root", str(root))
    assert r.returncode == 1 and "ext.onnx.data: input file changed" in r.stdout, r.stdout + r.stderr
    clean_error(kiln(root, "golden", "ext"), 2, "ext.onnx.data: sha256", "differs from models.ext.onnx.external")


# ---------------------------------------------------------------------------------------------- [odd inputs]
def test_a_fifo_named_like_a_photo_is_refused_not_waited_on(tmp_path, assets_dir):
    """[odd inputs] `kiln identify` of a FIFO named .jpg, and a FIFO in the photo folder (dataset@), are one clear
    error at once — not a read that waits for a writer forever."""
    root = make_root(tmp_path, assets_dir)
    os.mkfifo(root / "face.jpg")
    clean_error(kiln(root, "identify", "face.jpg", timeout=60), 2, "face.jpg: not a regular file")
    photos = tmp_path / "photos"
    (photos / "ann").mkdir(parents=True)
    Image.new("RGB", (32, 32)).save(photos / "ann" / "a.jpg")
    os.mkfifo(photos / "ann" / "b.jpg")
    with pytest.raises(KilnError, match="b.jpg: not a regular file"):
        list_photos(photos)


def test_a_loop_in_a_user_model_is_refused_before_the_reference_runs_it(user_project):
    """[odd inputs] golden@ on an embedder with a Loop of 2^62 trips: one clear error from the I/O check, not an ONNX
    Runtime run that never ends (Kiln's embedders and detectors are feed-forward graphs)."""
    root, _ = user_project({"loopy": (_embedder(loop=True), {}, False)})
    clean_error(kiln(root, "golden", "loopy", timeout=60), 2, "has a Loop", "unrolled")
    assert not (root / "artifacts" / "golden" / "loopy").exists()


def test_16_bit_and_float_images_decode_to_their_levels(tmp_path):
    """[odd inputs] A 16-bit PNG (and TIFF) decodes to its levels / 257, not to white; a float TIFF in [0, 1] is
    scaled by 255 and one in [0, 255] kept, not truncated to black; a float image in another range, or a 32-bit
    integer one, is refused in one line."""
    ramp = (np.arange(48 * 64, dtype=np.int64).reshape(48, 64) * 21).astype(np.uint16)      # 0 … 64491
    for name in ("g16.png", "g16.tif"):
        Image.fromarray(ramp).save(tmp_path / name)
        rgb = load_rgb(tmp_path / name)
        assert rgb.shape == (48, 64, 3) and np.abs(rgb[..., 1].astype(int) - np.rint(ramp / 257)).max() == 0, name
    unit = np.linspace(0, 1, 48 * 64, dtype=np.float32).reshape(48, 64)
    for scale in (1, 255):
        Image.fromarray(unit * scale).save(tmp_path / "f.tif")
        rgb = load_rgb(tmp_path / "f.tif")
        assert np.abs(rgb[..., 0].astype(int) - np.rint(unit * 255)).max() <= 1, scale
    for name, a, needle in (("neg.tif", unit - 0.5, "float image with values in [-0.5, 0.5]"),
                            ("i32.tif", ramp.astype(np.int32) * 1000, "32-bit integer image")):
        Image.fromarray(a).save(tmp_path / name)
        with pytest.raises(KilnError, match=needle.replace("[", r"\[").replace("]", r"\]")) as e:
            load_rgb(tmp_path / name)
        assert e.value.hint


# ---------------------------------------------------------------------------------------------- [layouts]
def test_an_nhwc_model_without_layout_is_one_line_before_anything_runs_it(user_project):
    """[layouts] golden@ of an embedder exported the TensorFlow way (N×150×150×3, opset 11) checks its input first:
    one line saying to set layout: nhwc, no ONNX Runtime traceback."""
    root, _ = user_project({"tf": (_embedder(nhwc=True, opset=11), {}, False)})
    clean_error(kiln(root, "golden", "tf"), 2, "is N×150×150×3 (NHWC); set models.tf.layout: nhwc")


def test_an_nhwc_model_with_layout_nhwc_builds_like_an_nchw_one(user_project):
    """[layouts] With `layout: nhwc`, golden@ feeds the original channels last and import@ puts a Transpose in
    front: the imported graph takes NCHW like every other, passes parity, and golden@ gives the same embeddings as
    the NCHW export of the same weights."""
    from pipeline.stages import golden, import_

    root, cfg = user_project({"tf": (_embedder(nhwc=True, opset=11), {"layout": "nhwc"}, False),
                              "pt": (_embedder(), {}, False)})
    emb = {}
    for m in ("tf", "pt"):
        golden.run(cfg, m, root)
        emb[m] = np.load(root / "artifacts" / "golden" / m / "embeddings.npy")
    assert emb["tf"].shape == (len(emb["pt"]), 8) and np.abs(emb["tf"] - emb["pt"]).max() < 1e-4
    r = import_.run(cfg, "tf", root)
    assert r.report["layout"].startswith("nhwc") and r.report["converted_from_opset"] == 11
    assert r.parity["cosine_min"] > 0.99999
    sess = ort.InferenceSession(str(r.onnx_path), providers=["CPUExecutionProvider"])
    (inp,) = sess.get_inputs()
    assert inp.name == "input" and inp.shape[1:] == [3, SIZE, SIZE]
    with pytest.raises(ValueError, match="layout: nhwc is for models delivered as ONNX"):
        config.ModelConfig(input_shape=(3, SIZE, SIZE), factory="a:b", layout="nhwc", name="x")
