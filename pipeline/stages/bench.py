"""bench@<model>: latency, throughput, cold start and peak memory of every engine of a model, side by side.

All engines of the model and the PyTorch eager model ("the model just runs") are measured in one process,
interleaved in rounds so machine noise hits them alike; ratios come from that one run. Cold start (session
creation + first inference) and peak RSS are measured in a fresh subprocess per engine. Outputs are DVC metrics
with `cache: false`, so a run-cache restore can never bring back stale timings. An INT8 engine that is not faster
than its FP32 sibling on the same target fails its recipe (exit 1), after the numbers are written.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline import models, paths, targets, toolchain
from pipeline.config import Config
from pipeline.manifest import write_json_atomic
from pipeline.targets.base import synthetic_feed

ROUNDS = 5
EAGER = "pytorch-eager"

_COLD = """
import json, resource, sys, time
t0 = time.perf_counter()
from pathlib import Path
import numpy as np
from pipeline import targets
from pipeline.targets.base import synthetic_feed as bench_feed
import onnx, onnxruntime  # noqa: F401  (runtime imports count as baseline, not as the engine's memory)
t_import = time.perf_counter()
def rss_mb():  # current resident set; ru_maxrss is a high-water mark that the imports already set
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
rss_base = rss_mb()
runner = targets.get(sys.argv[1]).load(Path(sys.argv[2]))
t_load = time.perf_counter()
kind, shape = sys.argv[5], tuple(json.loads(sys.argv[3]))
runner.run_all(bench_feed(kind, shape, 1))
t_first = time.perf_counter()
big = bench_feed(kind, shape, int(sys.argv[4]))
for _ in range(5):
    runner.run_all(big)
print(json.dumps({"import_ms": (t_import - t0) * 1e3, "load_ms": (t_load - t_import) * 1e3,
                  "first_inference_ms": (t_first - t_load) * 1e3,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "engine_rss_mb": rss_mb() - rss_base}))
"""


@dataclass(frozen=True)
class BenchResult:
    report: dict
    failures: list[str]


def cold_start(target: str, engine_dir: Path, input_shape: tuple[int, ...], max_batch: int,
               kind: str = "chips") -> dict[str, float]:
    """Fresh process: import, session creation, first inference; resident memory after max-batch inferences."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _COLD, target, str(engine_dir), json.dumps(list(input_shape)),
                          str(max_batch), kind], capture_output=True, text=True, check=True, env=env)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["cold_start_ms"] = r["load_ms"] + r["first_inference_ms"]
    return {k: round(v, 3) for k, v in r.items()}


