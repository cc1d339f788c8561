"""What the CLI-level reliability suites share (tests/test_reliability*.py): run the real CLI in a fresh process
and assert what a user sees — the documented exit code, one `kiln:` line plus a hint, no traceback, nothing
half-written. The scratch project they run in is the session fixture `project` (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.manifest import verify_manifest

ENGINE, AOTI = "embedder-ort-cpu-fp32", "embedder-aoti-cpu-fp32"
PY = sys.executable


def _env(extra: dict | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PYTHONPATH=str(REPO), KILN_ACTOR="tester", **(extra or {}))
    return env


def kiln(root: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "pipeline.cli", *args], cwd=root, env=_env(env), capture_output=True,
                          text=True, timeout=timeout)


def spawn(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "pipeline.cli", *args], cwd=root, env=_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def clean_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """The documented exit code, one `kiln:` line (plus at most a hint), no traceback, the words expected."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("WARNING", "  warnings.warn"))]
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    kiln_lines = [ln for ln in lines if ln.startswith("kiln: ")]
    assert len(kiln_lines) == 1 and lines[-1].startswith(("hint: ", "kiln: ")), r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def whole_or_absent(d: Path) -> None:
    """Nothing half-written: the output is absent, or every file matches its manifest."""
    if d.exists():
        manifests = list(d.glob("*.manifest.json"))
        assert manifests and not verify_manifest(manifests[0]), (d, list(d.iterdir()))


def kill_after(root: Path, seconds: float, *args: str, env: dict | None = None) -> None:
    """Start a command, SIGKILL it (and its children) after `seconds`: a crash, not a clean stop. A run that ends
    sooner (a noisy machine) is tried again with half the delay."""
    for delay in (seconds, seconds / 2, seconds / 4):
        p = spawn(root, *args, env=env)
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return
    pytest.fail(f"{args} always finished before it could be killed")


def versions(db: Path | str, name: str) -> list[int]:
    from mlflow import MlflowClient

    uri = db if isinstance(db, str) else f"sqlite:///{db}"
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return sorted(int(v.version) for v in c.search_model_versions(f"name = '{name}'"))
