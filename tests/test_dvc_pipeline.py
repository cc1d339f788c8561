"""The real DAG through real DVC, in a fresh copy of the working tree: builds, then a second repro reruns nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def _small_galleries(params: Path) -> None:
    """Only the 10k gallery in the copy: 100k and 1M cost minutes (issue 5; bench/matching.py measures them)."""
    text, n = re.subn(r"(?m)^(  gallery_sizes:)\s*\[[^\]]*\]", r"\1 [10000]", params.read_text())
    assert n == 1, "params.yaml: matching.gallery_sizes not found as a one-line list"
    params.write_text(text)


def _copy_worktree(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    (dest / "dvc.lock").unlink(missing_ok=True)
    _small_galleries(dest / "params.yaml")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "snapshot"]):
        subprocess.run(cmd, cwd=dest, check=True)
    return dest


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the clone's own SQLite registry
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(root))
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=root, env=env,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return _copy_worktree(tmp_path_factory.mktemp("clone"))


ALWAYS = ("toolchain@", "register@", "register-index@")  # always_changed: the fingerprint is re-probed, registration re-checked


def ran(out: str) -> set[str]:
    return {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")}


@pytest.mark.slow
def test_repro_builds_then_reruns_nothing(repo):
    first = dvc(repo, "repro")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for rel in ("artifacts/assets/assets.manifest.json", "artifacts/export/embedder/model.onnx",
                "artifacts/golden/embedder/embeddings.npy", "artifacts/export/embedder/embedder.manifest.json",
                "artifacts/engines/embedder-ort-cpu-int8/model.onnx", "artifacts/bench/embedder/bench.json",
                "artifacts/registry/embedder-ort-cpu-int8.json", "artifacts/registry/embedder-ort-cpu-fp32.json",
                "artifacts/index/gallery-10000/index.faiss", "artifacts/matching/gallery-10000.curve.json",
                "artifacts/registry/gallery-10000.json"):
        assert (repo / rel).is_file(), rel
    receipts = {p.name: p.read_text() for p in (repo / "artifacts/registry").iterdir()}
    second = dvc(repo, "repro")
    assert second.returncode == 0, second.stderr[-3000:]
    assert {s for s in ran(second.stdout) if not s.startswith(ALWAYS)} == set(), second.stdout
    assert {p.name: p.read_text() for p in (repo / "artifacts/registry").iterdir()} == receipts, "re-registered"
    verify = subprocess.run([str(Path(sys.executable).parent / "kiln"), "verify", "artifacts"], cwd=repo,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    assert verify.returncode == 0, verify.stdout


@pytest.mark.slow
def test_fingerprint_change_rebuilds_only_that_targets_engines(repo):
    """A new runtime version in the fingerprint invalidates compile for that target only: not the other target's
    engines, and nothing upstream."""
    fp = repo / "artifacts/toolchain/ort-cpu.yaml"
    original = fp.read_text()
    fp.write_text(original.replace("onnxruntime: 1.", "onnxruntime: 0."))
    try:
        status = dvc(repo, "status", "--json")
        stale = {k for k in json.loads(status.stdout or "{}") if not k.startswith(ALWAYS)}
        assert {"compile@embedder-ort-cpu-fp32", "compile@embedder-ort-cpu-int8"} <= stale, stale
        compiles = {s for s in stale if s.startswith("compile@")}
        assert compiles and all("-ort-cpu-" in s for s in compiles), compiles  # aoti-cpu engines stay built
        assert not {s for s in stale if s.split("@")[0] in ("assets", "dataset", "golden", "export", "calibrate",
                                                               "quantize")}, stale
    finally:
        fp.write_text(original)


@pytest.mark.slow
def test_failing_gate_stops_the_dag(repo):
    params = repo / "params.yaml"
    original = params.read_text()
    params.write_text(original.replace("l2_max: 0.12", "l2_max: 0.0"))
    try:
        r = dvc(repo, "repro")
        assert r.returncode != 0
        stages = ran(r.stdout)
        assert any(s.startswith("validate@") for s in stages), r.stdout
        assert not any(s.startswith(("bench@", "register@")) for s in stages), r.stdout
        assert "gate failed" in r.stderr + r.stdout
        verdicts = [json.loads(p.read_text())["verdict"] for p in (repo / "artifacts/validation").rglob("validation.json")]
        assert "fail" in verdicts
    finally:
        params.write_text(original)
