"""GPU-free TensorRT audit (trt_rules) on the real `symmetric` recipe and on deliberately broken graphs, and the
cross-target fallback table."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline import paths
from pipeline.report import fallbacks
from pipeline.stages import compile as compile_stage
from pipeline.stages import fallback_table, toolchain as toolchain_stage, trt_audit
from pipeline.targets import trt_rules, trt_static
from pipeline.targets.trt_onnx import static_audit


@pytest.fixture(scope="module")
def symmetric(built, cfg):
    """The real pipeline output: calibrate the embedder, then quantize it with the `symmetric` recipe."""
    from pipeline.stages import calibrate, quantize

    if not (paths.calibration("embedder", built) / "ranges.json").is_file():
        calibrate.run(cfg, "embedder", built, progress=lambda _: None)
    return quantize.run(cfg, "embedder", "symmetric", built).onnx_path


def _rules(audit) -> set[str]:
    return {p.rule for p in audit.problems}


def test_real_symmetric_recipe_passes_and_runs_int8(symmetric):
    a = static_audit(symmetric, "int8")
    assert a.parses, a.summary()["problems"][:3]
    s = a.summary()["audit"]
    assert s["native"]["Conv"] == 29 and s["native"]["MatMul"] == 1 and s["fallback_nodes"] == 0


def test_real_fp32_export_passes(built):
    a = static_audit(paths.export("embedder", built) / "model.onnx", "fp32")
    assert a.parses and a.support.ok and a.support.native["Conv"] == 29


def _mutated(model: onnx.ModelProto, how: str) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g, inits = m.graph, {i.name: i for i in m.graph.initializer}
    q = next(n for n in g.node if n.op_type == "QuantizeLinear")
    if how == "nonzero-zero-point":             # an asymmetric activation: TensorRT needs zp == 0
        zp = inits[q.input[2]]
        zp.CopyFrom(numpy_helper.from_array(np.array(3, np.int8), zp.name))
    elif how == "u8-activations":               # the `ort` recipe's uint8 activations
        zp = inits[q.input[2]]
        zp.CopyFrom(numpy_helper.from_array(np.array(128, np.uint8), zp.name))
        for d in g.node:
            if d.op_type == "DequantizeLinear" and d.input[0] == q.output[0] and len(d.input) > 2:
                dzp = inits[d.input[2]]
                dzp.CopyFrom(numpy_helper.from_array(np.array(128, np.uint8), dzp.name))
    elif how == "unsupported-op":               # an op the TensorRT ONNX parser lists as unsupported
        relu = next(n for n in g.node if n.op_type == "Relu")
        relu.op_type = "Unique"
    elif how == "custom-domain":                # an ORT contrib op left in the graph
        relu = next(n for n in g.node if n.op_type == "Relu")
        relu.op_type, relu.domain = "Gelu", "com.microsoft"
    elif how == "per-channel-axis":             # Conv weights quantized along the input-channel axis
        dq = next(n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
                  and numpy_helper.to_array(inits[n.input[1]]).size > 1)
        w = numpy_helper.to_array(inits[dq.input[0]])
        for a in dq.attribute:
            if a.name == "axis":
                a.i = 1
        inits[dq.input[1]].CopyFrom(numpy_helper.from_array(np.ones(w.shape[1], np.float32), dq.input[1]))
        inits[dq.input[2]].CopyFrom(numpy_helper.from_array(np.zeros(w.shape[1], np.int8), dq.input[2]))
    return m


@pytest.mark.parametrize("how, rule", [("nonzero-zero-point", "q-zero-point"),
                                       ("u8-activations", "q-output-type"),
                                       ("unsupported-op", "op-unsupported"),
                                       ("custom-domain", "custom-domain"),
                                       ("per-channel-axis", "per-channel-axis")])
def test_broken_graphs_are_flagged(symmetric, how, rule):
    a = trt_rules.audit_model(_mutated(onnx.load(str(symmetric)), how), "int8")
    assert not a.parses and rule in _rules(a), a.summary()["problem_rules"]
    if how == "u8-activations":
        assert "dq-input-type" in _rules(a)      # DequantizeLinear accepts INT8/FP8/FP4/INT4 only
    if how in ("unsupported-op", "custom-domain"):
        assert any(f["runs_as"] == "unsupported (parse fails)" for f in a.support.fallback)


def test_int32_bias_and_bad_opset_are_flagged():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])
    inits = [numpy_helper.from_array(np.ones((2, 4), np.int8), "w"),
             numpy_helper.from_array(np.array([0.1, 0.1], np.float32), "ws"),
             numpy_helper.from_array(np.zeros(2, np.int8), "wz"),
             numpy_helper.from_array(np.ones(2, np.int32), "b"),
             numpy_helper.from_array(np.array(0.01, np.float32), "bs")]
    nodes = [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], name="dq_w", axis=0),
             helper.make_node("DequantizeLinear", ["b", "bs"], ["bf"], name="dq_b"),
             helper.make_node("Gemm", ["x", "wf", "bf"], ["y"], name="gemm", transB=1)]
    for opset, expect in ((17, {"dq-input-type"}), (25, {"dq-input-type", "opset"})):
        m = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", opset)])
        assert _rules(trt_rules.audit_model(m, "int8")) == expect


def test_ort_recipe_would_not_parse(built, cfg, symmetric):
    """The `ort` recipe (u8 activations, int32 biases) is exactly what TensorRT rejects: the audit says so."""
    from pipeline.stages import quantize

    path = quantize.run(cfg, "embedder", "ort", built).onnx_path
    rules = _rules(static_audit(path, "int8"))
    assert {"q-output-type", "dq-input-type"} <= rules


def test_trt_audit_stage_and_fallback_table(built, cfg, symmetric):
    toolchain_stage.run(cfg, built)
    compile_stage.run(cfg, "embedder-ort-cpu-fp32", built)
    r = trt_audit.run(cfg, "embedder", built)
    assert r.report["parses"] and not r.failures and r.path.is_file()
    assert [e["precision"] for e in r.report["audits"]] == ["fp32", "fp16", "int8"]

    res = fallback_table.run(cfg, built)
    rows = {(x["model"], x["target"], x["precision"]): x for x in json.loads(res.json_path.read_text())}
    eng = rows[("embedder", "ort-cpu", "fp32")]
    assert eng["source"] == "engine" and eng["native_nodes"] >= 30 and eng["fallback_nodes"] == 0
    for p in ("fp32", "fp16", "int8"):
        s = rows[("embedder", "tensorrt", p)]
        assert s["source"] == "static" and s["parses"] is True and s["fallback_nodes"] == 0 and s["native_nodes"] > 0
    if ("embedder", "ort-cpu", "int8") in rows:          # in params.yaml but not compiled in this root
        assert rows[("embedder", "ort-cpu", "int8")]["source"] == "missing"
    md = [[c.strip() for c in line.strip("|").split("|")] for line in res.md_path.read_text().splitlines()
          if line.startswith("| ")]
    assert ["embedder", "tensorrt", "int8", "static"] in [r[:4] for r in md]
    assert ["embedder", "ort-cpu", "fp32", "engine"] in [r[:4] for r in md]


def test_fallback_table_labels_a_graph_tensorrt_would_reject(built, cfg, symmetric):
    """Point the static audit at the `ort` recipe: the row says it would not parse and what falls back."""
    from pipeline.stages import quantize

    quantize.run(cfg, "embedder", "ort", built)
    t = cfg.targets["tensorrt"]
    options = {**t.options, "static_audit": {"precisions": ["int8"], "int8_recipe": "ort"}}
    cfg2 = cfg.replace(targets={**cfg.targets, "tensorrt": dataclasses.replace(t, options=options)})
    trt_static.report_path("embedder", built).unlink(missing_ok=True)
    row = next(x for x in fallbacks.rows(cfg2, built) if x["target"] == "tensorrt" and x["model"] == "embedder")
    assert row["parses"] is False and "parser would reject" in row["note"] and row["fallback_nodes"] > 0
