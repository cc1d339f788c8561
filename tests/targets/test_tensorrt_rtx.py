"""tensorrt-rtx: the build-only target, with the real TensorRT-RTX wheels (lockfiles/rtx.txt; `setup.sh --test`).

Pure logic (options → profiles, the builder's layer lines → audit, disagreements with the static rules, batch
buckets, profiles merged into params) and real CPU builds of the embedder (FP32 / FP16 / INT8 from the symmetric
recipe) through the stages: bit-identical in a fresh process, audited from the builder's own layer list,
validate@ → not-run, registered as `built`, promotion refused; and the attach path (`kiln validate-release`) end to
end with an engine this host can run. Running a TensorRT-RTX plan needs an RTX GPU: nothing here does.
"""

from __future__ import annotations

import ctypes.util
import json
import shutil
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO
from pipeline import cli, config, paths, registry, targets
from pipeline.dagtools import profiles
from pipeline.release import revalidate
from pipeline.errors import GateFailed, KilnError
from pipeline.targets.base import CompileOptions, OpSupport
from pipeline.targets.ort_cpu import OrtCpu
from pipeline.targets.tensorrt import pick_profile
from pipeline.targets.tensorrt_rtx import TensorRTRTX, disagreements, parse_layer_lines, plan_for
from pipeline.targets.trt_inspector import inspector_audit

RTX_ENGINES = ("embedder-tensorrt-rtx-fp32", "embedder-tensorrt-rtx-fp16", "embedder-tensorrt-rtx-int8")


def test_the_toolchain_is_installed_by_test_setup():
    tc = TensorRTRTX().probe()
    assert tc.available, tc.reason          # a required package: missing fails, never skips
    assert tc.rebuild_on["tensorrt_rtx"] == "1.7.1.116" and tc.rebuild_on["onnxruntime"] != "absent"


# ----------------------------------------------------------------------------------------------- options → plan
def test_buckets_become_static_profiles():
    t = TensorRTRTX()
    opts = t.parse_options({"batch_buckets": [8, 1, 32], "compute_capabilities": ["SM86", "SM120"]})
    plan = plan_for(opts, "input", (3, 150, 150))
    assert [p["input"]["min"][0] for p in plan.profiles] == [1, 8, 32]
    assert all(p["input"]["min"] == p["input"]["opt"] == p["input"]["max"] for p in plan.profiles)
    assert plan.network_flags == ("STRONGLY_TYPED",) and plan.timing_cache_mode == "off"


@pytest.mark.parametrize("raw, key", [
    ({"compute_capabilities": ["SM90"]}, "targets.tensorrt-rtx.compute_capabilities"),   # Hopper: not a target
    ({"batch_buckets": [8, 8]}, "targets.tensorrt-rtx.batch_buckets"),
    ({"batch_buckets": []}, "targets.tensorrt-rtx.batch_buckets"),
    ({"batch_buckets": [0]}, "targets.tensorrt-rtx.batch_buckets"),
    ({"builder_optimization_level": 6}, "targets.tensorrt-rtx.builder_optimization_level"),
    ({"profile": {"min_batch": 1}}, "targets.tensorrt-rtx.profile"),
])
def test_bad_options_name_the_key(raw, key):
    with pytest.raises(KilnError, match=key.replace(".", r"\.")):
        TensorRTRTX().parse_options(raw)


@pytest.mark.parametrize("batch, want", [(1, (0, 1)), (8, (1, 8)), (5, (1, 8)), (2, (1, 8)), (32, (2, 32)),
                                         (20, (2, 32))])
def test_a_batch_runs_in_its_bucket_or_the_next_one_up(batch, want):
    assert pick_profile([(1, 1), (8, 8), (32, 32)], batch) == want


def test_a_batch_above_every_bucket_is_refused():
    with pytest.raises(KilnError, match="above every optimization profile"):
        pick_profile([(1, 1), (8, 8)], 9)


# ----------------------------------------------------------------------------------------------- builder audit
# One layer line as TensorRT-RTX 1.7.1.116 logs it at VERBOSE after `Layers:` (captured from an INT8 embedder build
# on this machine, 2026-11-30; constants and strides shortened).
REAL_LINE = (
    "Name: /fc/MatMul_myl0_65, LayerType: gemm, Inputs: [ { Name: __mye7991_q8_myl0, Dimensions: [-1,256], Strides: "
    "[256,1], StrideOrder: [1,0], Datatype: Int8, Format: (Linear) Row major linear format }], Constants: [ { Name: "
    "onnx::MatMul_574_quantized_constantInt8_myl0, Dimensions: [256,128], Strides: [128,1], StrideOrder: [1,0], "
    "Datatype: Int8, Format: (Linear) Row major linear format }], Outputs: [ { Name: __myln_k_arg__bb1_90_myl0, "
    "Dimensions: [-1,128], Strides: [128,1], StrideOrder: [1,0], Datatype: Float, Format: (Linear) Row major linear "
    "format }], TacticName: __myelin_CASK_STUB, StreamId: 0, Metadata: [ONNX Layer: /fc/MatMul][ONNX Layer: "
    "/ReduceMean_output_0_DequantizeLinear][ONNX Layer: onnx::MatMul_574_DequantizeLinear]")


