"""Why an INT8 model is (not) faster than its FP32 sibling on ONNX Runtime CPU: per-op-type kernel time, side by side.

    python scripts/int8_profile.py [--models rnet pnet embedder] [--recipe ort] [--batches 1 8] [--runs 200]

For each model it loads the FP32 export (artifacts/export/<model>) and the recipe's QDQ model
(artifacts/quantized/<model>-<recipe>) into sessions set up as the ort-cpu engine is (all graph optimizations, 2
intra-op threads, no spin-wait), then
  1. times both, interleaved run by run (this machine is noisy: a ratio measured in one loop, never two timings),
  2. profiles a few hundred runs of each with ONNX Runtime's profiler and sums kernel time per op type, grouped as
     compute (Conv / QLinearConv / MatMul / Gemm …), quantize/dequantize, and the rest (PRelu, pooling, Softmax …).
The per-group split says where an INT8 model's time goes: when the integer kernels save less than the
QuantizeLinear / DequantizeLinear around every float op cost, INT8 loses. Nothing here is a gate; it prints.
Run it on a built tree (dvc repro) and on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COMPUTE = {"Conv", "QLinearConv", "MatMul", "QLinearMatMul", "MatMulInteger", "Gemm", "FusedConv", "FusedGemm",
           "FusedMatMul", "ConvInteger", "QGemm", "NhwcConv", "QLinearAdd", "QLinearMul"}
QDQ = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}


def session(path: Path, profile_dir: Path | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    if profile_dir is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_dir / path.parent.name)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def op_times(path: Path, feed: dict, runs: int) -> tuple[dict[str, float], dict[str, int]]:
    """Mean kernel µs per run by op type, and the node count per op type, from ORT's profiler."""
    warmup = 10
    with tempfile.TemporaryDirectory() as tmp:
        s = session(path, Path(tmp))
        for _ in range(warmup + runs):
            s.run(None, feed)
        events = json.loads(Path(s.end_profiling()).read_text(encoding="utf-8"))
    # only the runs after the warm-up (the first runs pre-pack weights): kernel events inside their model_run spans
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[warmup:]
    if len(spans) != runs:
        raise SystemExit(f"{path}: the profile holds {len(spans) + warmup} runs, expected {warmup + runs}")
    start = spans[0][0]
    total, nodes = defaultdict(float), defaultdict(set)
    for e in events:
        if (e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start):
            op = e.get("args", {}).get("op_name", "?")
            total[op] += e["dur"]
            nodes[op].add(e["name"])
    return {op: t / runs for op, t in total.items()}, {op: len(n) for op, n in nodes.items()}


def group(times: dict[str, float]) -> dict[str, float]:
    g = {"compute": 0.0, "quantize/dequantize": 0.0, "other": 0.0}
    for op, t in times.items():
        g["compute" if op in COMPUTE else "quantize/dequantize" if op in QDQ else "other"] += t
    return g


def interleaved(a, b, feed: dict, runs: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(20):
        a.run(None, feed)
        b.run(None, feed)
    for _ in range(runs):
        t0 = time.perf_counter()
        a.run(None, feed)
        t1 = time.perf_counter()
        b.run(None, feed)
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["rnet", "pnet", "embedder"])
    ap.add_argument("--recipe", default="ort")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--params", default=str(REPO / "params.yaml"))
    args = ap.parse_args(argv)

    from pipeline import paths
    from pipeline.config import load

    cfg = load(Path(args.params))
    rng = np.random.default_rng(0)
    for model in args.models:
        fp32 = REPO / paths.export(model) / paths.ONNX_FILE
        int8 = REPO / paths.quantized(model, args.recipe) / paths.ONNX_FILE
        for p in (fp32, int8):
            if not p.is_file():
                print(f"{p}: missing — build it first (dvc repro)", file=sys.stderr)
                return 1
        shape = cfg.model(model).input_shape
        a, b = session(fp32), session(int8)
        name = a.get_inputs()[0].name
        print(f"\n## {model}: FP32 export vs INT8 `{args.recipe}` QDQ, ORT CPU (2 threads, all optimizations), "
              f"input {list(shape)}")
        for batch in args.batches:
            feed = {name: rng.uniform(-1, 1, (batch, *shape)).astype(np.float32)}
            t32, t8 = interleaved(a, b, feed, args.runs)
            o32, n32 = op_times(fp32, feed, args.runs)
            o8, n8 = op_times(int8, feed, args.runs)
            g32, g8 = group(o32), group(o8)
            print(f"\nbatch {batch}: median FP32 {t32:.3f} ms, INT8 {t8:.3f} ms → INT8 speedup {t32 / t8:.2f}× "
                  f"(interleaved, {args.runs} runs each)")
            print(f"{'kernel time per run (µs)':<28} {'FP32':>9} {'INT8':>9}")
            for k in g32:
                print(f"  {k:<26} {g32[k]:9.1f} {g8[k]:9.1f}")
            print(f"  {'sum of kernels':<26} {sum(g32.values()):9.1f} {sum(g8.values()):9.1f}")
            print(f"{'op type (nodes FP32/INT8)':<28} {'FP32':>9} {'INT8':>9}")
            for op in sorted(set(o32) | set(o8), key=lambda o: -(o32.get(o, 0) + o8.get(o, 0))):
                print(f"  {op + f' ({n32.get(op, 0)}/{n8.get(op, 0)})':<26} {o32.get(op, 0):9.1f} "
                      f"{o8.get(op, 0):9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
