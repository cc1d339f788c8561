"""Timing engines side by side, as bench@ and bench/engines.py do: every engine of a model and its baseline (PyTorch
eager, or ORT on an ONNX-delivered original) interleaved in rounds in one process so machine noise hits them alike;
cold start and memory in a fresh process per engine (pipeline/coldstart.py); percentiles, ratios, the speed gate (an
INT8 engine must beat its FP32 sibling on the same target) and the side-by-side table."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline import coldstart, models, paths, stage, tables, targets, toolchain
from pipeline import engines as engine_loader
from pipeline.gates import benchgate
from pipeline.roles.registry import synthetic_feed

ROUNDS = 5
EAGER = "pytorch-eager"
ONNX_ORIGINAL = "onnx-original"     # the baseline of a model delivered as ONNX (ORT, graph optimizations off)


@dataclass(frozen=True)
class BenchResult:
    report: dict
    failures: list[str]


def cold_start(target: str, engine_dir: Path, input_shape: tuple[int, ...], max_batch: int,
               kind: str) -> dict[str, float]:
    """Fresh process, from its start to the first output (interpreter, Kiln's loader, the target's runtime,
    verified load + session creation, first inference); resident memory after max-batch inferences. `kind`: the
    model's role (params `samples`), whose synthetic feed it runs."""
    args = [sys.executable, "-m", coldstart.__name__, target, str(engine_dir), json.dumps(list(input_shape)),
            str(max_batch), kind]
    out = subprocess.run(args + [repr(time.time())], capture_output=True, text=True, env=stage.cli_env())
    if out.returncode != 0:
        from pipeline.errors import KilnError

        raise KilnError(f"cold start of {engine_dir} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}",
                        "run `kiln validate` on the engine first")
    r = json.loads(out.stdout.strip().splitlines()[-1])
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


def int8_gate(report: dict, engines: list, batches: tuple[int, ...], min_speedup: float) -> list[str]:
    """Speed-ups of each INT8 engine over its FP32 sibling on the same target (written into `report`), and a
    failure for every batch where it is below `min_speedup` (the engine's `bench_gate` in `report` says fail)."""
    failures = []
    for e in engines:
        if e.precision != "int8":
            continue
        sibling = benchgate.fp32_sibling(e, engines)
        if sibling is None:
            continue
        m = report["engines"][e.name]
        for b in batches:
            ratio = report["engines"][sibling.name][f"b{b}_p50_ms"] / m[f"b{b}_p50_ms"]
            m[f"b{b}_speedup_vs_fp32"] = round(ratio, 3)
            report["ratios"][f"{e.name}/{sibling.name}@b{b}"] = round(ratio, 3)
            if ratio < min_speedup:
                m["bench_gate"] = "fail"
                failures.append(f"{e.name} is {ratio:.2f}× its FP32 sibling {sibling.name} at batch {b} "
                                f"(needs ≥ {min_speedup:g}×): the INT8 recipe {e.recipe!r} does not pay")
    return failures


def measure_model(cfg, model_name: str, root: Path = Path("."), progress=print) -> BenchResult:
    mcfg, bcfg = cfg.model(model_name), cfg.bench
    engines = cfg.engines_of(model_name)
    inputs = {b: synthetic_feed(mcfg.samples, mcfg.input_shape, b) for b in bcfg.batches}
    report: dict = {"model": model_name, "engines": {}, "ratios": {}, "host": toolchain.host(),
                    "isa": toolchain.cpu()["isa"], "settings": cfg.section("bench")}
    not_run = {e.name: why for e in engines
               for ok, why in [targets.get(e.target).runnable(paths.engine(e.name, root))] if not ok}
    engines = [e for e in engines if e.name not in not_run]       # build-only here: reported, not timed
    report["not_run"] = not_run
    for e in engines:  # cold start first, in fresh processes, before this process warms anything
        report["engines"][e.name] = cold_start(e.target, paths.engine(e.name, root), mcfg.input_shape,
                                               max(bcfg.batches), mcfg.samples)
    variants: dict[str, Callable] = {e.name: engine_loader.load(e.target, paths.engine(e.name, root)).run_all
                                     for e in engines}
    import torch

    threads = {int(cfg.targets[e.target].options.get("threads", 0)) for e in engines} - {0}
    if threads:
        torch.set_num_threads(max(threads))
    if mcfg.onnx is None:
        eager = models.build(mcfg, root)

        def run_eager(feed: dict[str, np.ndarray]):
            with torch.inference_mode():
                return eager(*(torch.from_numpy(v) for v in feed.values()))
        baseline = EAGER
    else:   # a model delivered as ONNX: its reference (golden@), ORT on the original file, optimizations off
        from pipeline import onnx_import

        run_eager, _ = onnx_import.reference_session(onnx_import.load_source(mcfg, root), mcfg.layout)
        baseline = ONNX_ORIGINAL
    report["baseline"] = baseline           # what the `×eager` columns divide by
    variants[baseline] = run_eager
    lat = measure(variants, inputs, bcfg.warmup, bcfg.min_runs, bcfg.min_seconds, progress)
    for name in variants:
        report["engines"].setdefault(name, {}).update(summarize(lat[name]))
    for e in engines:
        m = report["engines"][e.name]
        for b in bcfg.batches:
            m[f"b{b}_speedup_vs_eager"] = round(report["engines"][baseline][f"b{b}_p50_ms"] / m[f"b{b}_p50_ms"], 3)
    failures = int8_gate(report, engines, bcfg.batches, bcfg.int8_min_speedup)
    report["failures"] = failures
    report["verdict"] = "fail" if failures else "pass"
    return BenchResult(report, failures)


def table(report: dict, batches: tuple[int, ...], extra: dict[str, dict[str, float]] | None = None) -> str:
    """The side-by-side table printed by the CLI and the bench script; `extra` adds columns per engine."""
    extra = extra or {}
    extra_cols = sorted({k for v in extra.values() for k in v})
    cols = [f"b{b} p50 ms" for b in batches] + [f"b{b} p99 ms" for b in batches] + \
        [f"b{b} ×eager" for b in batches] + [f"b{b} ×fp32" for b in batches] + ["cold ms", "peak RSS MB",
                                                                               "engine MB"] + extra_cols
    rows = []
    for name, m in report["engines"].items():
        rows.append([name] + [m.get(f"b{b}_p50_ms") for b in batches] + [m.get(f"b{b}_p99_ms") for b in batches]
                    + [m.get(f"b{b}_speedup_vs_eager") for b in batches]
                    + [m.get(f"b{b}_speedup_vs_fp32") for b in batches]
                    + [m.get("cold_start_ms"), m.get("peak_rss_mb"), m.get("engine_rss_mb")]
                    + [extra.get(name, {}).get(c) for c in extra_cols])
    for name in report.get("not_run", {}):          # build-only here: listed, never timed, never a winner
        rows.append([f"{name} (built only: not run here)"] + [None] * len(cols))
    return tables.markdown(["engine", *cols], rows)
