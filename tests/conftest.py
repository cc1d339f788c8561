"""Shared fixtures: the real pinned assets (fetched once, sha256-verified) and a built workspace."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import config
from pipeline.manifest import verify_manifest

REPO = Path(__file__).resolve().parents[1]

# Test files in this order, each on one xdist worker (scripts/test.sh: `--dist loadfile --no-loadscope-reorder`; a
# worker takes the next file when two tests of its current one are left). First the default DAG build (the longest
# chain: it, then the tests on it, on one worker). Then, on the other worker, the files that take minutes, longest
# first, so that both workers end on files of seconds instead of one worker idling while the other runs a long file
# last; the build-hosts test, which waits for the DAG build, fourth: by then (≈ 13-17 min in) the build is done or
# nearly (third, it waited 87 s for it). Minutes measured with pytest's --durations on a 2-core EPYC
# (x86-64-avx512-vnni).
FIRST = "test_dvc_pipeline.py"
LONG = ("test_reliability.py",            # ≈ 6-9 min
        "test_tvm.py",                    # 4-8 min (MetaSchedule's search)
        "test_system_release.py",         # ≈ 4-5 min (releases served: the service, channels, live galleries)
        "test_systems.py",                # ≈ 2 min
        "test_build_hosts.py",            # ≈ 3.5 min, after the DAG build
        "test_executorch.py", "test_xla.py", "test_reliability_registry.py", "test_litert.py")     # 1-2 min each

# Two tiers. `bash scripts/test.sh` runs everything (CI); `bash scripts/test.sh --fast` runs `-m "not slow"`: unit and
# contract tests and the small DAG of the session fixture `built` (sets, golden, export: seconds). A test is slow
# when it asks, directly or through another fixture, for a fixture that builds more real artifacts than that — the
# default DAG in a copy, the reliability project, a registry server or an opt-in target's engines: those fixtures
# are listed here, by the file that defines them, and their tests are marked `slow` at collection. A test that
# builds as much in its own body (an AOTInductor compile, say) carries `@pytest.mark.slow` itself.
SLOW_FIXTURES = {
    "conftest": {"built_dag", "project", "mlflow_server", "postgres_server"},
    "test_dvc_pipeline": {"profiled"},
    "test_reliability": {"server"},
    "test_executorch": {"built_et"},
    "test_litert": {"built_lt"},
    "test_tvm": {"built_tvm"},
    "test_xla": {"built_xla"},
    "test_tensorrt_rtx": {"rtx"},
}


def builds_real_artifacts(item) -> set[str]:
    """The slow fixtures `item` uses (fixtures of its own module or of this conftest), directly or transitively."""
    names = set(getattr(item, "fixturenames", ()))
    return names & (SLOW_FIXTURES["conftest"] | SLOW_FIXTURES.get(item.path.stem, set()))


@pytest.hookimpl(tryfirst=True)          # before `-m "not slow"` deselects by the marks set here
def pytest_collection_modifyitems(items):
    for item in items:
        if builds_real_artifacts(item):
            item.add_marker(pytest.mark.slow)
    rank = {FIRST: 0, **{name: 1 + i for i, name in enumerate(LONG)}}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG) + 1))      # stable: file order kept within


# ------------------------------------------------------------------------ opt-in targets (profiles/*.yaml)
def profile_cfg(tmp: Path, cfg, profile: str, extra_engines: dict | None = None, overrides: dict | None = None):
    """params.yaml with profiles/<profile>.yaml merged (then `overrides`, and `extra_engines` added), loaded and
    checked against the target registry: the configuration an opt-in target's tests build with."""
    import yaml

    from pipeline import targets
    from pipeline.dagtools import profiles

    raw = profiles.merged(profiles.merged(cfg.raw, profiles.load(profile, REPO)), overrides or {})
    raw["engines"].update(extra_engines or {})
    p = tmp / "params.yaml"
    p.write_text(yaml.safe_dump(raw), encoding="utf-8")
    loaded = config.load(p)
    targets.check(loaded)
    return loaded


