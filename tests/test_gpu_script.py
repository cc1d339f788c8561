"""scripts/gpu_aoti_cuda.py: what can be checked without a GPU (the CUDA run itself needs the lent machine)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pipeline import paths
from pipeline.assets import DLIB_DAT
from conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_aoti_cuda", REPO / "scripts" / "gpu_aoti_cuda.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def _args(root, out):
    return ["--dat", str(root / "artifacts/assets" / DLIB_DAT), "--golden",
            str(paths.golden("embedder", root) / "embeddings.npy"), "--set", str(paths.data_set("golden", root)),
            "--out", str(out)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal; this host has CUDA")
def test_without_cuda_it_says_so_and_builds_nothing(built, tmp_path, capsys):
    assert script.main(_args(built, tmp_path / "out")) == 3
    assert capsys.readouterr().out.startswith("aoti-cuda: unavailable (")
    assert not (tmp_path / "out").exists()


def test_missing_inputs_are_named(tmp_path, capsys):
    assert script.main(["--dat", str(tmp_path / "x.dat"), "--golden", "g.npy", "--set", str(tmp_path),
                        "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert "x.dat not found" in capsys.readouterr().out


def test_the_gate_is_the_validate_stages_own_limits(cfg):
    """The script applies params.yaml `validate:` through the same function as validate@ (no private copy)."""
    import yaml

    limits = yaml.safe_load((REPO / "params.yaml").read_text())["validate"]
    m = {"cosine_min": 0.99, "cosine_mean": 0.9995, "l2_max": 0.01, "top1_agreement": 1.0,
         "decision_agreement": 1.0, "tar_delta": 0.0, "far_delta": 0.0}
    assert script.facemetrics.gate(m, limits) == [f"cosine_min 0.99 (limit >= {cfg.validate.cosine_min:g})"]
    from pipeline.gates import evaluate

    assert evaluate.gate(m, cfg.validate) == script.facemetrics.gate(m, limits)


def test_report_format():
    m = {"cosine_min": 0.99, "l2_max": 0.01, "top1_agreement": 1.0, "decision_agreement": 1.0}
    report = {"date": "2026-11-30", "device": {"device": "cuda", "gpu": "H200", "compute_capability": "9.0",
                                                "driver": "580", "torch": "2.13", "cuda": "13.0"},
              "latency": {"aoti": {"b1": {"p50_ms": 1, "p99_ms": 2}, "b8": {"p50_ms": 3, "p99_ms": 4}}},
              "metrics": {**m, "cosine_min": 0.9999}, "verdict": "pass", "compile_s": 20, "package_mb": 24.5}
    md = script.markdown(report)
    assert "H200 (cc 9.0, driver 580)" in md
    assert ["aoti", "1", "2", "3", "4"] in [[c.strip() for c in ln.strip("|").split("|")] for ln in md.splitlines()]


@pytest.mark.slow
def test_same_flow_on_cpu_builds_validates_and_times(built, tmp_path):
    """`--device cpu` runs every step the GPU run does (export, AOTInductor package, load, gate, timing)."""
    assert script.main(_args(built, tmp_path / "out") + ["--device", "cpu", "--runs", "5"]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "golden gate: pass" in md and (tmp_path / "out" / "embedder-aoti-cpu.pt2").is_file()
