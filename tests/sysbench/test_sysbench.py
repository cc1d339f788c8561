"""sysbench@'s parts that need no built system: the frame source, counting a graph's FLOPs, the roofline
classification, the stage shares and Amdahl headroom, the sweep's plan and params, and that its timings are
declared uncached. (The load test itself runs on built engines in tests/test_system.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from conftest import make_root, write_params
from pipeline import config
from pipeline.dagtools import dag
from pipeline.dvcfiles import dvcfile
from pipeline.errors import KilnError
from pipeline.sysbench import frames, load, roofline


@pytest.fixture(scope="module")
def photos():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((240, 200), (900, 700), (500, 800))]


def test_the_frame_source_is_deterministic_and_made_of_the_photos(photos):
    a, b = frames.frames(photos, (640, 480)), frames.frames([p.copy() for p in photos], (640, 480))
    assert len(a) == len(photos) + len(photos) - 1            # each photo, then each consecutive pair
    assert all(f.shape == (480, 640, 3) and f.dtype == np.uint8 for f in a)
    assert frames.digest(a) == frames.digest(b)
    assert frames.digest(frames.frames(photos, (320, 240))) != frames.digest(a)
    changed = [p.copy() for p in photos]
    changed[1][0, 0, 0] ^= 0xFF
    assert frames.digest(frames.frames(changed, (640, 480))) != frames.digest(a)   # the photos are what it shows
    # a letterboxed photo keeps its aspect: grey bars on the sides of a portrait, none inside the picture
    assert (a[1][:, :5] == frames.GREY).all() and not (a[1][:, 320] == frames.GREY).all()


def test_streams_are_not_in_lock_step():
    n = 11
    assert [frames.pick(n, 0, k) for k in range(n)] == list(range(n))
    assert frames.pick(n, 1, 0) != frames.pick(n, 0, 0) and frames.pick(n, 2, 0) != frames.pick(n, 1, 0)
    assert sorted(frames.pick(n, 3, k) for k in range(n)) == list(range(n))        # every frame, every stream


def test_the_pinned_photos_make_the_same_frames_twice(cfg, assets_dir, tmp_path):
    root = make_root(tmp_path, assets_dir)
    a, b = frames.load(cfg, root), frames.load(cfg, root)
    assert len(a) >= 2 and frames.digest(a) == frames.digest(b)


def _tiny_graph(path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((8, 3, 3, 3), np.float32), "w")
    fc = numpy_helper.from_array(np.ones((8 * 6 * 6, 4), np.float32), "fc")
    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]), helper.make_node("MatMul", ["f", "fc"], ["y"])]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, fc, shape])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_graph_cost_counts_conv_and_matmul_flops_at_the_shapes_fed(tmp_path):
    _tiny_graph(tmp_path / "m.onnx")
    one = roofline.graph_cost(tmp_path / "m.onnx", [(1, 3, 8, 8)])
    conv, relu, reshape, matmul = 2 * (8 * 6 * 6) * 27, 8 * 6 * 6, 288, 2 * 4 * 288   # others: 1 per element
    assert one["flops"] == conv + relu + reshape + matmul
    four = roofline.graph_cost(tmp_path / "m.onnx", [(4, 3, 8, 8)])
    assert four["flops"] == 4 * one["flops"] and four["nodes_without_shapes"] == 0
    weights = 8 * 27 + 288 * 4 + 2
    assert one["weights"] == weights
    int8 = roofline.graph_cost(tmp_path / "m.onnx", [(1, 3, 8, 8)], weight_bytes=1)
    assert int8["bytes"] == one["bytes"] - 3 * weights


def test_roofline_points_are_classified_against_the_roof():
    roof = {"peak_flops": 100e9, "bandwidth_bytes_s": 10e9, "ridge_flops_per_byte": 10.0}
    compute = roofline.point(1e9, 1e7, 20.0, roof)          # intensity 100, 50 GFLOP/s of 100
    memory = roofline.point(1e8, 1e8, 20.0, roof)           # intensity 1: roof 10 GFLOP/s, achieves 5
    overhead = roofline.point(1e8, 1e8, 2000.0, roof)       # 0.05 GFLOP/s of 10: per-call costs dominate
    assert (compute["bound"], memory["bound"], overhead["bound"]) == ("compute", "memory", "overhead")
    assert compute["attainable_gflops"] == 100.0 and memory["attainable_gflops"] == 10.0
    assert compute["of_attainable"] == 0.5 and memory["of_attainable"] == 0.5


def test_shares_and_amdahl_headroom_add_up():
    pt = {"stage_ms_per_frame": {"pnet": 10.0, "embed": 20.0, "match": 10.0}, "queue_wait_ms": {"mean": 10.0}}
    s = roofline.shares(pt)
    assert s["frame_ms"] == 50.0 and s["service_ms"] == 40.0 and s["bottleneck"] == "embed"
    assert s["stages"] == {"pnet": 0.2, "embed": 0.4, "match": 0.2, "queue_wait": 0.2}
    assert s["amdahl_2x"]["embed"] == 0.2                   # half of its 40 % of the frame


def test_the_plan_fits_the_machine_and_bounds_the_sweep(tmp_path, monkeypatch):
    """On an 8-core machine: a worker per core with one thread each, or the cores shared among the workers params
    ask for; the sweep's time bound by hand for params.yaml's sweep (7 points × (1 s warm-up + 5 s + 2 s drain))."""
    monkeypatch.setattr(load, "cores", lambda: 8)
    plans = {}
    for w in (0, 2, 3, 16):
        (tmp_path / str(w)).mkdir()
        params = write_params(tmp_path / str(w), lambda raw: raw["sysbench"].update(workers=w))
        plans[w] = load.plan(config.load(params))
    assert {w: (p.workers, p.threads) for w, p in plans.items()} == {0: (8, 1), 2: (2, 4), 3: (3, 2), 16: (16, 1)}
    assert plans[0].streams == (1, 2, 4, 6, 8, 12, 16) and plans[0].bound_s == 56.0


def test_stream_counts_must_ascend(tmp_path):
    path = write_params(tmp_path, lambda raw: raw["sysbench"].update(streams=[4, 2]))
    with pytest.raises(KilnError, match=r"sysbench\.streams"):
        config.load(path)


def test_an_empty_sweep_is_refused(tmp_path):
    path = write_params(tmp_path, lambda raw: raw["sysbench"].update(streams=[]))
    with pytest.raises(KilnError, match=r"sysbench\.streams is empty"):
        load.plan(config.load(path))


def test_sysbench_timings_are_never_cached_outputs(cfg):
    rendered = yaml.safe_load(dag.render(cfg)[dvcfile("sysbench")])
    outs = rendered["stages"]["sysbench"]["do"]
    declared = [o for group in ("outs", "metrics") for o in outs.get(group, [])]
    assert len(declared) == 2
    assert all(isinstance(o, dict) and list(o.values())[0]["cache"] is False for o in declared), declared


def test_the_report_compares_the_cost_per_stream_of_systems():
    """The systems section's first table: per system its targets, the streams held, the machine's cores over them and
    the CPU a stream used at the largest count held (CPU-s a frame × fps) — from the sysbench documents, so a system
    that held nothing shows no cost rather than a division by zero."""
    from pipeline.report import systems as report_systems

    def doc(held: list[int], missed: int, cpu: float) -> dict:
        points = [{"streams": n, "within_budget": True, "cpu_s_per_frame": cpu} for n in held]
        points.append({"streams": missed, "within_budget": False, "cpu_s_per_frame": cpu / 2})
        return {"sysbench": {"points": points, "plan": {"cores": 2}, "streams_at_budget": max(held, default=0),
                             "frames": {"fps": 10.0}},
                "bottleneck": {"bottleneck": "pnet" if held else None}, "targets": ["openvino-cpu", "ort-cpu"]}

    rows = report_systems.cost_rows({"a": doc([1, 2, 4], 8, 0.03), "b": doc([], 1, 0.05)})
    assert rows[0] == ["a", "openvino-cpu, ort-cpu", 4, 0.5, 0.3, "pnet"]
    assert rows[1] == ["b", "openvino-cpu, ort-cpu", 0, "—", "—", "—"]