def bench_beside_ort(pcfg, root: Path, engines: tuple[str, ...], tmp: Path) -> dict:
    """`engines` and the embedder's ORT FP32 engine timed side by side by one bench@embedder run in this process
    (short settings): the report. Every engine must really have been timed (`assert_timed_beside_ort`); the
    speed itself is printed, never compared with a number."""
    import yaml

    from pipeline import paths
    from pipeline.gates import timing
    from pipeline.stages import compile as compile_stage

    raw = yaml.safe_load(pcfg.source.read_text(encoding="utf-8"))
    raw["engines"] = {n: e for n, e in raw["engines"].items() if n in (*engines, ORT_FP32)}
    raw["bench"].update(min_seconds=0.3, min_runs=10, warmup=3)
    raw["systems"] = {}
    p = tmp / "bench-params.yaml"
    p.write_text(yaml.safe_dump(raw), encoding="utf-8")
    bcfg = config.load(p)
    if not paths.engine(ORT_FP32, root).is_dir():
        compile_stage.run(bcfg, ORT_FP32, root, check=False)
    report = timing.measure_model(bcfg, "embedder", root, progress=lambda _: None).report
    assert_timed_beside_ort(report, engines, bcfg.bench)
    return report


# No CPU engine of the embedder comes near this many times faster than ORT FP32 in the same run (the fastest seen:
# OpenVINO INT8, ≈ 3.7×; untuned TVM is ≈ 100× slower): a timing that fast measured a call that did no inference.
MAX_X_ORT = 20


def assert_timed_beside_ort(report: dict, engines: tuple[str, ...], bench) -> None:
    """What a bench report must show for each of `engines` and ORT FP32 whatever the host's speed: every engine
    timed (none skipped as not runnable), at every batch, at least `min_runs` times; ordered percentiles; a cold
    start of a fresh process; batch 8 slower than batch 1 and no engine implausibly faster than ORT FP32 — a call
    that returns without inferring passes `p50 > 0`, not these."""
    assert not set(report["not_run"]) & {*engines, ORT_FP32}, report["not_run"]
    rep, batches = report["engines"], tuple(bench.batches)
    assert 1 in batches and 8 in batches, batches
    for name in (*engines, ORT_FP32):
        m = rep[name]
        for b in batches:
            assert m[f"b{b}_runs"] >= bench.min_runs, (name, b, m)
            assert 0 < m[f"b{b}_p50_ms"] <= m[f"b{b}_p95_ms"] <= m[f"b{b}_p99_ms"], (name, b, m)
        assert m["b8_p50_ms"] > m["b1_p50_ms"], (name, "batch 8 took no longer than batch 1: nothing ran?", m)
        assert m["b1_p50_ms"] * MAX_X_ORT > rep[ORT_FP32]["b1_p50_ms"], (name, m, rep[ORT_FP32])
        assert m["cold_start_ms"] > 50, (name, "a fresh interpreter and a runtime load take longer", m)


def versus_ort(report: dict, engines: tuple[str, ...]) -> str:
    """One line: each engine's batch-1 p50, its ratio to ORT FP32 in the same run, and its cold start."""
    rep = report["engines"]
    ort = rep[ORT_FP32]["b1_p50_ms"]
    return "\n" + "  ".join(f"{n.removeprefix('embedder-')}: b1 {rep[n]['b1_p50_ms']:.2f} ms "
                            f"({ort / rep[n]['b1_p50_ms']:.2f}× ORT FP32), cold start {rep[n]['cold_start_ms']:.0f} ms"
                            for n in engines)


def load_in_fresh_process(target: str, engine: Path, shape: tuple[int, ...], heavy: tuple[str, ...], out: Path):
    """Load `engine` through pipeline.engines in a new interpreter and run it once on a constant batch of `shape`:
    (its output, which of the `heavy` modules that process imported)."""
    import numpy as np

    probe = (f"import sys, numpy as np; from pipeline import engines; r = engines.load({target!r}, {str(engine)!r}); "
             f"np.save(sys.argv[1], r.run(np.full({shape!r}, 100, np.float32))); "
             f"print('heavy', *[m for m in {heavy!r} if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", probe, str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       encoding="utf-8", errors="replace")
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out), r.stdout.split("heavy", 1)[1].split()


ORT_FP32 = "embedder-ort-cpu-fp32"


# Photos no build has seen, for the live gallery's tests: face_recognition's own test images, from its pinned sdist
# (license not stated: used in tests only, never put in an artifact — shared/facts/face-models.md).
SITE_PHOTOS = ("face_recognition==1.3.0", "face_recognition-1.3.0.tar.gz",
               "5e5efdd1686aa566af0d3cc1313b131e4b197657a8ffd03669e6d3fad92705ec",
               {"obama.jpg": "0930e3aa8cae5920329c0c8cbc6a2ab70f47b0e67b432875beaa95cbf7e741f6",
                "obama2.jpg": "a7efcc907375274796f39646510704aa86672d59f6d5469d69af3c85590976a6",
                "obama3.jpg": "76ac6bf97c36dc2da0ad16a537d6a5ac1b10f48d49aac29a0cca9a17cdbc3ca3",
                "biden.jpg": "3c17508bb91554c637a2eabddfae790e5bb1caba93130814fc2ac50be9760c4c"})


