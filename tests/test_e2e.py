"""Detector nets and aligner as compiled graphs, their gates, and photo → identity on built engines only."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

from pipeline import cli, paths
from pipeline.data import list_photos, load_rgb
from pipeline.e2e import System
from pipeline.stages import compile as compile_stage
from pipeline.stages import export, toolchain as toolchain_stage, golden, validate

GRAPHS = ("pnet", "rnet", "onet", "aligner")


@pytest.fixture(scope="module")
def system_root(built, cfg):
    toolchain_stage.run(cfg, built)
    for m in GRAPHS:
        golden.run(cfg, m, built)
        export.run(cfg, m, built)
        compile_stage.run(cfg, f"{m}-ort-cpu-fp32", built)
    compile_stage.run(cfg, "embedder-ort-cpu-fp32", built)
    return built


def test_pnet_is_one_graph_for_every_pyramid_level(system_root):
    m = json.loads((paths.export("pnet", system_root) / "pnet.manifest.json").read_text())
    assert m["build"]["dynamic_axes"] == {"input": [0, 2, 3]}
    index = json.loads((paths.golden("pnet", system_root) / "index.json").read_text())
    shapes = {tuple(np.load(p).shape[2:]) for p in (paths.golden("pnet", system_root) / "reference").glob("*.prob.npy")}
    assert index["feeds"] > 10 and len(shapes) > 10  # many pyramid sizes, all checked against one ONNX
    assert m["results"]["parity"]["max_abs"] < 1e-4


@pytest.mark.parametrize("graph", GRAPHS)
def test_fp32_engines_pass_their_gates(system_root, cfg, graph):
    v = validate.run(cfg, f"{graph}-ort-cpu-fp32", system_root)
    assert v.passed, v.failures


def test_detector_gate_fails_on_moved_landmarks(system_root, cfg):
    strict = cfg.replace(validate=dataclasses.replace(
        cfg.validate, detector=dataclasses.replace(cfg.validate.detector, landmark_err_max=0.0)))
    v = validate.run(strict, "onet-ort-cpu-fp32", system_root)
    assert not v.passed and v.failures[0].startswith("landmark_err_max")
    assert v.metrics["face_agreement"] == 1.0 and v.metrics["lfw_faces_found"] >= 95


def test_aligner_gate_fails_beyond_pixel_tolerance(system_root, cfg):
    strict = cfg.replace(validate=dataclasses.replace(
        cfg.validate, aligner=dataclasses.replace(cfg.validate.aligner, pixel_max_abs_max=0.0)))
    v = validate.run(strict, "aligner-ort-cpu-fp32", system_root)
    assert not v.passed and "pixel_max_abs" in v.failures[0]


@pytest.fixture(scope="module")
def system(system_root, cfg):
    s = System.from_engines(cfg, "ort-cpu", "fp32", system_root)
    s.enroll(system_root)
    return s


def test_every_pinned_photo_is_named_by_the_engines(system, cfg, system_root):
    assert all(e.endswith("-ort-cpu-fp32") for e in system.engines.values())  # no PyTorch in the loop
    photos = list_photos(system_root / cfg.data.photos)
    for i, p in enumerate(photos):
        (m,) = system.identify(load_rgb(p.path))
        assert m.identity == p.identity and m.distance < 0.05
        (loo,) = system.identify(load_rgb(p.path), exclude=i)  # without its own enrolment photo
        expected = p.identity if sum(q.identity == p.identity for q in photos) > 1 else "unknown"
        assert loo.identity == expected, (p.path.name, loo)


def test_identify_cli_bad_photos(system_root, cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(system_root)
    Image.fromarray(np.full((240, 240, 3), 90, np.uint8)).save(tmp_path / "wall.png")
    photos = list_photos(cfg.data.photos)
    tiles = [np.asarray(Image.open(photos[i].path).convert("RGB").resize((300, 380))) for i in (1, 3)]
    Image.fromarray(np.concatenate(tiles, 1)).save(tmp_path / "two.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "broken.jpg").write_bytes(open(photos[0].path, "rb").read()[:2000])

    assert cli.main(["identify", "--precision", "fp32", str(tmp_path / "wall.png")]) == 1
    assert "wall.png: no face found" in capsys.readouterr().out
    assert cli.main(["identify", "--precision", "fp32", str(tmp_path / "two.jpg")]) == 0
    out = capsys.readouterr().out
    assert "two.jpg: 2 faces" in out and photos[1].identity in out and photos[3].identity in out
    for bad in ("notes.txt", "broken.jpg"):
        assert cli.main(["identify", str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err
        assert f"{bad}: not a readable image" in err and "hint:" in err


def test_identify_from_released_engines(system_root, cfg, tmp_path, monkeypatch):
    """--release: every graph comes from its MLflow `production` version, downloaded and checksum-verified."""
    from pipeline import registry
    from pipeline.stages import register

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    engines = [f"{m}-ort-cpu-fp32" for m in (*GRAPHS, "embedder")]
    for e in engines:
        validate.run(cfg, e, system_root)
        receipt = register.run(cfg, e, system_root)
        registry.promote(cfg, receipt.name, receipt.version, system_root, actor="test")
    s = System.from_engines(cfg, "ort-cpu", "fp32", system_root, release_dir=tmp_path / "release")
    assert all("@production(v1)" in v for v in s.engines.values()), s.engines
    s.enroll(system_root)
    photo = list_photos(system_root / cfg.data.photos)[3]
    (m,) = s.identify(load_rgb(photo.path))
    assert m.identity == photo.identity


def test_identify_through_a_gallery_index(system, system_root, cfg):
    """System.use_index: the chosen FAISS index of a gallery (golden identities among distractors) names the
    people as brute force does, and a tampered index is refused before it is read."""
    from dataclasses import replace

    from pipeline.errors import KilnError
    from pipeline.stages import gallery, match

    m = cfg.matching
    small = cfg.replace(matching=replace(m, gallery_sizes=(5000,), sweep=("ivf-flat:nlist={nlist},nprobe=32",),
                                         latency=replace(m.latency, runs_b1=5, runs_b64=2, max_seconds=0.1)))
    gallery.run(small, 5000, system_root)
    match.run(small, 5000, system_root, progress=lambda _: None)
    system.use_index(5000, system_root)
    assert system.engines["matching"].startswith("gallery-5000 (ivf-flat")
    for p in list_photos(system_root / cfg.data.photos):
        (face,) = system.identify(load_rgb(p.path))
        assert face.identity == p.identity
    index = paths.index(5000, system_root) / "index.faiss"
    data = index.read_bytes()
    index.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    try:
        with pytest.raises(KilnError, match="do not match their manifest"):
            system.use_index(5000, system_root)
    finally:
        index.write_bytes(data)
        system.index = None


def test_the_leaderboard_ranks_each_graph_at_the_batch_a_system_feeds_it(cfg, tmp_path):
    """R-Net gets every candidate crop of a photo in one call, so it is ranked at batch 8, where this host's batch-1
    winner (per-call overhead) loses; the embedder, once per face, at batch 1. A failed gate is never marked, however
    fast. Timings are this Zen 5's bench (docs/measurements.md, "Who wins")."""
    from pipeline.report import leaderboard

    timed = {"rnet": {"rnet-ort-cpu-fp32": (0.06, 0.48), "rnet-aoti-cpu-fp32": (0.08, 0.27),
                      "rnet-openvino-cpu-fp32": (0.14, 0.23)},
             "embedder": {"embedder-ort-cpu-fp32": (2.55, 13.45), "embedder-ort-cpu-int8": (1.18, 6.35),
                          "embedder-openvino-cpu-fp32": (1.95, 5.0), "embedder-openvino-cpu-int8": (0.69, 4.13)}}
    for model, engines in timed.items():
        for name in engines:
            verdict = "fail" if name == "embedder-openvino-cpu-int8" else "pass"
            paths.validation(name, tmp_path).mkdir(parents=True)
            (paths.validation(name, tmp_path) / paths.VALIDATION_FILE).write_text(json.dumps({"verdict": verdict}))
        paths.bench(model, tmp_path).mkdir(parents=True)
        (paths.bench(model, tmp_path) / paths.BENCH_FILE).write_text(json.dumps({"engines": {
            name: {"b1_p50_ms": b1, "b8_p50_ms": b8} for name, (b1, b8) in engines.items()}}))
    rows, winners = leaderboard.rows(cfg, tmp_path)
    assert cfg.bench.batches[-1] == 8 and leaderboard.ranked_at(cfg, "rnet") == 8
    assert winners == {"rnet": "rnet-openvino-cpu-fp32", "embedder": "embedder-ort-cpu-int8"}
    assert "fastest at batch 8 that passes its gate" in leaderboard.markdown(rows)
