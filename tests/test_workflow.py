"""The CI build matrix (.github/workflows/build.yml): valid against GitHub's workflow schema (check-jsonschema's
bundled copy, offline), and consistent with Kiln — one job per hardware family `kiln plan` knows, each family's
profile present, every job building through the shared remote's run cache and pushing what it built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO
from pipeline import plan

WORKFLOW = REPO / ".github/workflows/build.yml"


def lint(path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "check-jsonschema"
    return subprocess.run([str(exe), "--builtin-schema", "vendor.github-workflows", str(path)], capture_output=True,
                          text=True)


def test_the_workflow_is_valid_and_the_linter_can_say_no(tmp_path):
    r = lint(WORKFLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on: ${{ matrix.runs-on }}", "runs_on: x"))
    r = lint(broken)
    assert r.returncode == 1 and "'runs-on' is a required property" in r.stdout, r.stdout


def test_one_job_per_family_each_building_through_the_shared_remote():
    wf = yaml.safe_load(WORKFLOW.read_text())
    matrix = wf["jobs"]["build"]["strategy"]["matrix"]["include"]
    assert {m["family"] for m in matrix} == set(plan.FAMILY.values())
    for m in matrix:
        assert m["profile"] == "" or (REPO / "profiles" / f"{m['profile']}.yaml").is_file(), m
    steps = " ".join(s.get("run", "") for s in wf["jobs"]["build"]["steps"])
    for command in ("kiln plan", "dvc repro --pull --allow-missing", "dvc push --run-cache", "kiln registry sync",
                    "kiln profile"):
        assert command in steps, command
    assert wf["jobs"]["release"]["needs"] == "build"
    assert "kiln release --all-production" in " ".join(s.get("run", "") for s in wf["jobs"]["release"]["steps"])
