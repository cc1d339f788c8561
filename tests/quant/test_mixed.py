"""Mixed precision under the real gate: the greedy search stops exactly when the budget is met; on O-Net it finds the
node whose quantization moves boxes; recipes with float nodes and a model scope are checked."""

from __future__ import annotations

import pytest

from pipeline import config, paths
from pipeline.errors import KilnError
from pipeline.quant.mixed import Trial, greedy, search
from pipeline.quant.qdq import pairs
from pipeline.stages import quantize
from conftest import write_params as _write


def test_greedy_stops_exactly_when_the_budget_is_met():
    seen = []

    def evaluate(nodes):                 # a toy model: the budget holds once b and d are both in float
        seen.append(nodes)
        return Trial(nodes, {}, [] if {"b", "d"} <= set(nodes) else ["over budget"])

    trials, chosen = greedy(["a", "b", "c", "d", "e", "f"], evaluate, max_float=6)
    assert chosen == ("a", "b", "c", "d") and len(trials) == 4 and seen[-1] == chosen   # nothing tried after
    trials, chosen = greedy(["a", "b", "c", "d"], evaluate, max_float=3)
    assert chosen is None and len(trials) == 3 and not any(t.passed for t in trials)


@pytest.fixture(scope="module")
def onet(built, cfg):
    from pipeline.stages import calibrate, export, golden

    golden.run(cfg, "onet", built)
    export.run(cfg, "onet", built)
    calibrate.run(cfg, "onet", built, progress=lambda _: None)
    return built


def test_onet_passes_its_detector_gate_with_the_softmax_in_float(onet, cfg):
    r = search(cfg, "onet", "ort", onet, ranking=["/dense5/Gemm", "/Softmax", "/conv1/Conv"], progress=lambda _: None)
    assert not r.full_int8.passed and r.full_int8.metrics["box_iou_min"] < 0.9          # full INT8 moves a box
    assert r.chosen == ("/dense5/Gemm", "/Softmax") and len(r.trials) == 2             # stops when it passes
    assert r.trials[-1].metrics["box_iou_min"] >= 0.9


def test_the_float_softmax_recipe_is_built_by_quantize_and_keeps_that_node_float(onet, cfg):
    q = quantize.run(cfg, "onet", "ort-float-softmax", onet)
    import onnx

    m = onnx.load(str(q.onnx_path))
    softmax = next(n for n in m.graph.node if n.op_type == "Softmax")
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == softmax.output[0] for n in m.graph.node)
    assert sum(n.op_type == "QuantizeLinear" for n in m.graph.node) >= 9


def test_recipes_scope_and_float_nodes_are_checked(onet, cfg, tmp_path):
    assert "onet-ort-float-softmax" in pairs(cfg) and "embedder-ort-float-softmax" not in pairs(cfg)

    def wrong_model(p):
        p["engines"]["embedder-ort-cpu-int8"]["recipe"] = "ort-float-softmax"
        p["engines"]["embedder-ort-cpu-int8"]["source"] = "artifacts/quantized/embedder-ort-float-softmax"

    with pytest.raises(KilnError, match="does not quantize 'embedder'"):
        config.load(_write(tmp_path, wrong_model))

    def bad_node(p):
        p["quantize"]["recipes"]["ort-float-softmax"]["float_nodes"] = ["/NoSuchNode"]

    built = quantize.run(cfg, "onet", "ort-float-softmax", onet).onnx_path.read_bytes()
    bad = config.load(_write(tmp_path, bad_node))
    with pytest.raises(KilnError, match=r"float_nodes \['/NoSuchNode'\] are not nodes of this graph"):
        quantize.run(bad, "onet", "ort-float-softmax", onet)
    assert (paths.quantized("onet", "ort-float-softmax", onet) / "model.onnx").read_bytes() == built   # untouched