def _line(name: str, kind: str, inputs: list[str], outputs: list[str], onnx: list[str]) -> str:
    def t(ds: list[str]) -> str:
        return ", ".join(f"{{ Name: t{i}, Dimensions: [-1,4], Datatype: {d}, Format: x }}" for i, d in enumerate(ds))

    return (f"Name: {name}, LayerType: {kind}, Inputs: [{t(inputs)}], Constants: [], Outputs: [{t(outputs)}], "
            f"TacticName: k, StreamId: 0, Metadata: " + "".join(f"[ONNX Layer: {o}]" for o in onnx))


def _log(*lines: str) -> str:
    return "\n".join(["[builder] other messages", "Layers:", *lines, "[builder] done"])


def test_the_real_layer_line_parses():
    s = parse_layer_lines(_log(REAL_LINE))
    assert s["num_layers"] == 1
    layer = s["layers"][0]
    assert (layer["name"], layer["type"], layer["inputs"], layer["outputs"]) == \
        ("/fc/MatMul_myl0_65", "gemm", ["int8"], ["float32"])
    assert layer["onnx"][0] == "/fc/MatMul"


def test_audit_judges_each_onnx_compute_node_by_the_compute_layer_covering_it():
    log = _log(_line("quant", "kgen", ["Float"], ["Int8"], ["/Sub", "/conv1/Conv"]),   # a prologue: not compute
               _line("c1", "correlation", ["Int8"], ["Float"], ["/conv1/Conv"]),
               _line("c2", "runtime_fusion", ["Half"], ["Half"], ["/conv2/Conv", "/Relu"]),
               _line("fc", "gemm", ["Int8"], ["Float"], ["/fc/MatMul"]))
    s = {**parse_layer_lines(log), "onnx_compute_nodes": {"/conv1/Conv": "Conv", "/conv2/Conv": "Conv",
                                                         "/fc/MatMul": "MatMul", "/conv3/Conv": "Conv"}}
    a = inspector_audit(s, "int8")
    assert a.native == {"Conv": 1, "MatMul": 1}
    assert {f["node"]: f["runs_as"] for f in a.fallback} == {"/conv2/Conv": "float16",
                                                             "/conv3/Conv": "no compute layer names it"}
    assert a.other == {"kgen": 1}


def test_every_disagreement_with_the_static_rules_is_reported():
    static = {"parses": True, "problem_rules": {}, "audit": {"fallback": [{"node": "/a/Conv", "runs_as": "float32"}]}}
    builder = OpSupport("int8", {"Conv": 1}, [{"node": "/b/Conv", "op": "Conv", "runs_as": "float16"}], {})
    found = disagreements(static, True, builder)
    assert found == ["/a/Conv: static audit expects it in float32; the builder runs it in int8",
                     "/b/Conv: static audit expects int8; the builder runs it as float16"]
    assert disagreements(static, False, None) == ["static rules say it parses; the real ONNX parser rejected it"]
    rejected = {"parses": False, "problem_rules": {"q-zero-point": 2}, "audit": {"fallback": []}}
    assert disagreements(rejected, True, OpSupport("int8", {}, [], {})) == [
        "static rules would reject it (q-zero-point ×2); the real parser took it"]
    agreed = {"parses": True, "problem_rules": {}, "audit": {"fallback": []}}
    assert disagreements(agreed, True, OpSupport("int8", {"Conv": 1}, [], {})) == []


def test_a_rebuild_passes_as_a_rearrangement_of_the_plan_only(tmp_path):
    """Multi-output plans come back with their bindings reordered: accepted only when the plan holds the same bytes
    in another order and nothing else differs; a changed byte or another layer list fails the gate."""
    rng = np.random.default_rng(0)
    plan = rng.integers(0, 256, 4096, dtype=np.uint8)
    mine, other = tmp_path / "a", tmp_path / "b"
    for d, data in ((mine, plan), (other, np.roll(plan, 17))):
        d.mkdir()
        (d / "engine.plan").write_bytes(data.tobytes())
    t = TensorRTRTX()
    assert "same bytes in another order" in t.accept_rebuild(mine, other, ["engine.plan"])
    assert t.accept_rebuild(mine, other, ["engine.plan", "layers.json"]) is None
    changed = np.roll(plan, 17)
    changed[5] ^= 1
    (other / "engine.plan").write_bytes(changed.tobytes())
    assert t.accept_rebuild(mine, other, ["engine.plan"]) is None
    (other / "engine.plan").write_bytes(plan.tobytes()[:-1])
    assert t.accept_rebuild(mine, other, ["engine.plan"]) is None