@pytest.fixture(scope="session")
def site_photos(tmp_path_factory) -> Path:
    """A folder of photos outside data.photos (three of Barack Obama, one of Joe Biden), each sha256-pinned, fetched
    as the assets are (pip, the Kiln archive cache)."""
    from pipeline import assets

    requirement, filename, sha, files = SITE_PHOTOS
    archive = assets.Archive("site-photos", requirement, filename, sha, True, "not stated (tests only)",
                             tuple(assets.Member(f"face_recognition-1.3.0/tests/test_images/{n}", n, h)
                                   for n, h in files.items()))
    root = tmp_path_factory.mktemp("site-photos")
    assets.materialize(root, (archive,), progress=lambda _: None)
    return root


@pytest.fixture(scope="session")
def assets_dir(tmp_path_factory, cfg) -> Path:
    """The repository's artifacts/assets when it verifies, else a fresh fetch (PyPI or the Kiln archive cache)."""
    from pipeline.errors import KilnError
    from pipeline.stages import assets as assets_stage

    repo_assets = REPO / "artifacts" / "assets"
    manifest = repo_assets / "assets.manifest.json"
    try:
        if manifest.is_file() and not verify_manifest(manifest):
            return repo_assets
    except KilnError:          # an older manifest schema: fetch afresh
        pass
    root = tmp_path_factory.mktemp("fetched")
    assets_stage.run(cfg, root, progress=lambda _: None)
    return root / cfg.assets_dir


@pytest.fixture(scope="session")
def cfg() -> config.Config:
    return config.load(REPO / "params.yaml")


def write_params(tmp: Path, mutate) -> Path:
    """A copy of the repository's params.yaml, changed by `mutate(raw_dict)`, written into `tmp`."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    mutate(raw)
    p = tmp / "params.yaml"
    p.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return p


def make_root(tmp: Path, assets_dir: Path) -> Path:
    """A scratch project root whose artifacts/assets is the verified assets directory."""
    (tmp / "artifacts").mkdir(parents=True, exist_ok=True)
    link = tmp / "artifacts" / "assets"
    if not link.exists():
        os.symlink(assets_dir, link)
    shutil.copy(REPO / "params.yaml", tmp / "params.yaml")
    return tmp


@pytest.fixture(scope="session")
def built(tmp_path_factory, assets_dir, cfg) -> Path:
    """A root with golden set, calibration set, golden embeddings and the exported embedder, built by the stages."""
    from pipeline.stages import dataset, export, golden

    root = make_root(tmp_path_factory.mktemp("built"), assets_dir)
    dataset.run(cfg, "golden", root)
    dataset.run(cfg, "calibration", root)
    golden.run(cfg, "embedder", root)
    export.run(cfg, "embedder", root)
    return root


@pytest.fixture(scope="session")
def built_program(built, cfg) -> Path:
    """`built` with the embedder's program too (program@embedder, torch.export), made here if no test made it yet:
    for a test that needs the program, not the reproducibility check test_aoti.py makes of it."""
    from pipeline import paths
    from pipeline.stages import program

    d = paths.program("embedder", built)
    if not (d / "embedder.manifest.json").is_file():
        program.run(cfg, "embedder", built, check_reproducible=False)
    return d


# ---------------------------------------------------------------------------------------------- MLflow
@pytest.fixture(scope="session")
def template_db(tmp_path_factory) -> Path:
    """One migrated, empty MLflow SQLite database; each test copies it (migrations take seconds, a copy does not)."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}", registry_uri=f"sqlite:///{db}")
    client.search_experiments(max_results=1)
    client.search_registered_models(max_results=1)
    return db


