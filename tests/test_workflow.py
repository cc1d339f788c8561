"""The CI build matrix (.github/workflows/build.yml calling build-family.yml): valid against GitHub's workflow schema
(check-jsonschema's bundled copy, offline), and consistent with Kiln — one job per hardware family `kiln plan`
knows, each family's profile present, every job building through the shared remote's run cache and pushing what it
built, the accelerator families after cpu-x86 (which builds what they share), the release after all of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO
from pipeline.dagtools import plan

WORKFLOW = REPO / ".github/workflows/build.yml"
FAMILY_JOB = REPO / ".github/workflows/build-family.yml"


def lint(path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "check-jsonschema"
    return subprocess.run([str(exe), "--builtin-schema", "vendor.github-workflows", str(path)], capture_output=True,
                          text=True)


def test_the_workflow_is_valid_and_the_linter_can_say_no(tmp_path):
    for wf in (WORKFLOW, FAMILY_JOB):
        r = lint(wf)
        assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(FAMILY_JOB.read_text().replace("runs-on: ${{ fromJSON(inputs.runs-on) }}", "runs_on: x"))
    r = lint(broken)
    assert r.returncode == 1 and "'runs-on' is a required property" in r.stdout, r.stdout


def test_one_job_per_family_each_building_through_the_shared_remote():
    wf = yaml.safe_load(WORKFLOW.read_text())
    jobs = wf["jobs"]
    matrix = jobs["accelerators"]["strategy"]["matrix"]["include"]
    families = {"cpu-x86": ""} | {m["family"]: m["profile"] for m in matrix}
    assert set(families) == set(plan.FAMILY.values())
    for profile in families.values():
        assert profile == "" or (REPO / "profiles" / f"{profile}.yaml").is_file(), profile
    assert jobs["cpu-x86"]["uses"] == jobs["accelerators"]["uses"] == "./.github/workflows/build-family.yml"
    assert jobs["accelerators"]["needs"] == "cpu-x86"            # restores what cpu-x86 built, builds its own
    assert set(jobs["release"]["needs"]) == {"cpu-x86", "accelerators"}
    family_job = yaml.safe_load(FAMILY_JOB.read_text())["jobs"]["build"]
    steps = " ".join(s.get("run", "") for s in family_job["steps"])
    for command in ("kiln plan", "dvc pull --allow-missing", "dvc repro --pull --allow-missing",
                    "dvc push --run-cache", "kiln registry sync", "kiln profile"):
        assert command in steps, command
    release = " ".join(s.get("run", "") for s in jobs["release"]["steps"])
    assert "kiln release --all-production" in release and "|| true" not in release
