"""Several build hosts on loopback: one OpenSSH DVC remote, one `mlflow server` on PostgreSQL, four checkouts.

Host A is a copy of the default DAG that the session fixture `built_dag` (tests/conftest.py) builds once per run:
its own copy (`hosts`), so this file runs on one xdist worker while tests/test_dvc_pipeline.py's tests change theirs
on the other, and neither file imports the other."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TOOLCHAIN, dvc, kiln, ran, restored
from pipeline.dvcfiles import address, dvc_files


@pytest.fixture(scope="module")
def repo(built_dag) -> Path:
    return built_dag["hosts"]


# Host B builds the detector engines of profiles/rtx.yaml: its embedder engines would rerun the embedder's bench
# too — the same flow, minutes more of CI (tests/targets/test_tensorrt_rtx.py builds and checks all five).
RTX_ENGINES = ("rnet-tensorrt-rtx-fp16", "onet-tensorrt-rtx-fp16")
OVER_ALL_ENGINES = {"fallback-table", "leaderboard", "summary"}        # reports over every engine of the params


@pytest.mark.slow
def test_build_hosts_share_one_remote_and_one_registry(repo, tmp_path, postgres_server):
    """The team setup on loopback: a real OpenSSH server as the shared DVC remote (scripts/remote-server.sh) and a
    real `mlflow server` on PostgreSQL as the shared registry (scripts/registry-server.sh).

    A (cpu-x86: the built copy) pushes its cache and run cache and syncs its engines into the registry.
    B (rtx: `kiln profile rtx`, its two detector engines) starts from A's dvc.lock with an empty cache; after one
      `dvc pull --allow-missing`, `dvc repro --pull --allow-missing` runs only its own target's stages — plus the
      benches of the models that gained an engine and the reports over all engines — and registers its engines as
      `built` (promotion refuses them); it pushes.
    C (release) pulls what both pushed, verifies every artifact, syncs (nothing new: nothing registered twice),
      promotes A's INT8 engine, and `dvc repro` runs nothing.
    D (no dvc.lock at all) gets the INT8 engine by `dvc repro --pull`: restored from the shared run cache."""
    server = tmp_path / "remote"
    r = subprocess.run(["bash", str(REPO / "scripts/remote-server.sh"), "start", str(server)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    home = tmp_path / "home"                    # the hosts' ~/.ssh/known_hosts holds the server's host key
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(server / "known_hosts", home / ".ssh" / "known_hosts")
    env = {"HOME": str(home), "MLFLOW_TRACKING_URI": postgres_server}
    setup = [line.split() for line in r.stdout.splitlines() if line.startswith("dvc ")]

    def connect(root: Path) -> None:
        for cmd in setup:
            assert dvc(root, *cmd[1:], env=env).returncode == 0, cmd

    def host(name: str, lock_from: Path | None) -> Path:
        h = tmp_path / f"host-{name}"
        subprocess.run(["git", "clone", "-q", str(repo), str(h)], check=True)
        if lock_from is not None:               # that host's working state: params, derived DAG, locks
            derived(lock_from, h, locks=True)
        connect(h)
        return h

    def derived(src: Path, dst: Path, locks: bool) -> None:
        for f in dvc_files(dst):
            f.unlink()
        for f in [src / "params.yaml", *dvc_files(src)] + ([f.with_name("dvc.lock") for f in dvc_files(src)]
                                                           if locks else []):
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dst / f.relative_to(src))

    def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    config = (repo / ".dvc/config").read_bytes()
    counts = {}
    clock = [time.monotonic()]

    def took() -> str:                          # each host's seconds, printed: where this test's minutes go
        clock.append(time.monotonic())
        return f" in {clock[-1] - clock[-2]:.0f} s"
    try:
        # ---- host A: cpu-x86
        connect(repo)
        engines = yaml.safe_load((repo / "params.yaml").read_text())["engines"]
        before = ok(kiln(repo, "plan", env=env))
        assert before.stdout.count("| not pushed ") == len(engines), before.stdout
        ok(dvc(repo, "push", "--run-cache", env=env))
        after = ok(kiln(repo, "plan", env=env))
        assert f"cpu-x86: 0 to build, {len(engines)} in the remote" in after.stdout, after.stdout
        sync = ok(kiln(repo, "registry", "sync", env=env))
        assert sync.stdout.count("registered new version") == len(engines) + 1, sync.stdout  # + 1 gallery index
        counts["A"] = f"pushed {len(engines)} engines, registered {len(engines) + 1} versions" + took()

        # ---- host B: rtx, from A's lock and an empty cache
        b = host("B", repo)
        ok(kiln(b, "profile", "rtx"))
        p = yaml.safe_load((b / "params.yaml").read_text())
        p["engines"] = {k: v for k, v in p["engines"].items() if v["target"] != "tensorrt-rtx" or k in RTX_ENGINES}
        (b / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
        ok(kiln(b, "dag", "--write"))
        plan_b = ok(kiln(b, "plan", env=env))
        assert f"rtx: {len(RTX_ENGINES)} to build" in plan_b.stdout, plan_b.stdout
        assert f"cpu-x86: 0 to build, {len(engines)} in the remote" in plan_b.stdout, plan_b.stdout
        ok(dvc(b, "pull", "--allow-missing", env=env))       # in one go: repro --pull pulls dep by dep (minutes)
        first = ok(dvc(b, "repro", "--pull", "--allow-missing", env=env))
        ran_b = ran(first.stdout) - {TOOLCHAIN}
        own = {f"{g}@{e}" for g in ("compile", "validate", "register") for e in RTX_ENGINES}
        benches = {f"bench@{m}" for m in {e.split("-")[0] for e in RTX_ENGINES}}
        assert own <= ran_b, sorted(own - ran_b)
        assert ran_b <= own | benches | OVER_ALL_ENGINES, sorted(ran_b - own - benches - OVER_ALL_ENGINES)
        counts["B"] = (f"ran {len(ran_b)} stages: {len(own)} of its own target, {len(ran_b - own)} benches/reports"
                       + took())
        for e in RTX_ENGINES:
            checked = json.loads((b / f"artifacts/engines/{e}/{e}.manifest.json").read_text())["build"]
            assert checked["reproducibility"]["checked"].endswith(("bit-identical", "(the builder orders a "
                                                                   "multi-output network's bindings differently "
                                                                   "between builds)")), checked
        for e in RTX_ENGINES:
            assert json.loads((b / f"artifacts/validation/{e}/validation.json").read_text())["verdict"] == "not-run"
            assert json.loads((b / f"artifacts/registry/{e}/receipt.json").read_text())["verdict"] == "not-run"
        assert "built only" in (b / "artifacts/reports/fallback.md").read_text()
        refused = kiln(b, "promote", "rnet-tensorrt-rtx-fp16", "1", env=env)
        assert refused.returncode == 1 and "no host with the runtime has validated it" in refused.stderr
        again = ok(dvc(b, "repro", "--allow-missing", env=env))
        assert ran(again.stdout) == {TOOLCHAIN}, again.stdout
        ok(dvc(b, "push", "--run-cache", env=env))

        # ---- host C: release, with B's lock (A's engines + B's)
        c = host("C", b)
        ok(dvc(c, "pull", env=env))
        verify = ok(kiln(c, "verify", "artifacts"))
        assert "engines" in verify.stdout and "validation" in verify.stdout, verify.stdout
        for e in (*engines, *RTX_ENGINES):
            assert (c / f"artifacts/engines/{e}/{e}.manifest.json").is_file(), e
        resync = ok(kiln(c, "registry", "sync", env=env))
        assert "registered new version" not in resync.stdout, resync.stdout
        assert resync.stdout.count("already registered as") == len(engines) + len(RTX_ENGINES) + 1, resync.stdout
        ok(kiln(c, "promote", "kiln-embedder-ort-cpu-int8", "1", env=env))
        idle = ok(dvc(c, "repro", "--allow-missing", env=env))
        assert ran(idle.stdout) == {TOOLCHAIN}, idle.stdout
        counts["C"] = (f"pulled {len(engines) + len(RTX_ENGINES)} engines, registered 0, ran "
                       f"{len(ran(idle.stdout)) - 1}" + took())

        # ---- host D: no lock at all, one engine wanted
        d = host("D", None)
        derived(repo, d, locks=False)
        got = ok(dvc(d, "repro", "--pull", address("compile@embedder-ort-cpu-int8"), env=env))
        from_cache = restored(got.stdout)
        assert ran(got.stdout) == {TOOLCHAIN}, got.stdout
        assert {"assets", "export@embedder", "calibrate@embedder", "quantize@embedder-ort",
                "compile@embedder-ort-cpu-int8"} <= from_cache, got.stdout
        engine = "artifacts/engines/embedder-ort-cpu-int8/model.onnx"
        assert (d / engine).read_bytes() == (repo / engine).read_bytes()
        fresh = ok(kiln(d, "plan", env=env))    # D's lock holds only what it restored: the rest is to build
        assert fresh.stdout.count("| to build ") == len(engines) - 1, fresh.stdout
        assert re.search(r"\| embedder-ort-cpu-int8 +\| ort-cpu +\| yes +\| in remote", fresh.stdout), fresh.stdout
        counts["D"] = f"ran 0 stages, restored {len(from_cache)} from the run cache" + took()
        print("\n" + "\n".join(f"host {h}: {what}" for h, what in counts.items()))
    finally:                                    # the copy's DVC config as it was: later tests run dvc there
        (repo / ".dvc/config").write_bytes(config)
        (repo / ".dvc/config.local").unlink(missing_ok=True)
        subprocess.run(["bash", str(REPO / "scripts/remote-server.sh"), "stop", str(server)], capture_output=True)