@pytest.fixture
def registry_env(tmp_path, template_db, monkeypatch):
    """A fresh SQLite registry (a copy of the migrated template) as MLFLOW_TRACKING_URI, actor `ci`."""
    db = tmp_path / "mlflow.db"
    shutil.copy(template_db, db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setenv("KILN_ACTOR", "ci")
    return db


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_mlflow(tmp_path: Path, template_db: Path, workers: int = 1):
    """`mlflow server` on 127.0.0.1 with a pre-migrated SQLite store; the whole process group dies on exit."""
    db = tmp_path / "server" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(template_db, db)      # already at head: same as `mlflow db upgrade`, without a 3 s process
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db}",
                             "--artifacts-destination", str(tmp_path / "server" / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                log_text = (tmp_path / "server.log").read_text(encoding="utf-8", errors="replace")
                pytest.fail(f"mlflow server exited {proc.returncode}:\n{log_text[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > 90:
                log_text = (tmp_path / "server.log").read_text(encoding="utf-8", errors="replace")
                pytest.fail(f"mlflow server not healthy after 90 s:\n{log_text[-3000:]}")
            time.sleep(0.5)
        print(f"\nmlflow server healthy after {time.perf_counter() - t0:.1f} s")
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        log.close()


@pytest.fixture
def mlflow_server(tmp_path, template_db):
    with serve_mlflow(tmp_path, template_db) as url:
        yield url


@pytest.fixture
def postgres_server():
    """The team setup: scripts/registry-server.sh — a real PostgreSQL cluster and `mlflow server` on it, proxying
    artifacts. Its directory must be readable by the `postgres` user when run as root (pytest's tmp dirs are not)."""
    d = Path(tempfile.mkdtemp(prefix="kiln-registry-"))
    os.chmod(d, 0o755)
    t0 = time.perf_counter()
    r = subprocess.run(["bash", str(REPO / "scripts/registry-server.sh"), "start", str(d)], capture_output=True,
                       text=True, timeout=300, encoding="utf-8", errors="replace")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        url = r.stdout.split("MLFLOW_TRACKING_URI=")[1].split()[0]
        print(f"\nPostgreSQL registry server up in {time.perf_counter() - t0:.1f} s: {url}")
        yield url
    finally:
        subprocess.run(["bash", str(REPO / "scripts/registry-server.sh"), "stop", str(d)], capture_output=True,
                       timeout=120)
        shutil.rmtree(d, ignore_errors=True)


@dataclass(frozen=True)
class OciRegistry:
    dir: Path
    host: str                      # 127.0.0.1:PORT
    password: str

    def env(self, **over: str) -> dict[str, str]:
        """A client's environment: the registry's CA trusted, credentials from KILN_OCI_* (argv never holds them)."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_OCI_", "SSL_CERT_", "DOCKER_CONFIG"))}
        return {**base, "SSL_CERT_FILE": str(self.dir / "ca.crt"), "KILN_OCI_USERNAME": "kiln",
                "KILN_OCI_PASSWORD": self.password, **over}

    def blob_file(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (Distribution's filesystem driver layout)."""
        hexd = digest.split(":", 1)[1]
        return self.dir / "store/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@pytest.fixture(scope="session")
def oci_registry():
    """The team setup for releases: scripts/oci-registry.sh — Debian's docker-registry (CNCF Distribution) on
    loopback with TLS (its own CA) and basic auth (htpasswd, bcrypt)."""
    d = Path(tempfile.mkdtemp(prefix="kiln-oci-"))
    r = subprocess.run(["bash", str(REPO / "scripts/oci-registry.sh"), "start", str(d)], capture_output=True,
                       text=True, timeout=120, encoding="utf-8", errors="replace")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield OciRegistry(d, r.stdout.split()[1], (d / "password").read_text(encoding="utf-8").strip())
    finally:
        subprocess.run(["bash", str(REPO / "scripts/oci-registry.sh"), "stop", str(d)], capture_output=True,
                       timeout=60)
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the default DAG
# Built once per run in a copy of the working tree (`built_dag`) for tests/test_dvc_pipeline.py and, on a copy of
# that build, tests/test_build_hosts.py; the helpers run DVC and the CLI there.
TOOLCHAIN = "toolchain"        # the always-changed probe (toolchain/dvc.yaml); stage names below are bare names


def _small_galleries(params: Path) -> None:
    """Only the 10k gallery in the copy: 100k and 1M cost minutes (bench/matching.py measures them)."""
    text, n = re.subn(r"(?m)^(  gallery_sizes:)\s*\[[^\]]*\]", r"\1 [10000]", params.read_text(encoding="utf-8"))
    assert n == 1, "params.yaml: matching.gallery_sizes not found as a one-line list"
    params.write_text(text, encoding="utf-8")


def _report_speed_gates(params: Path) -> None:
    """The INT8 ≥ FP32 speed gate is a timing on a shared machine: in the copy it reports, it does not fail."""
    text, n = re.subn(r"(?m)^(  int8_min_speedup:)\s*[0-9.]+", r"\1 0.0", params.read_text(encoding="utf-8"))
    assert n == 1, "params.yaml: bench.int8_min_speedup not found"
    params.write_text(text, encoding="utf-8")


def _short_bench(params: Path) -> None:
    """Timings are records (never compared): in the copy each engine × batch is timed 0.3 s, not 2 s."""
    text = params.read_text(encoding="utf-8")
    for key, value in (("min_seconds", "0.3"), ("min_runs", "10"), ("warmup", "3")):
        text, n = re.subn(rf"(?m)^(  {key}:)\s*[0-9.]+", rf"\g<1> {value}", text)
        assert n == 1, f"params.yaml: bench.{key} not found"
    params.write_text(text, encoding="utf-8")


def _short_sysbench(params: Path) -> None:
    """Load-test figures are records too: in the copy each system runs 1 and 2 streams for 1 s each, not the sweep
    (5 systems × up to 7 points × 6 s); bench/peers.py and the report read what it writes all the same."""
    text = params.read_text(encoding="utf-8")
    for key, value in (("streams", "[1, 2]"), ("seconds", "1.0")):
        text, n = re.subn(rf"(?m)^(  {key}:)\s*(\[[^\]]*\]|[0-9.]+)", rf"\g<1> {value}", text)
        assert n == 1, f"params.yaml: sysbench.{key} not found as one line"
    params.write_text(text, encoding="utf-8")


def _copy_worktree(dest: Path) -> Path:
    from pipeline.dvcfiles import dvc_files

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True, encoding="utf-8", errors="replace").stdout.split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    for f in dvc_files(dest):
        f.with_name("dvc.lock").unlink(missing_ok=True)
    _small_galleries(dest / "params.yaml")
    _report_speed_gates(dest / "params.yaml")
    _short_bench(dest / "params.yaml")
    _short_sysbench(dest / "params.yaml")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "snapshot"]):
        subprocess.run(cmd, cwd=dest, check=True)
    return dest