def test_runnable_here_says_why_not():
    ok, why = TensorRTRTX().runnable(None)
    if ctypes.util.find_library("cuda") is None:
        assert not ok
        assert why == "no runtime for tensorrt-rtx on this host (no CUDA driver: RTX engines run on RTX GPUs)"


# ----------------------------------------------------------------------------------------------- profiles
def test_the_rtx_profile_merges_keeping_comments_and_twice_changes_nothing(tmp_path):
    p = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", p)
    before = p.read_text()
    changed = profiles.apply("rtx", p, REPO)
    assert "targets.tensorrt-rtx.enabled" in changed and "engines.embedder-tensorrt-rtx-int8" in changed
    text = p.read_text()
    assert "# The engines the DAG builds" in text and text.count("\n#") == before.count("\n#")   # comments kept
    cfg = config.load(p)
    assert cfg.targets["tensorrt-rtx"].enabled
    assert {n for n, e in cfg.engines.items() if e.target == "tensorrt-rtx"} >= set(RTX_ENGINES)
    assert cfg.engine("embedder-tensorrt-rtx-int8").recipe == "symmetric"
    base = yaml.safe_load(before)
    assert {k: v for k, v in yaml.safe_load(text).items() if k not in ("targets", "engines")} == \
        {k: v for k, v in base.items() if k not in ("targets", "engines")}
    assert profiles.apply("rtx", p, REPO) == [] and p.read_text() == text


def test_a_profile_that_breaks_params_changes_nothing(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles/bad.yaml").write_text("engines:\n  x-rtx: {model: embedder, target: tensorrt-rtx, "
                                                "precision: int8, source: artifacts/export/embedder}\n")
    p = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", p)
    before = p.read_text()
    with pytest.raises(KilnError, match=r"profiles/bad\.yaml: applied to .*params\.yaml, it gives an invalid"):
        profiles.apply("bad", p, tmp_path)
    assert p.read_text() == before and sorted(x.name for x in tmp_path.iterdir()) == ["params.yaml", "profiles"]
    with pytest.raises(KilnError, match="no such profile"):
        profiles.apply("nope", p, tmp_path)
    with pytest.raises(KilnError, match="not a valid name"):
        profiles.apply("../profiles/bad", p, tmp_path)


# ----------------------------------------------------------------------------------------------- real builds
@pytest.fixture(scope="module")
def rtx(built, cfg, tmp_path_factory):
    """`built` with the rtx profile's params, the symmetric INT8 embedder and fresh toolchain fingerprints."""
    from pipeline.stages import calibrate, toolchain as toolchain_stage, quantize

    p = tmp_path_factory.mktemp("rtx-params") / "params.yaml"
    p.write_text(yaml.safe_dump(profiles.merged(cfg.raw, profiles.load("rtx", REPO))))
    rcfg = config.load(p)
    targets.check(rcfg)
    calibrate.run(rcfg, "embedder", built, progress=lambda _: None)
    quantize.run(rcfg, "embedder", "symmetric", built)
    toolchain_stage.run(rcfg, built)
    return rcfg, built


@pytest.mark.slow
@pytest.mark.parametrize("name", RTX_ENGINES)
def test_embedder_engines_rebuild_bit_identically_and_audit_from_the_builder(rtx, name):
    from pipeline.stages import compile as compile_stage

    rcfg, root = rtx
    r = compile_stage.run(rcfg, name, root)         # builds twice: the second in a fresh process, bytes compared
    m = json.loads((paths.engine(name, root) / f"{name}.manifest.json").read_text())
    assert m["build"]["reproducibility"]["claim"] == "numerically-equivalent"
    assert m["build"]["reproducibility"]["checked"].endswith("bit-identical")   # one output: the same bytes
    assert m["build"]["build_only"] and m["build"]["compute_capabilities"] == ["SM80", "SM86", "SM89", "SM120"]
    assert len(m["build"]["plan"]["profiles"]) == 3
    assert m["toolchain"]["target.tensorrt-rtx"]["tensorrt_rtx"] == "1.7.1.116"
    audit = m["results"]["audit"]
    assert audit["native"] == {"Conv": 29, "MatMul": 1} and audit["fallback_nodes"] == 0, audit   # builder's list
    assert m["results"]["builder_layers"]["num_layers"] > 30
    assert m["results"]["disagreements_with_static_rules"] == []
    assert r.audit.ok


def _graph(dims: list, two_inputs: bool) -> onnx.ModelProto:
    """A real Conv graph shaped like P-Net (dynamic H×W) or with a second input like the aligner."""
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *dims])]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    if two_inputs:
        ins.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4, 6, 6]))
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Add", ["c", "z"], ["y"])]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "g", ins, [out], [w]),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dims, two, why", [([3, "h", "w"], False, r"dynamic non-batch dimensions \(3, -1, -1\)"),
                                            ([3, 8, 8], True, "has 2 inputs")])
