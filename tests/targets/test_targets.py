"""ort-cpu target, toolchain fingerprint, compile audit + fallback policy, and the validation gate."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import yaml

from pipeline import config, paths, targets
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.gates import evaluate, facemetrics
from pipeline.stages import toolchain as toolchain_stage, validate


@pytest.fixture(scope="module")
def fp32_engine(built, cfg):
    toolchain_stage.run(cfg, built)
    compile_stage.run(cfg, "embedder-ort-cpu-fp32", built)
    return paths.engine("embedder-ort-cpu-fp32", built)


def test_probe_and_fingerprint(built, cfg):
    out = toolchain_stage.run(cfg, built)
    tc, path, _ = out["ort-cpu"]
    doc = yaml.safe_load(path.read_text())
    assert tc.available and doc["available"] is True
    assert set(doc["rebuild_on"]) == {"onnxruntime", "isa", "machine"} and "cpu" in tc.info
    assert tc.line().startswith("ort-cpu: available (onnxruntime ")
    assert set(out) == set(cfg.targets)


def test_unknown_target_is_a_clear_error():
    with pytest.raises(KilnError, match="unknown target 'tensorrt-x'"):
        targets.get("tensorrt-x")


def test_fp32_engine_is_reproducible_native_and_verifies(fp32_engine, built, cfg):
    r = compile_stage.run(cfg, "embedder-ort-cpu-fp32", built)
    assert r.reproducibility["checked"].startswith("compile: second build in a fresh process")
    assert r.audit.ok and r.audit.summary()["native_nodes"] >= 30
    assert verify_manifest(fp32_engine / "embedder-ort-cpu-fp32.manifest.json", root=built) == []


def test_a_cold_start_imports_only_the_runtime(fp32_engine, tmp_path):
    """Process start → first embedding is what a serving host pays: loading an ort-cpu engine in a fresh process
    imports onnxruntime and numpy, not pydantic (≈ 100 ms: the params models are built only where params are
    read), onnx (the canonicalizer's) or the stage tools — and gives the same embedding as this process."""
    from conftest import load_in_fresh_process

    y, heavy = load_in_fresh_process("ort-cpu", fp32_engine, (2, 3, 150, 150),
                                     ("pydantic", "onnx", "pipeline.stage", "pipeline.config", "torch"),
                                     tmp_path / "probe.npy")
    assert heavy == [], heavy
    from pipeline import engines
    assert np.array_equal(y, engines.load("ort-cpu", fp32_engine).run(np.full((2, 3, 150, 150), 100, np.float32)))


def test_audit_catches_float_convs_in_an_int8_engine(fp32_engine):
    """An 'INT8' engine whose convolutions run in float is exactly the silent fallback the audit must report."""
    audit = targets.get("ort-cpu").audit(fp32_engine, "int8")
    ops = {f["op"].split(".")[-1] for f in audit.fallback}
    assert not audit.ok and "Conv" in ops and len(audit.fallback) >= 29


def test_fallback_policy_fail_builds_nothing(built, cfg):
    """Point an INT8 engine at an unquantized graph: with policy `fail` the compile stops and writes nothing."""
    fake = paths.quantized("embedder", "ort", built)
    if fake.exists():
        shutil.rmtree(fake)
    shutil.copytree(paths.export("embedder", built), fake)
    (fake / "embedder.manifest.json").rename(fake / "embedder-ort.manifest.json")
    strict = cfg.replace(targets={**cfg.targets, "ort-cpu": dataclasses.replace(cfg.targets["ort-cpu"],
                                                                                  fallback_policy="fail")})
    toolchain_stage.run(cfg, built)
    try:
        with pytest.raises(GateFailed, match="compute nodes fell back from int8"):
            compile_stage.run(strict, "embedder-ort-cpu-int8", built)
        assert not paths.engine("embedder-ort-cpu-int8", built).exists()
        warn = compile_stage.run(cfg, "embedder-ort-cpu-int8", built)  # policy warn: built, warning recorded
        assert len(warn.warnings) >= 29
    finally:
        shutil.rmtree(fake)
        shutil.rmtree(paths.engine("embedder-ort-cpu-int8", built), ignore_errors=True)


def test_unavailable_target_builds_nothing(built, cfg):
    path = paths.toolchain_file("ort-cpu", built)
    toolchain_stage.run(cfg, built)
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**doc, "available": False, "reason": "no CPU today"}))
    with pytest.raises(KilnError, match=r"ort-cpu: unavailable \(no CPU today\); not built"):
        compile_stage.run(cfg, "embedder-ort-cpu-fp32", built)
    toolchain_stage.run(cfg, built)


