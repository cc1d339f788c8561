"""Host classes (pipeline/toolchain.py `host_class`) and the INT8-must-pay gate (pipeline/gates/timing.py), on
synthetic facts and synthetic per-round timings: no bench number is measured or asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline import paths, toolchain
from pipeline.report import leaderboard
from pipeline.gates import benchgate, timing

FP32, INT8 = "embedder-ort-cpu-fp32", "embedder-ort-cpu-int8"
OV_FP32, OV_INT8 = "embedder-openvino-cpu-fp32", "embedder-openvino-cpu-int8"


# ---------------------------------------------------------------------------------------------- host classes
@pytest.mark.parametrize("machine, flags, expected", [
    ("x86_64", ["sse4_2", "avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"], "x86-64-amx"),
    ("x86_64", ["sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"], "x86-64-avx512-vnni"),
    ("x86_64", ["sse4_2", "avx2", "avx512f", "avx512bw", "avx512vl"], "x86-64-avx512"),
    ("x86_64", ["sse4_2", "avx2", "fma", "avx_vnni"], "x86-64-avx2"),     # AVX-VNNI without AVX-512: still avx2
    ("AMD64", ["sse4_2", "avx2"], "x86-64-avx2"),
    ("x86_64", ["sse4_2"], "x86-64-sse4"),
    ("x86_64", [], "x86-64-generic"),                                    # flags unreadable: claim nothing
    ("aarch64", ["fp", "asimd", "sve", "sve2"], "aarch64-sve"),
    ("arm64", ["fp", "asimd"], "aarch64-neon"),
    ("aarch64", [], "aarch64-generic"),
    ("riscv64", ["rv64imafdc"], "riscv64-generic"),
    ("ppc64le", ["avx2"], "ppc64le-generic"),                           # another machine's flags mean nothing
])
def test_host_class_of_synthetic_isa_lists(machine, flags, expected):
    # the probe's two lists: `isa` (rebuild keys) and `class_flags`; either may carry a flag
    assert toolchain.host_class({"machine": machine, "isa": [], "class_flags": flags}) == expected
    assert toolchain.host_class({"machine": machine, "isa": flags}) == expected


def test_this_host_has_a_class_and_the_probe_keeps_its_rebuild_keys():
    facts = toolchain.cpu()
    assert set(facts["isa"]) <= set(toolchain.ISA_FLAGS)       # `isa` (a rebuild key) is what it was
    assert toolchain.host_class() == toolchain.host_class(facts)
    assert toolchain.host_class().startswith(("x86-64-", "aarch64-")) or toolchain.host_class().endswith("-generic")


# ---------------------------------------------------------------------------------------------- INT8 must pay
FP32_ROUNDS = [10.0, 10.0, 10.0, 10.0, 10.0]


def rounds(*ratios: float) -> list[float]:
    """INT8 per-round p50s that give these FP32/INT8 ratios against FP32_ROUNDS."""
    return [10.0 / r for r in ratios]


def test_int8_pays_with_confidence():
    d = timing.int8_decision(FP32_ROUNDS, rounds(1.30, 1.32, 1.28, 1.31, 1.29), 1.15)
    assert d.pays and d.why == "" and d.ratio == pytest.approx(1.30) and d.spread == pytest.approx(0.04)


def test_int8_within_noise_does_not_pay():
    """The issue's Zen 2 case: 1.04× — inside run-to-run noise, below the margin."""
    d = timing.int8_decision(FP32_ROUNDS, rounds(1.02, 1.05, 1.04, 1.03, 1.06), 1.15)
    assert not d.pays and d.why == "below the margin" and d.ratio == pytest.approx(1.04)


def test_int8_slower_does_not_pay():
    d = timing.int8_decision(FP32_ROUNDS, rounds(0.8, 0.85, 0.9, 0.82, 0.88), 1.15)
    assert not d.pays and d.why == "below the margin" and d.ratio < 1


def test_int8_spread_too_wide_does_not_pay():
    """Median above the margin, but the rounds spread more than margin − 1 and one round is below the margin."""
    d = timing.int8_decision(FP32_ROUNDS, rounds(1.0, 1.2, 1.3, 1.5, 1.1), 1.15)
    assert not d.pays and d.why == "spread too wide" and d.ratio == pytest.approx(1.2)
    assert d.spread == pytest.approx(0.5) and d.rounds == pytest.approx((1.0, 1.2, 1.3, 1.5, 1.1))


def test_int8_far_above_the_margin_pays_when_every_round_clears_it():
    """A 4× engine on a loaded host spreads by whole units between rounds; every round still clears the margin."""
    d = timing.int8_decision(FP32_ROUNDS, rounds(4.2, 3.3, 9.0, 1.9, 6.4), 1.15)
    assert d.pays and d.spread > 0.15
    # the same spread with one round at parity is not confident
    assert timing.int8_decision(FP32_ROUNDS, rounds(4.2, 3.3, 9.0, 1.0, 6.4), 1.15).why == "spread too wide"