def test_graphs_the_target_cannot_profile_are_refused_clearly(dims, two, why, tmp_path):

    src = tmp_path / "model.onnx"
    onnx.save(_graph(dims, two), src)
    t = TensorRTRTX()
    with pytest.raises(KilnError, match=why):
        t.compile(src, CompileOptions("fp32", t.parse_options({})), tmp_path, tmp_path)
    assert not (tmp_path / "engine.plan").exists()


@pytest.mark.slow
def test_built_only_registers_as_built_and_promotion_waits_for_a_runtime(rtx, registry_env, capsys):
    from pipeline.stages import compile as compile_stage
    from pipeline.stages import register as register_stage
    from pipeline.stages import validate

    rcfg, root = rtx
    name = "embedder-tensorrt-rtx-int8"
    if not paths.engine(name, root).is_dir():
        compile_stage.run(rcfg, name, root)
    v = validate.run(rcfg, name, root)
    assert v.verdict == "not-run" and not v.passed and "no runtime for tensorrt-rtx on this host" in v.reason
    receipt = register_stage.run(rcfg, name, root)
    assert receipt.verdict == "not-run" and receipt.new
    reg = registry.Registry(rcfg, root)
    assert reg.aliases(receipt.name) == {"built": receipt.version}          # never `candidate`
    with pytest.raises(GateFailed, match="built only .* no host with the runtime has validated it"):
        registry.promote(rcfg, name, receipt.version, root)
    assert "production" not in reg.aliases(receipt.name)
    with pytest.raises(KilnError, match="cannot validate it on this host"):
        revalidate.run(rcfg, name, receipt.version, root)
    assert cli.main(["--params", str(rcfg.source), "promote", name, str(receipt.version)]) == 1
    assert "on a host with the runtime: kiln validate-release" in capsys.readouterr().err


@pytest.mark.slow
def test_validate_release_attaches_a_pass_that_promotion_verifies(rtx, registry_env, monkeypatch):
    """The attach path end to end with an engine this host can run: its build host is simulated as lacking the
    runtime (validate@ → not-run → `built`), then `kiln validate-release` runs the real gate here."""
    from pipeline.stages import compile as compile_stage
    from pipeline.stages import register as register_stage
    from pipeline.stages import validate

    rcfg, root = rtx
    name = "embedder-ort-cpu-fp32"
    compile_stage.run(rcfg, name, root, check=False)
    with monkeypatch.context() as m:
        m.setattr(OrtCpu, "runnable", lambda self, d: (False, "simulated build host without the runtime"))
        assert validate.run(rcfg, name, root).verdict == "not-run"
    receipt = register_stage.run(rcfg, name, root)
    version = receipt.version
    with pytest.raises(GateFailed, match="built only"):
        registry.promote(rcfg, name, version, root)

    result = revalidate.run(rcfg, name, version, root)
    assert result.passed and result.moved, result.line()
    reg = registry.Registry(rcfg, root)
    assert reg.aliases(receipt.name) == {"built": version, "candidate": version}
    move = registry.promote(rcfg, name, version, root)
    assert move.to_version == version and f"attached by run {result.run_id}" in move.reason
    assert [(m.action, m.alias) for m in registry.history(rcfg, name, root)] == \
        [("register", "built"), ("validate-release", "candidate"), ("promote", "production")]

    # the attached verdict is checked like a stored one: alter it and promotion (and rollback to it) refuses
    from mlflow.artifacts import download_artifacts

    art = Path(download_artifacts(run_id=result.run_id, artifact_path="kiln", tracking_uri=reg.engine_uri))
    assert json.loads((art / "validation.json").read_text())["verdict"] == "pass"
    stored = Path(urlparse(reg.client.get_run(result.run_id).info.artifact_uri).path) / "kiln"
    doc = json.loads((stored / "validation.json").read_text())
    (stored / "validation.json").write_text(json.dumps({**doc, "metrics": {**doc["metrics"], "cosine_min": 1.0}}))
    with pytest.raises(GateFailed, match="built only"):
        registry.check_version(reg, receipt.name, version)
