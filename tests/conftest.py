"""Shared fixtures: the real pinned assets (fetched once, sha256-verified) and a built workspace."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline import config
from pipeline.manifest import verify_manifest

REPO = Path(__file__).resolve().parents[1]

# Test files in this order, each on one xdist worker (scripts/test.sh: `--dist loadfile --no-loadscope-reorder`):
# the default DAG build first (the longest chain: it, then the tests on it), the build-hosts test, which needs that
# build, last — by then the other worker has run everything else.
FIRST, LAST = "test_dvc_pipeline.py", "test_build_hosts.py"


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: {FIRST: 0, LAST: 2}.get(item.path.name, 1))    # stable: file order kept within


# ------------------------------------------------------------------------ opt-in targets (profiles/*.yaml)
def profile_cfg(tmp: Path, cfg, profile: str, extra_engines: dict | None = None, overrides: dict | None = None):
    """params.yaml with profiles/<profile>.yaml merged (then `overrides`, and `extra_engines` added), loaded and
    checked against the target registry: the configuration an opt-in target's tests build with."""
    import yaml

    from pipeline import profiles, targets

    raw = profiles.merged(profiles.merged(cfg.raw, profiles.load(profile, REPO)), overrides or {})
    raw["engines"].update(extra_engines or {})
    p = tmp / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    loaded = config.load(p)
    targets.check(loaded)
    return loaded


def bench_beside_ort(pcfg, root: Path, engines: tuple[str, ...], tmp: Path) -> dict:
    """`engines` and the embedder's ORT FP32 engine timed side by side by one bench@embedder run in this process
    (short settings): the report. Every engine must have been timed; speed itself is printed, never asserted."""
    import yaml

    from pipeline import paths
    from pipeline.stages import bench
    from pipeline.stages import compile as compile_stage

    raw = yaml.safe_load(pcfg.source.read_text())
    raw["engines"] = {n: e for n, e in raw["engines"].items() if n in (*engines, ORT_FP32)}
    raw["bench"].update(min_seconds=0.3, min_runs=10, warmup=3)
    raw["systems"] = {}
    p = tmp / "bench-params.yaml"
    p.write_text(yaml.safe_dump(raw))
    bcfg = config.load(p)
    if not paths.engine(ORT_FP32, root).is_dir():
        compile_stage.run(bcfg, ORT_FP32, root, check=False)
    report = bench.measure_model(bcfg, "embedder", root, progress=lambda _: None).report
    for name in (*engines, ORT_FP32):
        assert report["engines"][name]["b1_p50_ms"] > 0 and report["engines"][name]["cold_start_ms"] > 0, name
    return report


def versus_ort(report: dict, engines: tuple[str, ...]) -> str:
    """One line: each engine's batch-1 p50, its ratio to ORT FP32 in the same run, and its cold start."""
    rep = report["engines"]
    ort = rep[ORT_FP32]["b1_p50_ms"]
    return "\n" + "  ".join(f"{n.removeprefix('embedder-')}: b1 {rep[n]['b1_p50_ms']:.2f} ms ({ort / rep[n]['b1_p50_ms']:.2f}× "
                            f"ORT FP32), cold start {rep[n]['cold_start_ms']:.0f} ms" for n in engines)


def load_in_fresh_process(target: str, engine: Path, shape: tuple[int, ...], heavy: tuple[str, ...], out: Path):
    """Load `engine` through pipeline.engines in a new interpreter and run it once on a constant batch of `shape`:
    (its output, which of the `heavy` modules that process imported)."""
    import numpy as np

    probe = (f"import sys, numpy as np; from pipeline import engines; r = engines.load({target!r}, {str(engine)!r}); "
             f"np.save(sys.argv[1], r.run(np.full({shape!r}, 100, np.float32))); "
             f"print('heavy', *[m for m in {heavy!r} if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", probe, str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out), r.stdout.split("heavy", 1)[1].split()


ORT_FP32 = "embedder-ort-cpu-fp32"


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

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    mutate(raw)
    p = tmp / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
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
                pytest.fail(f"mlflow server exited {proc.returncode}:\n{(tmp_path / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > 90:
                pytest.fail(f"mlflow server not healthy after 90 s:\n{(tmp_path / 'server.log').read_text()[-3000:]}")
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
                       text=True, timeout=300)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        url = r.stdout.split("MLFLOW_TRACKING_URI=")[1].split()[0]
        print(f"\nPostgreSQL registry server up in {time.perf_counter() - t0:.1f} s: {url}")
        yield url
    finally:
        subprocess.run(["bash", str(REPO / "scripts/registry-server.sh"), "stop", str(d)], capture_output=True,
                       timeout=120)
        shutil.rmtree(d, ignore_errors=True)


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
                          capture_output=True, text=True, timeout=120)
    dom = subprocess.run(flags + ["--dump-dom", page.resolve().as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert shot.returncode == 0 and dom.returncode == 0, shot.stderr[-2000:] + dom.stderr[-2000:]
    assert (ARTIFACTS / screenshot).stat().st_size > min_png, "the screenshot is (nearly) empty"
    console = [line for out in (shot.stderr, dom.stderr) for line in out.splitlines() if ":CONSOLE" in line]
    return dom.stdout, console
