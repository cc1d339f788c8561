"""What the CLI-level reliability suites share (tests/test_reliability*.py): run the real CLI in a fresh process
and assert what a user sees — the documented exit code, one `kiln:` line plus a hint, no traceback, nothing
half-written. The scratch project they run in is the session fixture `project` (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

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
                          text=True, timeout=timeout, encoding="utf-8", errors="replace")


def spawn(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "pipeline.cli", *args], cwd=root, env=_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, encoding="utf-8",
                            errors="replace")


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


def _began(p: subprocess.Popen, armed: Callable[[], bool], limit_s: float = 600) -> bool:
    """Poll until `armed()` holds (True) or the process ended (False)."""
    t_end = time.monotonic() + limit_s
    while not armed():
        if p.poll() is not None:
            return False
        if time.monotonic() > t_end:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"{p.args}: the awaited phase did not begin within {limit_s:.0f} s")
        time.sleep(0.002)
    return True


def kill_after(root: Path, seconds: float, *args: str, env: dict | None = None,
               armed: Callable[[], bool] | None = None, landed: Callable[[], bool] | None = None,
               reset: Callable[[], None] | None = None) -> None:
    """Start a command, SIGKILL it (and its children) after `seconds`: a crash, not a clean stop. A run that ends
    sooner (a noisy machine) is tried again with half the delay.

    To kill inside one phase of the run: the clock starts when `armed()` first holds (the phase has begun, e.g. its
    temporary file appeared) instead of at the start, and `landed()`, asked after the kill, says whether the kill
    hit that phase; a kill that missed it is tried again like a run that ended sooner, after `reset()`."""
    for delay in (seconds, seconds / 2, seconds / 4):
        if reset is not None:
            reset()
        p = spawn(root, *args, env=env)
        if armed is not None and not _began(p, armed):
            continue                    # ended before the phase was seen
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            if landed is None or landed():
                return
    pytest.fail(f"{args} always finished before it could be killed" + (" in the phase" if armed else ""))


def versions(db: Path | str, name: str) -> list[int]:
    from mlflow import MlflowClient

    uri = db if isinstance(db, str) else f"sqlite:///{db}"
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return sorted(int(v.version) for v in c.search_model_versions(f"name = '{name}'"))