def dag_env(root: Path) -> dict[str, str]:
    """The environment of a command in a DAG copy: its own code, its own SQLite registry."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the clone's own SQLite registry
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(root))
    return env


def dvc(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=root,
                          env={**dag_env(root), **(env or {})}, capture_output=True, text=True, encoding="utf-8",
                          errors="replace")


def kiln(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=root,
                          env={**dag_env(root), **(env or {})}, capture_output=True, text=True, encoding="utf-8",
                          errors="replace")


def ran(out: str) -> set[str]:
    from pipeline.dvcfiles import bare

    return {bare(line.split("'")[1]) for line in out.splitlines() if line.startswith("Running stage '")}


def restored(out: str) -> set[str]:
    from pipeline.dvcfiles import bare

    return {bare(line.split("'")[1]) for line in out.splitlines() if "is cached - skipping run" in line}


@pytest.fixture(scope="session")
def built_dag(tmp_path_factory, worker_id) -> dict[str, Path]:
    """The default DAG built once per test run, in a copy of the working tree at another path (`build`), and a
    copy of the built project (`hosts`) for tests/test_build_hosts.py, which runs on the other xdist worker while
    tests/test_dvc_pipeline.py's tests change `build`. The first worker to ask builds both; the other waits on a
    file lock."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":                     # each xdist worker has its own basetemp under the run's
        shared = shared.parent
    build, hosts, failed = shared / "dag-build", shared / "dag-hosts", shared / "dag-build.failed"
    with open(shared / "dag-build.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            pytest.fail(failed.read_text(encoding="utf-8"))
        if not hosts.exists():
            build.mkdir()
            root = _copy_worktree(build)
            r = kiln(root, "dag", "--write")                  # the copy has one gallery size: its own dvc.yaml
            first = dvc(root, "repro") if r.returncode == 0 else r
            if first.returncode != 0:
                failed.write_text("the default DAG did not build:\n" + first.stdout[-3000:] + first.stderr[-3000:],
                                  encoding="utf-8")
                pytest.fail(failed.read_text(encoding="utf-8"))
            shutil.copytree(build, shared / "dag-hosts.tmp", symlinks=True)
            (shared / "dag-hosts.tmp").rename(hosts)
    return {"build": build, "hosts": hosts}


# ---------------------------------------------------------------------------------------------- reliability suites
@pytest.fixture(scope="session")
def project(built, cfg, tmp_path_factory) -> Path:
    """The reliability suites' scratch project (tests/test_reliability*.py; a test that changes it puts it back):
    golden + calibration sets, the embedder's golden, export, program, calibration, an ORT engine compiled and
    validated, the 10k gallery — copied from the session build, then built by the CLI."""
    from reliability import ENGINE, kiln

    root = tmp_path_factory.mktemp("reliability")
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    (root / "artifacts").mkdir()
    os.symlink(os.readlink(built / "artifacts/assets") if (built / "artifacts/assets").is_symlink()
               else built / "artifacts/assets", root / "artifacts/assets")
    for rel in ("artifacts/data", "artifacts/golden/embedder", "artifacts/export/embedder"):
        shutil.copytree(built / rel, root / rel)
    for args in (["toolchain"], ["calibrate", "embedder"], ["quantize", "embedder-ort"], ["compile", ENGINE],
                 ["validate", ENGINE], ["program", "embedder"], ["gallery", "10000"]):
        r = kiln(root, *args)
        assert r.returncode == 0, (args, r.stderr[-3000:])
    return root


@pytest.fixture
def registry_root(project, tmp_path, template_db) -> tuple[Path, dict]:
    """The project with its own fresh SQLite registry (pre-migrated copy) for one test."""
    db = tmp_path / "reg" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(template_db, db)
    return project, {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}


# ---------------------------------------------------------------------------------------------- headless Chromium
ARTIFACTS = REPO / "test-artifacts"          # screenshots the tests keep (git-ignored)


def render_in_chromium(page: Path, screenshot: str, height: int = 2400, min_png: int = 10_000) -> tuple[str, list[str]]:
    """Load `page` in headless Chromium (Debian's package; scripts/setup.sh --test installs it), keep a screenshot
    under test-artifacts/, and return (the rendered DOM, the page's console messages)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: run `bash scripts/setup.sh --test` (it apt-get installs it)")
    ARTIFACTS.mkdir(exist_ok=True)
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
             "--v=0", "--proxy-server=127.0.0.1:9", f"--window-size=1400,{height}"]       # no network either
    shot = subprocess.run(flags + [f"--screenshot={ARTIFACTS / screenshot}", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120, encoding="utf-8", errors="replace")
    dom = subprocess.run(flags + ["--dump-dom", page.resolve().as_uri()], capture_output=True, text=True,
                         timeout=120, encoding="utf-8", errors="replace")
    assert shot.returncode == 0 and dom.returncode == 0, shot.stderr[-2000:] + dom.stderr[-2000:]
    assert (ARTIFACTS / screenshot).stat().st_size > min_png, "the screenshot is (nearly) empty"
    console = [line for out in (shot.stderr, dom.stderr) for line in out.splitlines() if ":CONSOLE" in line]
    return dom.stdout, console


# ---------------------------------------------------------------------------------------------- the deployment side
BUILD_ONLY = ("torch", "dvc", "mlflow", "onnx", "pydantic", "model_signing", "yaml", "pipeline")


@pytest.fixture(scope="session")
def runtime_venv(tmp_path_factory) -> Path:
    """A fresh venv made from runtime/lockfile.txt alone (hash-checked, no dependency resolution) plus the
    kiln-runtime wheel built from this checkout: what a deployment host installs. Fails — never skips — if it cannot
    be made; asserts that nothing of the build is importable there."""
    base = tmp_path_factory.mktemp("runtime-venv")
    venv, wheels = base / "venv", base / "wheels"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    quiet = ["--disable-pip-version-check", "-q"]
    subprocess.run([str(py), "-m", "pip", "install", *quiet, "--require-hashes", "--no-deps", "-r",
                    str(REPO / "runtime" / "lockfile.txt")], check=True, timeout=900)
    subprocess.run([sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "--no-build-isolation",
                    str(REPO / "runtime"), "-w", str(wheels)], check=True, timeout=300, cwd=base)
    subprocess.run([str(py), "-m", "pip", "install", *quiet, "--no-deps", *map(str, wheels.glob("*.whl"))],
                   check=True, timeout=300)
    subprocess.run([str(py), "-m", "pip", "check"], check=True, timeout=120)
    found = subprocess.run([str(py), "-c", "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
                            "if importlib.util.find_spec(m) is not None))", *BUILD_ONLY],
                           capture_output=True, text=True, check=True, cwd=base, timeout=60).stdout.split()
    assert found == [], f"the runtime venv can import {found}"
    return venv
