"""`kiln upgrade-report` (issue 59, part 2): the verdict rules, the limits params.yaml gives them, and the rows logged
to a real MLflow registry where `kiln promote --system` finds them by a part's content digest. The report itself —
a toolchain fingerprint changed in a DAG copy, production downloaded from the copy's registry, both engines run side
by side — is tests/test_dvc_pipeline.py's fingerprint test."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from conftest import REPO, write_params
from kiln_runtime.release import Part
from pipeline import config
from pipeline.config import OutputLimits
from pipeline.errors import KilnError
from pipeline.registry import upgrades
from pipeline.registry.client import Registry
from pipeline.release import upgrade
from pipeline.release.upgrade import BETTER, DIFFERS, SAME, WORSE

FP32 = OutputLimits(1e-3, 0.9999)


def test_toolchain_changes_name_each_entry_that_moved():
    prod = {"numpy": "2.4.6", "target.openvino-cpu": {"openvino": "2026.4.1", "isa": ["avx2"]}}
    cand = {"numpy": "2.4.6", "target.openvino-cpu": {"openvino": "2026.4.0", "isa": ["avx2"]}, "torch": "2.13.0"}
    assert upgrade.toolchain_changes(prod, cand) == ["target.openvino-cpu.openvino: 2026.4.1 → 2026.4.0",
                                                     "torch: (none) → 2.13.0"]
    assert upgrade.toolchain_changes(prod, prod) == []


def test_latency_needs_every_round_beyond_the_margin():
    base = [1.0, 1.0, 1.0, 1.0, 1.0]
    assert upgrade.latency_verdict(base, [1.06, 1.08, 1.07, 1.2, 1.06], 0.05)["verdict"] == WORSE
    one_round_inside = upgrade.latency_verdict(base, [1.06, 1.08, 1.04, 1.2, 1.06], 0.05)
    assert one_round_inside["verdict"] == SAME and one_round_inside["band"] == [1.04, 1.2]
    assert upgrade.latency_verdict(base, [0.9, 0.8, 0.94, 0.9, 0.9], 0.05)["verdict"] == BETTER
    assert upgrade.latency_verdict(base, [0.9, 0.8, 0.96, 0.9, 0.9], 0.05)["verdict"] == SAME
    r = upgrade.latency_verdict([2.0, 4.0, 2.0, 2.0, 2.0], [2.2, 4.4, 2.2, 2.2, 2.2], 0.05)
    assert r["ratio"] == 1.1 and r["rounds"] == [1.1] * 5          # per round: a slow round slows both alike
    with pytest.raises(ValueError):
        upgrade.latency_verdict(base, base[:3], 0.05)


def test_the_verdict_puts_outputs_before_latency():
    lat = {1: {"verdict": WORSE, "ratio": 1.2}, 8: {"verdict": SAME, "ratio": 1.0}}
    same = {1: {"verdict": SAME, "ratio": 1.01}}
    assert upgrade.verdict(FP32, 0.05, True, 0.5, 0.2, ["x"], lat) == (SAME, ["identical files"])
    v, why = upgrade.verdict(FP32, 0.05, False, 2e-3, 0.99999, [], lat)
    assert v == DIFFERS and why == ["max |Δ| 0.002 of the output range > 0.001"]        # slower too, but differs
    v, why = upgrade.verdict(FP32, 0.05, False, 0.0, 0.999, ["decision_agreement 0.98 < 1"], same)
    assert v == DIFFERS and why == ["cosine min 0.999000 < 0.9999", "gate: decision_agreement 0.98 < 1"]
    assert upgrade.verdict(FP32, 0.05, False, math.nan, 1.0, [], same)[0] == DIFFERS     # NaN never passes
    v, why = upgrade.verdict(FP32, 0.05, False, 1e-6, 1.0, [], lat)
    assert v == WORSE and why == ["slower in every round by more than 5%: b1 1.200×"]
    assert upgrade.verdict(FP32, 0.05, False, 1e-6, 1.0, [], {1: {"verdict": BETTER, "ratio": 0.8}})[0] == BETTER
    assert upgrade.verdict(FP32, 0.05, False, 1e-6, 1.0, [], same)[0] == SAME


def test_limits_come_from_params_per_precision(cfg, tmp_path):
    assert cfg.upgrade.limits("int8") == OutputLimits(0.1, 0.998)
    assert cfg.upgrade.limits("fp16") == cfg.upgrade.limits("fp32") == OutputLimits(0.001, 0.9999)
    with pytest.raises(KilnError) as e:
        config.load(write_params(tmp_path, lambda raw: raw["upgrade"]["precisions"]["fp32"].update(cosine_min=1.5)))
    assert "upgrade.precisions.fp32.cosine_min" in e.value.message
    with pytest.raises(KilnError) as e:
        config.load(write_params(tmp_path, lambda raw: raw["upgrade"]["precisions"].update(int4={})))
    assert "upgrade.precisions" in e.value.message


def _row(engine: str, sha: str, production: int) -> upgrade.Row:
    return upgrade.Row(engine, f"kiln-{engine}", production, "local build", sha, "x" * 32, "p" * 64,
                       ["target.ort-cpu.onnxruntime: 1.32.0 → 1.33.0"], [], verdict=SAME, why=["identical files"],
                       identical=True, latency={1: {"ratio": 1.0, "verdict": SAME, "band": [0.98, 1.02],
                                                    "rounds": [1.0] * 5}})


def test_a_logged_row_is_found_for_the_part_that_ships_that_build(cfg, registry_env):
    """By the part's content digest and the production version the report compared with; not for the version
    production already runs, nor once production is another version than the one compared."""
    reg = Registry(cfg)
    assert upgrades.found(reg, [], {}) == {}                       # no report ever: no experiment, nothing found
    rid = upgrades.log(reg, _row("pnet-ort-cpu-fp32", "a" * 64, 1), "x86-64-avx2")
    upgrades.log(reg, _row("onet-ort-cpu-fp32", "b" * 64, 1), "x86-64-avx2")
    pnet = Part("pnet", "pnet-ort-cpu-fp32", "kiln-pnet-ort-cpu-fp32", 2, "x" * 32, "a" * 64, "x" * 32)
    got = upgrades.found(reg, [pnet], {"kiln-pnet-ort-cpu-fp32": 1})
    assert list(got) == ["kiln-pnet-ort-cpu-fp32"] and got["kiln-pnet-ort-cpu-fp32"]["run"] == rid
    assert got["kiln-pnet-ort-cpu-fp32"]["summary"] == "pnet-ort-cpu-fp32: same against production v1 (identical " \
                                                      "files)"
    assert upgrades.found(reg, [pnet], {"kiln-pnet-ort-cpu-fp32": 2}) == {}       # production runs it already
    assert upgrades.found(reg, [pnet], {"kiln-pnet-ort-cpu-fp32": 3}) == {}       # compared with another version
    other = Part("pnet", "pnet-ort-cpu-fp32", "kiln-pnet-ort-cpu-fp32", 2, "x" * 32, "c" * 64, "x" * 32)
    assert upgrades.found(reg, [other], {"kiln-pnet-ort-cpu-fp32": 1}) == {}      # another build
    rec = upgrades.record(got)
    assert rec == {"kiln.upgrade.kiln-pnet-ort-cpu-fp32": f"{got['kiln-pnet-ort-cpu-fp32']['summary']} (run {rid})"}
    assert upgrades.lines(got) == [f"upgrade report: {got['kiln-pnet-ort-cpu-fp32']['summary']}"]
    params = reg.client.get_run(rid).data.params
    assert params["kiln.upgrade.verdict"] == SAME and params["kiln.upgrade.production_version"] == "1"


def test_an_unknown_engine_is_one_line_before_the_registry_is_asked(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "upgrade-report", "no-such-engine"], cwd=REPO,
                       capture_output=True, text=True, env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/no.db",
                                                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("kiln: error: ") and "no engine named 'no-such-engine'" in r.stderr, r.stderr
    assert not (tmp_path / "no.db").exists()