def measure(variants: dict[str, Callable[[dict], object]], inputs: dict[int, dict], warmup: int,
            min_runs: int, min_seconds: float, progress=print) -> dict[str, dict[int, np.ndarray]]:
    """Latencies (ms) per variant and batch, interleaved over ROUNDS rounds so noise is shared."""
    times = {v: {b: [] for b in inputs} for v in variants}
    for name, fn in variants.items():
        for b, x in inputs.items():
            for _ in range(warmup):
                fn(x)
    per_round_runs, per_round_s = max(1, -(-min_runs // ROUNDS)), min_seconds / ROUNDS
    for r in range(ROUNDS):
        for name, fn in variants.items():
            for b, x in inputs.items():
                t_end, n = time.perf_counter() + per_round_s, 0
                while n < per_round_runs or time.perf_counter() < t_end:
                    t0 = time.perf_counter()
                    fn(x)
                    times[name][b].append((time.perf_counter() - t0) * 1e3)
                    n += 1
        progress(f"bench: round {r + 1}/{ROUNDS} done")
    return {v: {b: np.asarray(t) for b, t in bt.items()} for v, bt in times.items()}


def summarize(lat: dict[int, np.ndarray]) -> dict[str, float]:
    out = {}
    for b, t in lat.items():
        p50, p95, p99 = np.percentile(t, [50, 95, 99])
        out.update({f"b{b}_p50_ms": p50, f"b{b}_p95_ms": p95, f"b{b}_p99_ms": p99,
                    f"b{b}_throughput_per_s": 1e3 * b / p50, f"b{b}_runs": len(t)})
    return {k: round(float(v), 4) for k, v in out.items()}


def run(cfg: Config, model_name: str, root: Path = Path("."), progress=print) -> BenchResult:
    """The bench stage: measure, then write artifacts/bench/<model>/bench.json (DVC metrics, never cached)."""
    result = measure_model(cfg, model_name, root, progress)
    write_json_atomic(paths.bench(model_name, root) / "bench.json", result.report)
    return result


def measure_model(cfg: Config, model_name: str, root: Path = Path("."), progress=print) -> BenchResult:
    mcfg, bcfg = cfg.model(model_name), cfg.bench
    engines = [e for e in cfg.engines_of(model_name)]
    inputs = {b: synthetic_feed(mcfg.samples, mcfg.input_shape, b) for b in bcfg.batches}
    report: dict = {"model": model_name, "engines": {}, "ratios": {}, "host": toolchain.cpu(),
                    "python": platform.python_version(), "settings": cfg.section("bench")}
    for e in engines:  # cold start first, in fresh processes, before this process warms anything
        report["engines"][e.name] = cold_start(e.target, paths.engine(e.name, root), mcfg.input_shape,
                                               max(bcfg.batches), mcfg.samples)
    variants: dict[str, Callable] = {e.name: targets.get(e.target).load(paths.engine(e.name, root)).run_all
                                     for e in engines}
    import torch

    threads = {int(cfg.targets[e.target].options.get("threads", 0)) for e in engines} - {0}
    if threads:
        torch.set_num_threads(max(threads))
    eager = models.build(mcfg, root)

    def run_eager(feed: dict[str, np.ndarray]):
        with torch.inference_mode():
            return eager(*(torch.from_numpy(v) for v in feed.values()))

    variants[EAGER] = run_eager
    lat = measure(variants, inputs, bcfg.warmup, bcfg.min_runs, bcfg.min_seconds, progress)
    for name in variants:
        report["engines"].setdefault(name, {}).update(summarize(lat[name]))
    failures = []
    for e in engines:
        m = report["engines"][e.name]
        for b in bcfg.batches:
            m[f"b{b}_speedup_vs_eager"] = round(report["engines"][EAGER][f"b{b}_p50_ms"] / m[f"b{b}_p50_ms"], 3)
        if e.precision != "int8":
            continue
        sibling = next((s for s in engines if s.target == e.target and s.precision == "fp32"), None)
        if sibling is None:
            continue
        for b in bcfg.batches:
            ratio = report["engines"][sibling.name][f"b{b}_p50_ms"] / m[f"b{b}_p50_ms"]
            m[f"b{b}_speedup_vs_fp32"] = round(ratio, 3)
            report["ratios"][f"{e.name}/{sibling.name}@b{b}"] = round(ratio, 3)
            if ratio < bcfg.int8_min_speedup:
                failures.append(f"{e.name} is {ratio:.2f}× its FP32 sibling {sibling.name} at batch {b} "
                                f"(needs ≥ {bcfg.int8_min_speedup:g}×): the INT8 recipe {e.recipe!r} does not pay")
    report["failures"] = failures
    report["verdict"] = "fail" if failures else "pass"
    return BenchResult(report, failures)


def table(report: dict, batches: tuple[int, ...], extra: dict[str, dict[str, float]] | None = None) -> str:
    """The side-by-side table printed by the CLI and the bench script; `extra` adds columns per engine."""
    extra = extra or {}
    extra_cols = sorted({k for v in extra.values() for k in v})
    cols = [f"b{b} p50 ms" for b in batches] + [f"b{b} p99 ms" for b in batches] + \
        [f"b{b} ×eager" for b in batches] + [f"b{b} ×fp32" for b in batches] + ["cold ms", "peak RSS MB", "engine MB"] + extra_cols
    lines = ["| engine | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in report["engines"].items():
        vals = [m.get(f"b{b}_p50_ms") for b in batches] + [m.get(f"b{b}_p99_ms") for b in batches] + \
            [m.get(f"b{b}_speedup_vs_eager") for b in batches] + [m.get(f"b{b}_speedup_vs_fp32") for b in batches] + \
            [m.get("cold_start_ms"), m.get("peak_rss_mb"), m.get("engine_rss_mb")] + [extra.get(name, {}).get(c) for c in extra_cols]
        lines.append(f"| {name} | " + " | ".join("" if v is None else f"{v:.4g}" for v in vals) + " |")
    return "\n".join(lines)
