"""system@<name>: a face system's engines gated end to end against the reference system, on built engines only."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO, write_params
from pipeline import cli, config, paths
from pipeline.errors import KilnError
from pipeline.manifest import manifest_path, read_manifest, verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.stages import export, golden, validate
from pipeline.stages import system as system_stage
from pipeline.stages import toolchain as toolchain_stage

GRAPHS = ("pnet", "rnet", "onet", "aligner", "embedder")
SYSTEM = "dlib-mtcnn"


def _fp32(raw: dict, **system) -> None:
    """The default system on the FP32 ORT engines this module builds (its INT8 embedder needs calibrate@)."""
    raw["systems"][SYSTEM].update(precision="fp32", **system)


@pytest.fixture(scope="module")
def root(built, cfg):
    """`built` with every graph of the default system compiled for ort-cpu FP32 and validated."""
    toolchain_stage.run(cfg, built)
    for m in GRAPHS:
        if m != "embedder":
            golden.run(cfg, m, built)
            export.run(cfg, m, built)
        compile_stage.run(cfg, f"{m}-ort-cpu-fp32", built)
        assert validate.run(cfg, f"{m}-ort-cpu-fp32", built).passed
    return built


@pytest.fixture(scope="module")
def fp32_cfg(root, tmp_path_factory):
    return config.load(write_params(tmp_path_factory.mktemp("sys-params"), _fp32))


def _files(root) -> dict[str, bytes]:
    d = paths.system(SYSTEM, root)
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_default_system_passes_and_its_outputs_verify(root, fp32_cfg):
    report = system_stage.run(fp32_cfg, SYSTEM, root)
    assert report["verdict"] == "pass" and report["failures"] == []
    m = report["metrics"]
    assert m["faces_found"] == m["reference_faces"] >= 6 and m["faces_missed"] == m["faces_extra"] == 0
    assert m["identity_agreement"] == 1.0 and m["unknown_loo"] == m["unknown_ref_loo"] >= 1   # one-photo people
    assert m["pairs"] == m["reference_faces"] * (m["reference_faces"] - 1) // 2 and m["decision_flips"] == 0
    d = paths.system(SYSTEM, root)
    mpath = manifest_path(d, SYSTEM)
    assert verify_manifest(mpath, root) == []
    man = read_manifest(mpath)
    assert man["kind"] == "system" and man["results"]["verdict"] == "pass"
    refs = {i["manifest"] for i in man["inputs"] if "manifest" in i}
    for g in GRAPHS:       # every engine and its validation, by manifest
        assert f"artifacts/engines/{g}-ort-cpu-fp32/{g}-ort-cpu-fp32.manifest.json" in refs
        assert f"artifacts/validation/{g}-ort-cpu-fp32/{g}-ort-cpu-fp32.manifest.json" in refs
    described = json.loads((d / paths.SYSTEM_FILE).read_text())
    assert {g: e["engine"] for g, e in described["engines"].items()} == {g: f"{g}-ort-cpu-fp32" for g in GRAPHS}
    assert described["thresholds"] == {"metric": "l2", "verify_threshold": 0.6}
    # nothing of the host or the run inside: no timings, no absolute paths
    text = b"".join(_files(root).values()).decode()
    assert str(root) not in text and not any(k in text for k in ('"seconds"', '"started_at"', '"cpu"', '"git"'))


def test_same_engines_same_bytes(root, fp32_cfg):
    system_stage.run(fp32_cfg, SYSTEM, root)
    first = _files(root)
    system_stage.run(fp32_cfg, SYSTEM, root)
    assert _files(root) == first and set(first) == {"system.json", "verdict.json", f"{SYSTEM}.manifest.json"}


@pytest.mark.parametrize("pins, problem", [
    ({"embedder": "rnet-ort-cpu-fp32"}, "'rnet-ort-cpu-fp32': a rnet engine, not a embedder one"),
    ({"embedder": "embedder-nope"}, "'embedder-nope': no such engine"),
    ({"sface": "embedder-ort-cpu-fp32"}, "'sface' is not a graph of this system"),
])
def test_a_pinned_engine_of_another_model_is_refused_by_config(tmp_path, pins, problem):
    path = write_params(tmp_path, lambda raw: raw["systems"][SYSTEM].update(engines=pins))
    with pytest.raises(KilnError) as e:
        config.load(path)
    assert f"systems.{SYSTEM}.engines.{next(iter(pins))}" in e.value.message and problem in e.value.message


@pytest.mark.parametrize("change, key", [
    ({"target": "no-such-target"}, "systems.dlib-mtcnn.target"),
    ({"gate": {"box_iou_min": 1.5}}, "systems.dlib-mtcnn.gate.box_iou_min"),
    ({"gate": {"box_iou": 0.9}}, "systems.dlib-mtcnn.gate.box_iou"),
])
def test_bad_system_settings_name_the_key(tmp_path, change, key):
    with pytest.raises(KilnError) as e:
        config.load(write_params(tmp_path, lambda raw: raw["systems"][SYSTEM].update(change)))
    assert f": {key}:" in e.value.message


def test_pinned_engines_win_over_target(tmp_path):
    """A pin replaces the target's pick for that graph only (here the same engine, so the system still passes)."""
    from pipeline.e2e import resolve

    pcfg = config.load(write_params(tmp_path, lambda raw: _fp32(raw, target="openvino-cpu",
                                                                engines={"embedder": "embedder-ort-cpu-fp32"})))
    picks = resolve(pcfg, SYSTEM)
    assert picks["embedder"] == "embedder-ort-cpu-fp32" and picks["pnet"] == "pnet-openvino-cpu-fp32"


