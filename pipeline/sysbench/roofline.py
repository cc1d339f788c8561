"""Where a system's frame time goes: each stage's share under load, a roofline point per graph, Amdahl headroom.

* FLOPs and bytes per call are counted from the graph (the model's exported ONNX, shapes inferred at the input
  shapes the system actually fed it on the frame source): Conv 2·out·(Cin/g)·kh·kw, Gemm / MatMul 2·out·K, every
  other op one per output element. Bytes moved is an estimate with no cache: every weight read once (1 byte per
  weight for an INT8 engine, 4 for FP32), the inputs read, every intermediate written and read once (float32).
* This host's roof is measured, not looked up: peak FLOP/s as the best float32 1024² matmul rate (torch, with the
  engines' intra-op thread count) and memory bandwidth as the best large-array copy rate (numpy, read + write).
* A graph's point: arithmetic intensity = FLOPs / bytes, achieved FLOP/s = FLOPs per frame / its ms per frame at
  the lightest load measured. The roof is float32's: an INT8 graph (VNNI) can sit above it. Bound: `compute` when
  the intensity is past the ridge (peak / bandwidth), else `memory`; a graph at under 10 % of its attainable rate
  is `overhead` — it is dominated by per-call costs (dispatch, small kernels, threads), not by the roof.
* Amdahl: a stage that owns a share p of the frame's service time gives back p·(1 − 1/k) of it when made k× faster.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.e2e import System

OVERHEAD = 0.10
_ELEM = {1: 4, 2: 1, 3: 1, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2}       # onnx TensorProto data type → bytes


# ---------------------------------------------------------------------------------------------- graph cost
def graph_cost(onnx_path: Path, shapes: list[tuple[int, ...]], weight_bytes: int = 4) -> dict:
    """FLOPs and estimated bytes moved of one call of the graph with inputs of `shapes` (in the graph's order)."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    init = {i.name: (list(i.dims), i.data_type) for i in m.graph.initializer}
    inputs = [i for i in m.graph.input if i.name not in init]
    for inp, shape in zip(inputs, shapes):
        dims = inp.type.tensor_type.shape.dim
        for d, v in zip(dims, shape):
            d.ClearField("dim_param")
            d.dim_value = int(v)
    inferred = onnx.shape_inference.infer_shapes(m, data_prop=True)
    known: dict[str, list[int] | None] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        known[vi.name] = [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None
    for name, (dims, _) in init.items():
        known[name] = dims
    flops, act_bytes, unknown = 0, 0, 0
    for node in inferred.graph.node:
        out = known.get(node.output[0]) if node.output else None
        if out is None:
            unknown += 1
            continue
        n_out = int(np.prod(out)) if out else 1
        act_bytes += 2 * 4 * sum(int(np.prod(known[o])) for o in node.output if known.get(o) is not None)
        if node.op_type == "Conv" and known.get(node.input[1]):
            flops += 2 * n_out * int(np.prod(known[node.input[1]][1:]))
        elif node.op_type in ("Gemm", "MatMul") and known.get(node.input[0]):
            a = known[node.input[0]]
            trans_a = any(at.name == "transA" and at.i for at in node.attribute)
            flops += 2 * n_out * (a[0] if trans_a and len(a) == 2 else a[-1])
        elif node.op_type != "Constant":
            flops += n_out
    weights = sum(int(np.prod(d)) for d, _ in init.values())
    in_bytes = sum(4 * int(np.prod(s)) for s in shapes)
    return {"flops": int(flops), "bytes": int(weights * weight_bytes + in_bytes + act_bytes),
            "weights": int(weights), "nodes_without_shapes": unknown}


# ---------------------------------------------------------------------------------------------- this host's roof
def host_roof(threads: int, seconds: float = 0.6) -> dict:
    """Measured peak float32 FLOP/s (matmul, `threads` threads) and memory bandwidth (copy, bytes read + written)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * 1024 ** 3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(before)
    src = np.ones(32 * 1024 * 1024, np.float32)        # 128 MiB: far past any cache here
    dst = np.empty_like(src)
    bw, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        bw = max(bw, 2 * src.nbytes / (time.perf_counter() - t0))
    return {"peak_flops": best, "bandwidth_bytes_s": bw, "ridge_flops_per_byte": best / bw, "threads": threads,
            "how": "peak: best float32 1024x1024 torch.mm; bandwidth: best 128 MiB numpy copy (read + write)"}


def point(flops_per_frame: float, bytes_per_frame: float, ms_per_frame: float, roof: dict) -> dict:
    """A graph's roofline point on this host's roof."""
    intensity = flops_per_frame / bytes_per_frame if bytes_per_frame else 0.0
    attainable = min(roof["peak_flops"], intensity * roof["bandwidth_bytes_s"])
    achieved = flops_per_frame / (ms_per_frame / 1e3) if ms_per_frame else 0.0
    share = achieved / attainable if attainable else 0.0
    bound = "overhead" if share < OVERHEAD else ("compute" if intensity >= roof["ridge_flops_per_byte"] else "memory")
    return {"flops_per_frame": int(flops_per_frame), "bytes_per_frame": int(bytes_per_frame),
            "intensity": round(intensity, 3), "achieved_gflops": round(achieved / 1e9, 3),
            "attainable_gflops": round(attainable / 1e9, 3), "of_attainable": round(share, 4), "bound": bound}


# ---------------------------------------------------------------------------------------------- shares, headroom
def shares(point_: dict) -> dict:
    """Each stage's share of the frame's latency at one load point (queue wait included as its own stage) and the
    Amdahl saving of 2× on each stage, as a share of the frame's latency."""
    stages = dict(point_["stage_ms_per_frame"])
    wait = point_["queue_wait_ms"]["mean"] or 0.0
    service = sum(stages.values())
    total = service + wait
    if not total:
        return {"stages": {}, "amdahl_2x": {}, "bottleneck": None}
    share = {st: round(ms / total, 4) for st, ms in stages.items()}
    share["queue_wait"] = round(wait / total, 4)
    return {"stages": share, "service_ms": round(service, 3), "frame_ms": round(total, 3),
            "amdahl_2x": {st: round(ms * 0.5 / total, 4) for st, ms in stages.items()},
            "bottleneck": max(stages, key=stages.get) if stages else None}


def capture_shapes(system: System, frame_list: list[np.ndarray]) -> dict[str, list[list[tuple[int, ...]]]]:
    """Run every frame through `system` once, recording each graph call's input shapes (model → calls)."""
    from pipeline.config import MTCNN
    from pipeline.samples import NETS

    spec = system.cfg.system(system.system)
    names = NETS if spec.detector == MTCNN else (spec.detector,)
    calls: dict[str, list] = {n: [] for n in names}

    def wrap(model, fn):
        calls.setdefault(model, [])

        def run(*xs):
            calls[model].append([tuple(x.shape) for x in xs])
            return fn(*xs)
        return run
    system.nets = tuple(wrap(n, f) for n, f in zip(names, system.nets))
    if system.align is not None:
        system.align = wrap("aligner", system.align)
    system.embed = wrap(spec.embedder, system.embed)
    for f in frame_list:
        system.identify_frames([f], {})
    return calls


STAGE_OF = {"aligner": "align"}       # graph → the stage its time is booked under (the embedder: "embed")


def bottleneck(cfg: Config, system_name: str, picks: dict[str, str], calls: dict, frames_run: int, sweep: dict,
               roof: dict, root: Path = Path(".")) -> dict:
    """bottleneck.json: shares under load, a roofline point per graph, Amdahl headroom."""
    from pipeline import paths

    points = sweep["points"]
    held = [p for p in points if p["within_budget"]]
    at = held[-1] if held else points[0]
    light = points[0]
    embedder = cfg.system(system_name).embedder
    graphs = {}
    for model, model_calls in calls.items():
        src = paths.export(model, root) / paths.ONNX_FILE
        stage = "embed" if model == embedder else STAGE_OF.get(model, model)
        ms = light["stage_ms_per_frame"].get(stage, 0.0)
        if not src.is_file() or not model_calls:
            graphs[model] = {"engine": picks.get(model), "stage": stage, "calls_per_frame": 0, "roofline": None,
                             "why": "no exported ONNX graph to count" if not src.is_file() else "not called"}
            continue
        wb = 1 if cfg.engine(picks[model]).precision == "int8" else 4
        costs: dict[tuple, dict] = {}
        for shapes in model_calls:
            key = tuple(shapes)
            if key not in costs:
                costs[key] = graph_cost(src, list(key), wb)
        flops = sum(costs[tuple(s)]["flops"] for s in model_calls) / frames_run
        moved = sum(costs[tuple(s)]["bytes"] for s in model_calls) / frames_run
        graphs[model] = {"engine": picks.get(model), "precision": cfg.engine(picks[model]).precision,
                         "stage": stage, "calls_per_frame": round(len(model_calls) / frames_run, 3),
                         "ms_per_frame_light": ms, "roofline": point(flops, moved, ms, roof)}
    return {"system": system_name, "at_streams": at["streams"], "light_streams": light["streams"],
            **shares(at), "graphs": graphs, "roof": roof}
