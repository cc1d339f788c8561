"""Accuracy vs speed of an INT8 model as nodes are kept in float: the trade-off curve behind a mixed recipe.

    python scripts/int8_tradeoff.py [--model embedder] [--recipe ort] [--max-float 6] [--runs 200]

Float sets come from `kiln mixed`'s own search (pipeline/quant/mixed.py, `--rank snr`: the layer-wise report's ranking,
nodes added one at a time) run with an unreachable budget, so every prefix of the ranking is judged by the model's
face-task gate (golden cosine min for the embedder). Each set's QDQ model (the stored calibration, the quantize
stage's code) is then timed at batch 1 against its FP32 sibling on the same runtime, interleaved run by run:
ONNX Runtime CPU set up as the ort-cpu engine, and OpenVINO CPU with the f32 precision hint as the openvino-cpu
engine. It prints one row per float set; nothing here is a gate. Run it on a built tree, on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def interleaved(fns, runs: int) -> list[float]:
    """Median ms of each callable, called in turn, `runs` rounds after 20 warm-up rounds."""
    times = [[] for _ in fns]
    for r in range(20 + runs):
        for k, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            if r >= 20:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def openvino_fn(path: Path, x: np.ndarray):
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": "1",
                                                         "INFERENCE_NUM_THREADS": "2"})
    req = compiled.create_infer_request()
    return lambda: req.infer([x])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedder")
    ap.add_argument("--recipe", default="ort")
    ap.add_argument("--max-float", type=int, default=6)
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args(argv)

    from int8_profile import session

    from pipeline import paths
    from pipeline.quant import mixed
    from pipeline.config import load
    from pipeline.quant.calibration import preprocess
    from pipeline.quant.qdq import load_ranges, quantize_graph
    from pipeline.roles import registry as roles

    cfg = load(REPO / "params.yaml")
    metric = roles.get(cfg.model(args.model).samples).key_metric
    # an unreachable floor: the greedy search judges every prefix of the ranking instead of stopping at a pass
    if metric != "cosine_min":
        raise SystemExit(f"{args.model}: the curve is for embedders (golden cosine); use `kiln mixed` for the others")
    never = cfg.replace(validate=dataclasses.replace(cfg.validate, cosine_min=1.0))
    res = mixed.search(never, args.model, args.recipe, REPO, max_float=args.max_float, rank="snr",
                       progress=lambda _: None)
    trials = [res.full_int8, *res.trials]
    base = cfg.recipes[args.recipe]
    ranges = load_ranges(paths.calibration(args.model, REPO) / "ranges.json")["tensors"]
    x = np.random.default_rng(0).uniform(0, 255, (1, *cfg.model(args.model).input_shape)).astype(np.float32)
    fp32 = REPO / paths.export(args.model) / paths.ONNX_FILE
    print(f"{args.model}: INT8 `{args.recipe}` with the SNR ranking's first k nodes in float; {metric} on the gate "
          f"(validate limit {cfg.validate.cosine_min}); batch 1, ms medians of {args.runs} interleaved "
          "runs; × = FP32 sibling / INT8 on the same runtime")
    print(f"{'k':>2} {'float node added':<34} {metric:>11} {'gate':>5} {'ORT ms':>7} {'ORT ×':>6} {'OV ms':>7} "
          f"{'OV ×':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        preprocess(fp32, pre)
        ort32 = session(fp32)
        name = ort32.get_inputs()[0].name
        ov32 = openvino_fn(fp32, x)
        for k, t in enumerate(trials):
            q = Path(tmp) / f"k{k}.onnx"
            quantize_graph(pre, ranges, dataclasses.replace(base, float_nodes=t.float_nodes), q)
            ort8 = session(q)
            ov8 = openvino_fn(q, x)
            a32, a8, o32, o8 = interleaved([lambda: ort32.run(None, {name: x}), lambda: ort8.run(None, {name: x}),
                                            ov32, ov8], args.runs)
            # the real gate: every failure but the unreachable floor's, and the metric against params' own limit
            value = t.metrics.get(metric, float("nan"))
            limit_ok = "pass" if (not [f for f in t.failures if not f.startswith(metric)]
                                  and value >= getattr(cfg.validate, metric)) else "fail"
            added = t.float_nodes[-1] if t.float_nodes else "(full INT8)"
            print(f"{k:>2} {added:<34} {value:>11.6f} {limit_ok:>5} {a8:>7.3f} "
                  f"{a32 / a8:>6.2f} {o8:>7.3f} {o32 / o8:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
