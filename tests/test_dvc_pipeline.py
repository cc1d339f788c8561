"""The real DAG through real DVC, in a fresh copy of the working tree: builds, then a second repro reruns nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def _copy_worktree(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    (dest / "dvc.lock").unlink(missing_ok=True)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "snapshot"]):
        subprocess.run(cmd, cwd=dest, check=True)
    return dest


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(root)}
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=root, env=env,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return _copy_worktree(tmp_path_factory.mktemp("clone"))


@pytest.mark.slow
def test_repro_builds_then_reruns_nothing(repo):
    first = dvc(repo, "repro")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for rel in ("artifacts/assets/assets.manifest.json", "artifacts/export/embedder/model.onnx",
                "artifacts/golden/embedder/embeddings.npy", "artifacts/export/embedder/embedder.manifest.json"):
        assert (repo / rel).is_file(), rel
    second = dvc(repo, "repro")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Running stage" not in second.stdout, second.stdout
    verify = subprocess.run([str(Path(sys.executable).parent / "kiln"), "verify", "artifacts"], cwd=repo,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    assert verify.returncode == 0, verify.stdout