def test_a_system_that_flips_a_decision_fails_its_gate(root, fp32_cfg, tmp_path, capsys, monkeypatch):
    """Put the verification threshold between the reference's and the engines' distance of one pair of faces: the
    same engines now change a same/different decision. The CLI exits 1 with one `kiln: gate failed:` line, and the
    verdict is written all the same."""
    report = system_stage.run(fp32_cfg, SYSTEM, root)
    pair = max(report["decisions"], key=lambda d: abs(d["distance"] - d["distance_ref"]))
    assert pair["distance"] != pair["distance_ref"], "engines bit-identical to PyTorch: no decision can flip"
    mid = (pair["distance"] + pair["distance_ref"]) / 2

    def flip(raw):
        _fp32(raw)
        raw["models"]["embedder"]["verify_threshold"] = mid
    params = write_params(tmp_path, flip)
    assert yaml.safe_load(params.read_text())["models"]["embedder"]["verify_threshold"] == mid
    monkeypatch.chdir(root)
    assert cli.main(["system", SYSTEM, "--params", str(params)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("kiln:")] == [err[0]] and \
        err[0].startswith(f"kiln: gate failed: system@{SYSTEM}: decision_agreement")
    verdict = json.loads((paths.system(SYSTEM, root) / paths.VERDICT_FILE).read_text())
    assert verdict["verdict"] == "fail" and verdict["metrics"]["decision_flips"] >= 1
    assert verify_manifest(manifest_path(paths.system(SYSTEM, root), SYSTEM), root) == []


def test_impossible_limits_fail_in_a_copied_cfg(root, fp32_cfg):
    import dataclasses

    from pipeline.errors import GateFailed

    spec = fp32_cfg.system(SYSTEM)
    strict = fp32_cfg.replace(systems={SYSTEM: dataclasses.replace(
        spec, gate=dataclasses.replace(spec.gate, identity_agreement_min=1.0, faces_missed_max=0,
                                       box_iou_min=1.0))})
    report = system_stage.run(fp32_cfg, SYSTEM, root)
    if report["metrics"]["box_iou_min"] == 1.0:
        pytest.skip("box_iou_min is exactly 1.0 here, so no box limit can be above it; the test runs wherever the "
                    "engines' boxes differ from PyTorch's in the last digits (every host measured: 0.9999992); "
                    "test_a_system_that_flips_a_decision_fails_its_gate covers the gate failing")
    with pytest.raises(GateFailed, match="box_iou_min"):
        system_stage.run(strict, SYSTEM, root)
    assert json.loads((paths.system(SYSTEM, root) / paths.VERDICT_FILE).read_text())["verdict"] == "fail"


def test_a_bad_system_name_is_one_error_line(root, capsys, monkeypatch):
    monkeypatch.chdir(root)
    assert cli.main(["system", "no-such-system", "--params", str(REPO / "params.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "kiln: error: system: no 'no-such-system' in this params file" and \
        [line for line in err if line.startswith("kiln:")] == [err[0]]


def test_sysbench_runs_the_gated_system_under_load_and_keeps_its_timings_out_of_the_cache(root, tmp_path, capsys,
                                                                                          monkeypatch):
    """A budget no CPU meets (1 ms): the sweep must stop by itself after its first point, within its bound; the
    numbers land in the uncached outputs and the run record, and the report draws them. No number is asserted."""
    import time

    from pipeline.records import read_record
    from pipeline.stages import sysbench
    from pipeline.sysbench import load

    def tiny(raw):
        _fp32(raw)
        raw["sysbench"].update(streams=[1, 2, 4], seconds=1.0, p99_budget_ms=1, workers=1)
    params = write_params(tmp_path, tiny)
    cfg = config.load(params)
    system_stage.run(cfg, SYSTEM, root)                     # the gate sysbench@ requires
    monkeypatch.chdir(root)
    t0 = time.monotonic()
    assert sysbench.main(["--params", str(params), SYSTEM]) == 0
    took = time.monotonic() - t0
    assert took < load.plan(cfg).bound_s + 300, took        # the bound plus worker start-up, on any host
    out = capsys.readouterr().out
    assert "streams at p99 ≤ 1 ms" in out and "host class" in out
    d = paths.sysbench(SYSTEM, root)
    sb = json.loads((d / "sysbench.json").read_text())
    assert [p["streams"] for p in sb["points"]] == [1] and sb["stopped_at"] == 1 and sb["streams_at_budget"] == 0
    pt = sb["points"][0]
    assert pt["frames"] == pt["decided"] + pt["dropped"] > 0 and not pt["within_budget"]
    gated = json.loads((paths.system(SYSTEM, root) / paths.SYSTEM_FILE).read_text())["engines"]
    assert sb["engines"] == {m: e["engine"] for m, e in gated.items()}       # exactly what system@ gated
    assert sb["plan"]["workers"] == 1 and set(sb["plan"]["threads_per_engine"]) == set(GRAPHS)
    b = json.loads((d / "bottleneck.json").read_text())
    assert set(b["graphs"]) == set(GRAPHS) and all(g["roofline"]["flops_per_frame"] > 0 for g in b["graphs"].values())
    assert b["graphs"]["pnet"]["calls_per_frame"] > 1            # one P-Net call per pyramid level
    record = read_record(f"sysbench@{SYSTEM}", root)
    assert record["streams_at_budget"] == 0 and record["points"] == sb["points"] and record["host_class"]

    from pipeline.report import page as report
    html = report.render(report.for_workspace(cfg, root))
    assert 'id="systems"' in html and "roofline" in html and f"{SYSTEM}: 0 stream(s)" in html
    assert "<th>cores per stream</th>" in html and f"<tr><td>{SYSTEM}</td><td>ort-cpu</td><td>0</td>" in html