def test_int8_decision_on_the_margin_edges():
    assert timing.int8_decision(FP32_ROUNDS, rounds(1.15, 1.15, 1.15, 1.15, 1.15), 1.15).pays     # ≥ margin
    assert timing.int8_decision(FP32_ROUNDS, rounds(1.14, 1.14, 1.14, 1.14, 1.14), 1.15).why == "below the margin"
    # spread just under margin − 1 with a round below the margin: confident by the spread rule
    assert timing.int8_decision(FP32_ROUNDS, rounds(1.10, 1.16, 1.17, 1.18, 1.24), 1.15).pays
    assert not timing.int8_decision(FP32_ROUNDS, rounds(1.09, 1.16, 1.17, 1.18, 1.24), 1.15).pays
    with pytest.raises(ValueError):
        timing.int8_decision(FP32_ROUNDS, rounds(1.2, 1.2), 1.15)


def test_summarize_keeps_each_rounds_p50():
    lat = {1: [np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0])]}
    s = timing.summarize(lat)
    assert s["b1_round_p50_ms"] == [2.0, 5.0] and s["b1_p50_ms"] == 3.5 and s["b1_runs"] == 6


def test_the_gate_marks_not_faster_here_and_fails_nothing(cfg):
    engines = [cfg.engine(n) for n in (FP32, INT8, OV_FP32, OV_INT8)]

    def entry(*p50s):
        return {"b1_p50_ms": float(np.median(p50s)), "b1_round_p50_ms": list(p50s)}

    report = {"engines": {FP32: entry(*FP32_ROUNDS), INT8: entry(*rounds(1.02, 1.05, 1.04, 1.03, 1.06)),
                          OV_FP32: entry(*FP32_ROUNDS), OV_INT8: entry(*rounds(2.0, 2.1, 1.9, 2.05, 2.0))},
              "ratios": {}}
    lines = timing.int8_gate(report, engines, (1,), 1.15, "x86-64-avx2")
    assert report["engines"][INT8]["bench_gate"] == benchgate.NOT_FASTER
    assert report["engines"][OV_INT8]["bench_gate"] == "pass"
    assert "bench_gate" not in report["engines"][FP32]                      # FP32 engines are not gated
    assert len(lines) == 1 and lines[0].startswith(f"{INT8} is 1.04× its FP32 sibling {FP32} at batch 1")
    x = report["int8"][INT8]
    assert x["verdict"] == benchgate.NOT_FASTER and x["host_class"] == "x86-64-avx2" and x["margin"] == 1.15
    assert x["batches"]["1"]["why"] == "below the margin" and len(x["batches"]["1"]["rounds"]) == 5
    assert "spread (max − min) < 0.15" in x["rule"]
    assert report["ratios"][f"{OV_INT8}/{OV_FP32}@b1"] == 2.0


# ---------------------------------------------------------------------------------------------- the leaderboard
def _workspace(root: Path, cfg, gate_of_int8: str) -> None:
    """A bench report (host class x86-64-avx2) where ORT INT8 is the fastest engine, and passing validations."""
    p50 = {FP32: 6.0, INT8: 2.0, OV_FP32: 12.0, OV_INT8: 3.0, "embedder-aoti-cpu-fp32": 40.0}
    engines = {n: {"b1_p50_ms": v, "b8_p50_ms": 8 * v} for n, v in p50.items()}
    engines[INT8]["bench_gate"] = gate_of_int8
    engines[OV_INT8]["bench_gate"] = "pass"
    b = paths.bench("embedder", root)
    b.mkdir(parents=True)
    (b / paths.BENCH_FILE).write_text(json.dumps({"engines": engines, "not_run": {}, "host_class": "x86-64-avx2"}))
    for n in p50:
        v = paths.validation(n, root)
        v.mkdir(parents=True)
        (v / paths.VALIDATION_FILE).write_text(json.dumps({"verdict": "pass", "metrics": {"cosine_min": 0.999}}))


def test_a_not_faster_here_engine_never_wins_the_leaderboard(cfg, tmp_path):
    _workspace(tmp_path / "paid", cfg, "pass")
    _, winners = leaderboard.rows(cfg, tmp_path / "paid")
    assert winners["embedder"] == INT8                                      # it pays: it wins

    _workspace(tmp_path / "here", cfg, benchgate.NOT_FASTER)
    rows, winners = leaderboard.rows(cfg, tmp_path / "here")
    assert winners["embedder"] == OV_INT8                                   # the fastest that pays here
    mine = {r["engine"]: r for r in rows if r["model"] == "embedder"}
    assert not mine[INT8]["best"] and "not faster here (x86-64-avx2)" in mine[INT8]["note"]
    assert mine[OV_INT8]["wins_by"] == 2.0 and mine[OV_INT8]["runner_up"] == "ort-cpu/fp32"
    md = leaderboard.markdown([r for r in rows if r["model"] == "embedder"])
    assert md.startswith("# Who wins, per graph (measured on host class x86-64-avx2")
    assert "not faster here (x86-64-avx2)" in md and "2.00× the next (ort-cpu/fp32)" in md