def test_face_metrics_known_answers(cfg):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 128)) * 0.1
    labels = np.repeat(np.arange(3), 4)
    ref = centers[labels] + rng.normal(size=(12, 128)) * 0.01
    gallery = np.array([0, 4, 8])
    same = facemetrics.face_metrics(ref.copy(), ref, labels, gallery, 0.6)
    assert same["cosine_min"] == pytest.approx(1.0) and same["l2_max"] == 0 and same["decision_agreement"] == 1
    swapped = ref.copy()
    swapped[1] = ref[5]  # one chip of identity 0 now looks like identity 1
    m = facemetrics.face_metrics(swapped, ref, labels, gallery, 0.6)
    assert m["top1_agreement"] == pytest.approx(11 / 12) and m["cosine_min"] < 0.9
    assert any(f.startswith("top1_agreement") for f in evaluate.gate(m, cfg.validate))
    assert evaluate.gate(same, cfg.validate) == []


def test_validate_passes_fp32_and_writes_verdict(fp32_engine, built, cfg):
    v = validate.run(cfg, "embedder-ort-cpu-fp32", built)
    assert v.passed and v.metrics["cosine_min"] > 0.9999
    report = (paths.validation("embedder-ort-cpu-fp32", built) / "validation.json").read_text()
    assert '"verdict": "pass"' in report


def test_validate_failure_is_recorded(fp32_engine, built, cfg):
    impossible = cfg.replace(validate=dataclasses.replace(cfg.validate, l2_max=0.0))
    v = validate.run(impossible, "embedder-ort-cpu-fp32", built)
    assert not v.passed and v.failures[0].startswith("l2_max")
    assert '"verdict": "fail"' in (paths.validation("embedder-ort-cpu-fp32", built) / "validation.json").read_text()


def test_canonicalize_gives_one_byte_order_for_any_node_order(fp32_engine):
    """ORT numbers the nodes it inserts from hash-map order: the same graph shuffled must serialize identically."""
    import random

    import onnx

    from pipeline.targets.canonical import canonicalize

    model = onnx.load(str(fp32_engine / "model.onnx"))
    reference = canonicalize(onnx.load(str(fp32_engine / "model.onnx"))).SerializeToString()
    for seed in range(3):
        shuffled = onnx.ModelProto()
        shuffled.CopyFrom(model)
        nodes = list(shuffled.graph.node)
        random.Random(seed).shuffle(nodes)
        for i, n in enumerate(nodes):
            n.name = f"renamed_{seed}_{i}"
        shuffled.graph.ClearField("node")
        shuffled.graph.node.extend(nodes)
        assert canonicalize(shuffled).SerializeToString() == reference


