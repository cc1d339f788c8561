"""litert (profiles/edge.yaml; the converter in its own venv from lockfiles/litert-convert.txt, the runtime in the
main one from lockfiles/edge.txt; `setup.sh --test` installs both): the FP32 and full-integer INT8 .tflite from the
torch.export program, NHWC I/O, the float-op audit, the Edge TPU rule audit, the face-task gate, the bench beside ORT,
registration, the fresh-process rebuild and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from pipeline import engines, paths
from pipeline.dagtools import dag, profiles
from pipeline.errors import KilnError
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.stages import toolchain as toolchain_stage, program, validate
from pipeline.targets import edgetpu_rules
from pipeline.targets.base import CompileOptions
from pipeline.targets.litert import TFLITE_FILE, LiteRT
from conftest import REPO, bench_beside_ort, load_in_fresh_process, profile_cfg, versus_ort

FP32, INT8 = "embedder-litert-fp32", "embedder-litert-int8"


@pytest.fixture(scope="module")
def lcfg(tmp_path_factory, cfg):
    """The edge profile plus the full-integer INT8 engine the profile leaves out (it fails the gate: tested below)."""
    assert INT8 not in profiles.load("edge", REPO)["engines"]
    return profile_cfg(tmp_path_factory.mktemp("litert-params"), cfg, "edge", {INT8: {
        "model": "embedder", "target": "litert", "precision": "int8", "source": "artifacts/program/embedder"}})


@pytest.fixture(scope="module")
def built_lt(built, lcfg):
    """Both embedder engines, built by compile@ (with its fresh-process rebuild) from the program."""
    toolchain_stage.run(lcfg, built)
    if not (paths.program("embedder", built) / "embedder.manifest.json").is_file():
        program.run(lcfg, "embedder", built, check_reproducible=False)
    return {n: compile_stage.run(lcfg, n, built) for n in (FP32, INT8)}


def _manifest(name, built):
    return read_manifest(paths.engine(name, built) / f"{name}.manifest.json")


def test_the_toolchain_is_two_environments_fingerprinted_together(monkeypatch):
    tc = LiteRT().probe()
    assert tc.available, tc.line()
    assert tc.rebuild_on["converter.litert-torch"] == "0.10.0" and tc.rebuild_on["ai-edge-litert"] == "2.3.0"
    assert tc.rebuild_on["converter.torch"] == torch.__version__          # the same pinned wheel, in its own venv
    monkeypatch.setenv("KILN_LITERT_PYTHON", "/nonexistent/bin/python")
    gone = LiteRT().probe()
    assert not gone.available and "converter venv /nonexistent" in gone.reason and "--profile edge" in gone.reason


def test_the_profile_calibrates_only_int8_and_tracks_the_converter_code(lcfg):
    doc = yaml.safe_load(dag.render(lcfg)["dag/compile/dvc.yaml"])["stages"]["compile"]
    items = doc["foreach"]
    assert "artifacts/data/calibration" in items[INT8].values()
    assert "artifacts/data/calibration" not in items[FP32].values()
    deps = dag.deps_of(dag.find("compile"), lcfg, FP32)
    assert {"pipeline/targets/litert.py", "pipeline/targets/litert_convert.py",
            "pipeline/targets/edgetpu_rules.py"} <= set(deps)


def test_int8_is_full_integer_with_nhwc_io_and_both_are_checked_reproducible(built_lt, built):
    for name in (FP32, INT8):
        assert verify_manifest(paths.engine(name, built) / f"{name}.manifest.json", root=built) == []
        m = _manifest(name, built)
        assert m["build"]["reproducibility"]["checked"].endswith("bit-identical"), m["build"]["reproducibility"]
        assert m["build"]["io"]["inputs"][0]["shape"] == [1, 150, 150, 3]                 # NHWC, batch 1
        assert m["toolchain"]["target.litert"]["converter.ai-edge-quantizer"] == "0.10.0"
    io = _manifest(INT8, built)["build"]["io"]
    assert [d["dtype"] for d in io["inputs"] + io["outputs"]] == ["int8", "int8"]
    assert _manifest(INT8, built)["build"]["calibration_samples"] == 144
    for r in built_lt.values():
        assert r.audit.native == {"CONV_2D": 29, "FULLY_CONNECTED": 1}, r.audit.native
    assert built_lt[INT8].audit.ok                                   # no op with a float tensor
    assert (paths.engine(INT8, built) / TFLITE_FILE).stat().st_size < 0.3 * (
        paths.engine(FP32, built) / TFLITE_FILE).stat().st_size


def test_the_edge_tpu_rules_map_the_int8_model_and_refuse_the_float_one(built_lt, built, lcfg):
    tpu = _manifest(INT8, built)["results"]["device_query"]["edgetpu"]
    assert tpu["supported"] == tpu["ops"] and tpu["cpu_ops"] == 0 and tpu["unsupported_op_types"] == [], tpu
    assert tpu["min_runtime"] == "14"                                # its TRANSPOSE ops need compiler 16 / runtime 14
    fp = _manifest(FP32, built)["results"]["device_query"]["edgetpu"]
    assert fp["supported"] == 0 and fp["first_unsupported"].startswith("op 0 ") and "float32" in str(fp["why"])
    from pipeline.report import fallbacks

    notes = {r["engine"]: r["note"] for r in fallbacks.rows(lcfg, built) if r["target"] == "litert"}
    assert notes[INT8] == f"edgetpu: {tpu['ops']}/{tpu['ops']} ops supported", notes
    assert notes[FP32].startswith(f"edgetpu: 0/{fp['ops']} ops supported, {fp['ops']} left to the CPU from op 0 ")


def test_the_float_op_audit_catches_a_float_model_audited_as_int8(built_lt, built):
    audit = LiteRT().audit(paths.engine(FP32, built), "int8")
    assert not audit.ok and {f["runs_as"] for f in audit.fallback} == {"float32"}
    assert len(audit.fallback) == sum(built_lt[FP32].audit.native.values()) + sum(built_lt[FP32].audit.other.values())


def _op(index, name, inputs, outputs):
    return {"index": index, "op_name": name, "inputs": np.array(inputs), "outputs": np.array(outputs)}


def _t(index, shape, dtype=np.int8):
    return {"index": index, "name": f"t{index}", "shape_signature": np.array(shape), "dtype": dtype}


def test_edge_tpu_rules_partition_once_at_the_first_unsupported_op():
    tensors = {i: _t(i, [1, 8, 8, 4]) for i in range(6)} | {6: _t(6, [4], np.int32), 7: _t(7, [2, 8, 8, 4])}
    ops = [_op(0, "CONV_2D", [0, 1, 6], [2]), _op(1, "GELU", [2], [3]), _op(2, "ADD", [3, 3], [4]),
           _op(3, "ADD", [4, 7], [5])]
    a = edgetpu_rules.audit(ops, tensors, {0, 7})
    assert (a["supported"], a["cpu_ops"], a["first_unsupported"]) == (1, 3, "op 1 GELU")
    assert a["unsupported_op_types"] == ["ADD", "GELU"]              # the second ADD: batch 2 in a 4-D tensor
    assert "only the 3 innermost" in a["why"]["ADD"] and "not in the Edge TPU op table" in a["why"]["GELU"]
    assert a["unchecked"] == ["CONV_2D: same x/y dilation (unchecked)"]
    dyn = edgetpu_rules.audit([_op(0, "ADD", [0, 8], [1])], tensors | {8: _t(8, [-1, 8, 8, 4])}, {0, 8})
    weights = edgetpu_rules.audit([_op(0, "CONV_2D", [0, 7, 6], [1])], tensors, {0})  # a 4-D filter: no activation
    assert weights["cpu_ops"] == 0, weights
    assert "dynamic shape" in dyn["why"]["ADD"]


def test_the_runner_takes_nchw_float_at_any_batch_and_matches_the_program(built_lt, built):
    x = np.random.default_rng(0).uniform(0, 255, (5, 3, 150, 150)).astype(np.float32)
    ref = torch.export.load(str(paths.program("embedder", built) / program.PROGRAM_FILE)).module()(
        torch.from_numpy(x)).detach().numpy()
    fp32 = engines.load("litert", paths.engine(FP32, built))
    assert float(np.abs(fp32.run(x) - ref).max()) < 1e-4
    assert np.allclose(fp32.run(x[:1]), fp32.run(x)[:1], atol=1e-5)
    y = engines.load("litert", paths.engine(INT8, built)).run(x)
    cos = (y * ref).sum(1) / np.linalg.norm(y, axis=1) / np.linalg.norm(ref, axis=1)
    assert y.shape == (5, 128) and cos.min() > 0.99, cos


def test_the_runner_needs_the_runtime_only(built_lt, built):
    engine = paths.engine(INT8, built)
    y, heavy = load_in_fresh_process("litert", engine, (2, 3, 150, 150), ("torch", "litert_torch", "ai_edge_quantizer"),
                                     built / "lt-probe.npy")
    assert heavy == []
    assert np.array_equal(y, engines.load("litert", engine).run(np.full((2, 3, 150, 150), 100, np.float32)))


def test_fp32_passes_the_face_task_gate_and_full_integer_int8_is_stopped_by_it(built_lt, built, lcfg):
    v = validate.run(lcfg, FP32, built)
    assert v.verdict == "pass" and v.metrics["cosine_min"] >= 0.99999, (v.failures, v.metrics)
    q = validate.run(lcfg, INT8, built)         # measured: cosine mean 0.99884, l2 max 0.136 (chips, AVX-512 Xeon)
    assert q.verdict == "fail", q.metrics
    assert [f.split()[0] for f in q.failures] == ["cosine_mean", "l2_max"], q.failures
    assert q.metrics["cosine_min"] > 0.99 and q.metrics["top1_agreement"] == 1.0, q.metrics


def test_bench_times_litert_beside_ort_in_one_process(built_lt, built, lcfg, tmp_path, capsys):
    report = bench_beside_ort(lcfg, built, (FP32, INT8), tmp_path)
    assert f"{INT8}/{FP32}@b1" in report["ratios"] and f"{INT8}/{FP32}@b8" in report["ratios"], report["ratios"]
    with capsys.disabled():
        print(versus_ort(report, (FP32, INT8)))


def test_registers_fp32_and_refuses_the_failed_int8(built_lt, built, lcfg, registry_env):
    from pipeline import registry
    from pipeline.errors import GateFailed
    from pipeline.stages import register as register_stage

    for name in (FP32, INT8):
        validate.run(lcfg, name, built)
    receipt = register_stage.run(lcfg, FP32, built)
    assert receipt.verdict == "pass" and receipt.new
    assert registry.Registry(lcfg, built).aliases(receipt.name) == {"candidate": receipt.version}
    with pytest.raises(GateFailed, match="its validation failed"):
        register_stage.run(lcfg, INT8, built)


def test_refusals_name_the_problem(tmp_path, built_program, monkeypatch):
    t = LiteRT()
    src = built_program / program.PROGRAM_FILE        # asked for: not left behind by whichever test ran before
    with pytest.raises(KilnError, match="not built by this target"):
        t.compile(src, CompileOptions("fp16", t.parse_options({})), tmp_path, tmp_path)
    with pytest.raises(KilnError, match="needs the calibration chips"):
        t.compile(src, CompileOptions("int8", t.parse_options({})), tmp_path, tmp_path)

    class Pool(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.max_pool2d(x, 2, 2, ceil_mode=True)

    dyn = torch.export.Dim.DYNAMIC
    ep = torch.export.export(Pool(), (torch.zeros(2, 3, 20, 20),), dynamic_shapes=({0: dyn, 2: dyn, 3: dyn},))
    torch.export.save(ep, str(tmp_path / "pool.pt2"))
    with pytest.raises(KilnError, match=r"dynamic non-batch dimensions \(2, 3\)"):
        t.compile(tmp_path / "pool.pt2", CompileOptions("fp32", t.parse_options({})), tmp_path, tmp_path)
    monkeypatch.setenv("KILN_LITERT_PYTHON", "/bin/false")
    with pytest.raises(KilnError, match=r"the converter \(/bin/false\) failed"):
        t.compile(src, CompileOptions("fp32", t.parse_options({})), tmp_path, tmp_path)
    assert not (tmp_path / TFLITE_FILE).exists()
    (tmp_path / TFLITE_FILE).write_bytes(b"PK\x03\x04 not a flatbuffer")
    with pytest.raises(KilnError, match="not a TFLite model"):
        t.check_package(tmp_path)
    with pytest.raises(KilnError, match="threads"):
        t.parse_options({"threads": -1})
