"""scripts/setup.sh: where the pinned torch CPU wheel comes from, on our machines and elsewhere."""

from __future__ import annotations

import os
import re
import subprocess

from conftest import REPO


def _source(wheels) -> str:
    return subprocess.run(["bash", str(REPO / "scripts/setup.sh"), "--torch-source"], cwd=REPO, check=True,
                          capture_output=True, text=True, env={**os.environ, "KILN_WHEELS": str(wheels)}).stdout.strip()


def test_local_wheel_folder_when_it_holds_the_wheel(tmp_path):
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert _source(tmp_path) == f"--find-links {tmp_path}"


def test_pytorch_cpu_index_elsewhere(tmp_path):
    assert _source(tmp_path / "absent") == "--extra-index-url https://download.pytorch.org/whl/cpu"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert _source(tmp_path / "other").startswith("--extra-index-url")        # another version does not count


def test_the_lock_pins_that_wheel_by_sha256():
    lock = (REPO / "lockfiles/main.txt").read_text()
    block = re.search(r"(?ms)^torch==2\.13\.0\+cpu \\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n)+)", lock)
    assert block and block.group(1).count("--hash=sha256:") >= 1


def test_the_committed_dvc_files_are_what_the_declarations_render():
    """dvc.yaml, dag/<group>/dvc.yaml and toolchain/dvc.yaml are generated (`kiln dag --write`): the committed ones
    must be current, and a plain `dvc repro` (the root dvc.yaml and everything upstream) must reach every stage."""
    import sys

    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "dag", "--check"], cwd=REPO, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "dvc.yaml files up to date" in r.stdout
    import sys as _sys
    from pathlib import Path

    dvc = Path(_sys.executable).with_name("dvc")
    everything = set(subprocess.run([str(dvc), "stage", "list", "--all", "--name-only"], cwd=REPO,
                                    capture_output=True, text=True, check=True).stdout.split())
    dry = subprocess.run([str(dvc), "repro", "--dry", "--force"], cwd=REPO, capture_output=True, text=True, check=True)
    reached = {line.split("'")[1] for line in dry.stdout.splitlines() if line.startswith("Running stage '")}
    assert reached == everything, sorted(everything - reached)


def test_the_committed_locks_hold_only_stages_of_the_dag():
    """DVC keeps a removed stage's entry in dvc.lock: an auditor would read a stage that no longer exists."""
    import sys
    from pathlib import Path

    import yaml

    dvc = Path(sys.executable).with_name("dvc")
    names = subprocess.run([str(dvc), "stage", "list", "--all", "--name-only"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    from pipeline.dvcfiles import dvc_files

    locks = [f.with_name("dvc.lock") for f in dvc_files(REPO)]
    assert all(lock.is_file() for lock in locks), [str(lock) for lock in locks if not lock.is_file()]
    for lock in locks:
        prefix = "" if lock.parent == REPO else f"{lock.parent.relative_to(REPO).as_posix()}/dvc.yaml:"
        stale = {s for s in yaml.safe_load(lock.read_text())["stages"] if prefix + s not in names}
        assert not stale, f"{lock}: entries of stages not in the DAG: {sorted(stale)}"


def test_what_a_stage_reads_another_host_can_pull():
    """`dvc repro --pull` on a host that lacks a dep fetches it as an output from the shared remote: so every dep
    that another stage writes is a cached output, named by its own path (not a folder holding several). The one
    exception is by design: the toolchain probe's fingerprint files, which every host writes for itself. (The
    build's summary first read the registration receipts: a host pulling with --allow-missing, which has no
    receipts of engines it did not register, could not run it — the build-hosts test caught it.)"""
    from dvc.repo import Repo

    from pipeline.dvcfiles import bare

    with Repo(str(REPO)) as repo:
        stages = list(repo.index.stages)
    outs = {o.def_path: (st.addressing, o.use_cache) for st in stages for o in st.outs}
    probe = {p for p, (writer, _) in outs.items() if bare(writer) == "toolchain"}
    assert probe, "the toolchain probe's outputs are not where this test looks"
    bad = []
    for st in stages:
        for d in st.deps:
            if d.def_path in outs and not outs[d.def_path][1] and d.def_path not in probe:
                bad.append(f"{st.addressing} reads {d.def_path}, an uncached output of {outs[d.def_path][0]}")
            elif d.def_path not in outs and any(o.startswith(d.def_path.rstrip("/") + "/") for o in outs):
                bad.append(f"{st.addressing} reads the folder {d.def_path}, which holds outputs of other stages")
    assert not bad, bad


def test_setup_refuses_an_unknown_profile():
    r = subprocess.run(["bash", "scripts/setup.sh", "--profile", "../lockfiles/main"], cwd=REPO, capture_output=True,
                       text=True)
    assert r.returncode == 2 and "no lockfile lockfiles/../lockfiles/main.txt" in r.stderr
