"""Timing engines side by side, as bench@ and bench/engines.py do: every engine of a model and its baseline (PyTorch
eager, or ORT on an ONNX-delivered original) interleaved in rounds in one process so machine noise hits them alike;
cold start and memory in a fresh process per engine (pipeline/coldstart.py); percentiles, ratios, the speed gate (an
INT8 engine must beat its FP32 sibling on the same target by a margin, with confidence: `int8_decision`) and the
side-by-side table. Every result is this host class's (toolchain.host_class)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from pipeline import coldstart, models, paths, tables, targets, toolchain
from pipeline.checkout import cli_env
from pipeline import engines as engine_loader
from pipeline.gates import benchgate
from pipeline.roles.registry import synthetic_feed

if TYPE_CHECKING:
    from pipeline.config import Config

ROUNDS = 5
SLICES = 4           # visits of every variant per round (see `measure`)
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
    out = subprocess.run(args + [repr(time.time())], capture_output=True, text=True, env=cli_env(), encoding="utf-8",
                         errors="replace")
    if out.returncode != 0:
        from pipeline.errors import KilnError

        raise KilnError(f"cold start of {engine_dir} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}",
                        "run `kiln validate` on the engine first")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: round(v, 3) for k, v in r.items()}


def measure(variants: dict[str, Callable[[dict], object]], inputs: dict[int, dict], warmup: int,
            min_runs: int, min_seconds: float, progress=print) -> dict[str, dict[int, list[np.ndarray]]]:
    """Latencies (ms) per variant and batch, interleaved over ROUNDS rounds so noise is shared: one array per round
    (the INT8 gate compares engines round by round; `summarize` pools them)."""
    times = {v: {b: [[] for _ in range(ROUNDS)] for b in inputs} for v in variants}
    for name, fn in variants.items():
        for b, x in inputs.items():
            for _ in range(warmup):
                fn(x)
    # each round visits every variant SLICES times in short slices, so a burst of machine noise lands in the same
    # round of every engine instead of in one engine's whole round (the INT8 gate compares rounds)
    per_slice_runs = max(1, -(-min_runs // (ROUNDS * SLICES)))
    per_slice_s = min_seconds / (ROUNDS * SLICES)
    for r in range(ROUNDS):
        for _ in range(SLICES):
            for name, fn in variants.items():
                for b, x in inputs.items():
                    t_end, n = time.perf_counter() + per_slice_s, 0
                    while n < per_slice_runs or time.perf_counter() < t_end:
                        t0 = time.perf_counter()
                        fn(x)
                        times[name][b][r].append((time.perf_counter() - t0) * 1e3)
                        n += 1
        progress(f"bench: round {r + 1}/{ROUNDS} done")
    return {v: {b: [np.asarray(t) for t in rounds] for b, rounds in bt.items()} for v, bt in times.items()}


def summarize(lat: dict[int, list[np.ndarray] | np.ndarray]) -> dict[str, float | list[float]]:
    """Pooled percentiles per batch, and each interleaved round's p50 (`b<N>_round_p50_ms`, for the INT8 gate)."""
    out: dict = {}
    for b, rounds in lat.items():
        rounds = [rounds] if isinstance(rounds, np.ndarray) else rounds
        t = np.concatenate(rounds)
        p50, p95, p99 = np.percentile(t, [50, 95, 99])
        out.update({f"b{b}_p50_ms": p50, f"b{b}_p95_ms": p95, f"b{b}_p99_ms": p99,
                    f"b{b}_throughput_per_s": 1e3 * b / p50, f"b{b}_runs": len(t)})
        out[f"b{b}_round_p50_ms"] = [round(float(np.percentile(r, 50)), 4) for r in rounds]
    return {k: v if isinstance(v, list) else round(float(v), 4) for k, v in out.items()}


@dataclass(frozen=True)
class Int8Decision:
    """One INT8 engine at one batch against its FP32 sibling, from the same interleaved rounds."""

    pays: bool
    ratio: float                  # median over rounds of FP32 p50 / INT8 p50 (> 1: INT8 faster)
    spread: float                 # max − min of the per-round ratios
    rounds: tuple[float, ...]     # the per-round ratios
    why: str                      # "" when it pays: "below the margin" | "spread too wide"