def test_ort_prelu_decomposition_is_the_same_values_and_compiles_without_prelu(tmp_path):
    """ort-cpu's `prelu: decompose` rewrites PRelu (slopes below 0, in [0, 1] and above 1; a shared and a per-channel
    slope) as Relu + slope·Min(x, 0): bit-identical outputs, the output names kept, no PRelu in the engine; `keep`
    compiles the graph as exported."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.targets.base import CompileOptions
    from pipeline.targets.ort_cpu import OrtCpu, decompose_prelu

    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    per_channel = numpy_helper.from_array(np.array([-0.8, 0.0, 0.25, 1.7], np.float32).reshape(4, 1, 1), "a")
    shared = numpy_helper.from_array(np.array([0.1], np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("PRelu", ["c", "a"], ["p"]),
         helper.make_node("PRelu", ["p", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w, per_channel, shared])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    source = tmp_path / "prelu.onnx"
    onnx.save(model, str(source))
    x = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32) * 4}

    def run(m) -> np.ndarray:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, x)[0]

    rewritten = onnx.load(str(source))
    assert decompose_prelu(rewritten) == 2
    onnx.checker.check_model(rewritten)
    assert [o.name for o in rewritten.graph.output] == ["y"]
    assert "PRelu" not in {n.op_type for n in rewritten.graph.node}
    assert np.array_equal(run(rewritten), run(model))

    target = OrtCpu()
    for mode, has_prelu in (("decompose", False), ("keep", True)):
        out, work = tmp_path / mode, tmp_path / f"{mode}-work"
        out.mkdir(), work.mkdir()
        target.compile(source, CompileOptions("fp32", target.parse_options({"prelu": mode, "threads": 1})), out, work)
        engine = onnx.load(str(out / "model.onnx"))
        assert ("PRelu" in {n.op_type for n in engine.graph.node}) is has_prelu
        np.testing.assert_allclose(target.load(out, 1).run(x["x"]), run(model), rtol=0, atol=1e-5)
    with pytest.raises(KilnError, match="prelu"):
        target.parse_options({"prelu": "fuse"})


def test_the_int8_bench_gate_on_injected_latencies(cfg):
    """The bench gate itself, on known latencies (the real bench only reports on a noisy machine)."""
    from pipeline.gates import timing

    engines = [cfg.engine("embedder-ort-cpu-fp32"), cfg.engine("embedder-ort-cpu-int8"),
               cfg.engine("embedder-aoti-cpu-fp32")]

    def report(int8_b1, int8_b8):
        return {"engines": {"embedder-ort-cpu-fp32": {"b1_p50_ms": 4.0, "b8_p50_ms": 20.0},
                            "embedder-ort-cpu-int8": {"b1_p50_ms": int8_b1, "b8_p50_ms": int8_b8},
                            "embedder-aoti-cpu-fp32": {"b1_p50_ms": 1.0, "b8_p50_ms": 1.0}}, "ratios": {}}

    fast = report(2.0, 8.0)
    assert timing.int8_gate(fast, engines, (1, 8), 1.0) == []
    assert fast["engines"]["embedder-ort-cpu-int8"]["b1_speedup_vs_fp32"] == 2.0
    assert fast["ratios"] == {"embedder-ort-cpu-int8/embedder-ort-cpu-fp32@b1": 2.0,
                              "embedder-ort-cpu-int8/embedder-ort-cpu-fp32@b8": 2.5}   # its own target's sibling
    slow = timing.int8_gate(report(5.0, 8.0), engines, (1, 8), 1.0)
    assert slow == ["embedder-ort-cpu-int8 is 0.80× its FP32 sibling embedder-ort-cpu-fp32 at batch 1 (needs ≥ 1×): "
                    "the INT8 recipe 'ort' does not pay"]
    assert len(timing.int8_gate(report(2.0, 8.0), engines, (1, 8), 3.0)) == 2        # a stricter goal fails both


# ---------------------------------------------------------------------------------------------- the contract
PROTOCOL = ("name", "reproducibility", "runtime", "parse_options", "probe", "compile", "audit", "load",
            "manifest_extras", "check_package", "runnable", "accept_rebuild")


def _runner_class(target):
    import importlib
    import inspect

    ret = inspect.signature(target.load).return_annotation      # a string under `from __future__ import annotations`
    if not isinstance(ret, str):
        return ret
    return getattr(importlib.import_module(type(target).__module__), ret.strip("'\""))


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_every_registered_target_meets_the_whole_contract(name, built, cfg, tmp_path):
    """Every target, whether or not its toolchain is on this host: the protocol's members, a typed determinism claim,
    its own params parsed, a probe with a one-line answer, a runner class with run and run_all. Where the toolchain
    is here and the build is cheap (ONNX targets that prove reproducibility at compile), the whole life cycle runs:
    compile → audit → manifest extras → package check → runnable → load → run and run_all agree."""
    from pipeline.targets.base import CLASSES, CompileOptions, OpSupport, Reproducibility, Toolchain

    entry, t = targets.entry(name), targets.get(name)
    missing = [m for m in (*PROTOCOL, *(("tune",) if entry.tunes else ())) if not hasattr(t, m)]
    assert not missing, f"{name} lacks {missing}"
    assert t.name == name and entry.source_kind in ("onnx", "program") and set(entry.precisions) <= set(
        config.PRECISIONS)
    assert isinstance(t.reproducibility, Reproducibility) and t.reproducibility.claim in CLASSES[:3]
    assert t.runtime and all(isinstance(m, str) and m.isidentifier() for m in t.runtime), t.runtime
    assert name in cfg.targets, f"params.yaml has no targets.{name} block"
    t.parse_options(cfg.targets[name].options)
    runner = _runner_class(t)
    assert callable(getattr(runner, "run", None)) and callable(getattr(runner, "run_all", None)), runner
    tc = t.probe()
    assert isinstance(tc, Toolchain) and tc.target == name and tc.line().startswith(f"{name}: ")
    if not tc.available:
        assert tc.reason and "unavailable" in tc.line()
        return
    ok, why = t.runnable(None)
    if not ok:      # build-only here (tensorrt-rtx without a GPU): says why; its own tests build and audit it
        assert why.startswith(f"no runtime for {name}")
        return
    if entry.source_kind != "onnx":
        return      # aoti-cpu: tens of seconds a build from the torch.export program; tests/targets/test_aoti.py has it
    out, work = tmp_path / "engine", tmp_path / "work"
    out.mkdir(), work.mkdir()
    files = t.compile(paths.export("embedder", built) / paths.ONNX_FILE,
                      CompileOptions("fp32", t.parse_options(cfg.targets[name].options)), out, work)
    assert files and all(f.is_file() and f.parent == out for f in files)
    audit = t.audit(out, "fp32")
    assert isinstance(audit, OpSupport) and audit.ok and sum(audit.native.values()) >= 30
    extras = t.manifest_extras(out)
    assert set(extras) <= {"build", "results"}
    t.check_package(out)
    assert t.runnable(out) == (True, "")
    assert t.accept_rebuild(out, out, [files[0].name]) is None      # a byte difference is never waved through
    r = t.load(out)
    x = np.random.default_rng(0).uniform(0, 255, (2, 3, 150, 150)).astype(np.float32)
    one, every = r.run(x), r.run_all({"input": x})
    assert one.shape == (2, 128) and len(every) == 1 and np.array_equal(one, every[0])