def int8_decision(fp32_round_p50: list[float], int8_round_p50: list[float], margin: float) -> Int8Decision:
    """Does INT8 pay, with confidence? Per interleaved round r, ratio_r = FP32 p50_r / INT8 p50_r (both timed in the
    same round). With margin = params bench.int8_min_speedup, it pays when the median ratio ≥ margin AND either
    (a) the spread of the ratios, max − min, is < margin − 1 (the rounds agree to within the speed-up asked for
        beyond parity, so the margin is not one lucky round), or
    (b) every round's ratio is ≥ margin (the worst round clears it: if the true ratio were below the margin, all
        ROUNDS = 5 rounds clearing it would have probability ≤ 1/32 — a one-sided sign test).
    (b) exists because (a) is absolute: a 4× engine on a loaded host spreads by whole units between rounds while
    every round still pays (measured: OpenVINO INT8 per-round 1.9–9.0× its FP32 sibling); (a) alone would mark it
    not faster. A median below the margin never pays; a median above it with a wide spread and a round below the
    margin is "spread too wide"."""
    if len(fp32_round_p50) != len(int8_round_p50) or not int8_round_p50:
        raise ValueError("int8_decision needs one p50 per round for both engines, the same rounds")
    ratios = tuple(round(f / i, 4) for f, i in zip(fp32_round_p50, int8_round_p50))
    ratio, spread = round(float(np.median(ratios)), 4), round(max(ratios) - min(ratios), 4)
    if ratio < margin:
        return Int8Decision(False, ratio, spread, ratios, "below the margin")
    if not (spread < margin - 1 or min(ratios) >= margin):
        return Int8Decision(False, ratio, spread, ratios, "spread too wide")
    return Int8Decision(True, ratio, spread, ratios, "")


def int8_gate(report: dict, engines: list, batches: tuple[int, ...], min_speedup: float,
              host_class: str | None = None) -> list[str]:
    """Each INT8 engine against its FP32 sibling on the same target, at every benched batch (`int8_decision`): the
    median ratio and the rounds' spread go into `report` (`b<N>_speedup_vs_fp32`, `b<N>_speedup_spread`, `ratios`,
    `int8`), and the engine's `bench_gate` is `pass` when it pays at every batch, else `not-faster-here` — never a
    failure: it is still built, validated and registrable, but never a leaderboard winner, and promote says so in
    its record.
    Returns one line per batch where it does not pay. A report without per-round p50s counts as one round."""
    not_paying = []
    report.setdefault("int8", {})
    for e in engines:
        if e.precision != "int8":
            continue
        sibling = benchgate.fp32_sibling(e, engines)
        if sibling is None:
            continue
        m, f = report["engines"][e.name], report["engines"][sibling.name]
        entry = {"fp32_sibling": sibling.name, "margin": min_speedup, "host_class": host_class,
                 "rule": f"median of the per-round FP32/INT8 p50 ratios ≥ {min_speedup:g} and either their spread "
                         f"(max − min) < {min_speedup - 1:.4g} or every round's ratio ≥ {min_speedup:g}",
                 "batches": {}}
        pays = True
        for b in batches:
            d = int8_decision(f.get(f"b{b}_round_p50_ms") or [f[f"b{b}_p50_ms"]],
                              m.get(f"b{b}_round_p50_ms") or [m[f"b{b}_p50_ms"]], min_speedup)
            m[f"b{b}_speedup_vs_fp32"], m[f"b{b}_speedup_spread"] = round(d.ratio, 3), round(d.spread, 3)
            report["ratios"][f"{e.name}/{sibling.name}@b{b}"] = round(d.ratio, 3)
            entry["batches"][str(b)] = {"ratio": d.ratio, "spread": d.spread, "rounds": list(d.rounds),
                                        "pays": d.pays, "why": d.why}
            if d.why == "below the margin":
                not_paying.append(f"{e.name} is {d.ratio:.2f}× its FP32 sibling {sibling.name} at batch {b} "
                                  f"(needs ≥ {min_speedup:g}×): the INT8 recipe {e.recipe!r} does not pay")
            elif d.why:
                not_paying.append(f"{e.name} is {d.ratio:.2f}× its FP32 sibling {sibling.name} at batch {b}, but its "
                                  f"per-round ratios spread {d.spread:.2f} (needs < {min_speedup - 1:.2f}) and its "
                                  f"worst round is {min(d.rounds):.2f}× (< {min_speedup:g}×): not confidently faster")
            pays = pays and d.pays
        entry["verdict"] = m["bench_gate"] = "pass" if pays else benchgate.NOT_FASTER
        report["int8"][e.name] = entry
    return not_paying


def measure_model(cfg: Config, model_name: str, root: Path = Path("."), progress=print) -> BenchResult:
    mcfg, bcfg = cfg.model(model_name), cfg.bench
    engines = cfg.engines_of(model_name)
    inputs = {b: synthetic_feed(mcfg.samples, mcfg.input_shape, b) for b in bcfg.batches}
    host_class = toolchain.host_class()
    report: dict = {"model": model_name, "engines": {}, "ratios": {}, "host": toolchain.host(),
                    "isa": toolchain.cpu()["isa"], "host_class": host_class, "settings": cfg.section("bench")}
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
    # an INT8 engine that does not pay here is `not-faster-here`, not a failure: the DAG goes on
    report["not_faster_here"] = int8_gate(report, engines, bcfg.batches, bcfg.int8_min_speedup, host_class)
    report["failures"] = []
    report["verdict"] = "pass"
    return BenchResult(report, [])


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
