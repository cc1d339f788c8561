"""Reliability: Kiln tried as a hostile but fair tester would — bad input, kill -9 in the middle of every kind of
stage, tampering, eight processes at once on SQLite and on a real `mlflow server`, and a dead registry.

Every case runs the real CLI in a fresh process and asserts what a user sees: the documented exit code (2 a user
error, 1 a gate or a verification refusing something), one clear `kiln: …` line (and a hint) without a traceback,
nothing half-written (an output either verifies against its manifest or is absent), and no duplicate or lost
registry entries. The problems these cases came from are named in brackets: [names→paths], [promotion gate],
[sqlite first use], [concurrency], [verified loads], [outage], [relocated checkout], [config], [inputs].
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from PIL import Image

from conftest import REPO, serve_mlflow
from reliability import (AOTI, ENGINE, PY, _env, clean_error, kill_after, kiln, spawn, versions,
                         whole_or_absent)
from pipeline import paths
from pipeline.manifest import build_manifest, file_digests, manifest_path, write_manifest

# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server(tmp_path_factory, template_db):
    with serve_mlflow(tmp_path_factory.mktemp("server"), template_db, workers=2) as url:
        yield url


def _params(root: Path, tmp: Path, mutate) -> str:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    mutate(raw)
    p = tmp / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


# ---------------------------------------------------------------------------------------------- [pipes]
@pytest.mark.parametrize("args", [["dag"], ["deps", "validate@embedder-ort-cpu-int8"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(args):
    """`kiln … | head`: forwarded commands (stage CLIs, dag, deps) stop with 141 and no traceback, like the rest.
    `kiln dag` prints the whole rendered DAG (far more than a pipe buffer), so the write after the reader left
    fails; `deps` may fit the buffer and then simply finishes."""
    p = subprocess.Popen([PY, "-m", "pipeline.cli", *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()                                     # the reader leaves after one line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) in (0, 141), err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    if args == ["dag"]:
        assert p.returncode == 141


# ---------------------------------------------------------------------------------------------- [names→paths]
@pytest.mark.parametrize("args, needle", [
    (["compile", "../../../victim"], "not a valid name"),
    (["export", "../etc"], "not a valid name"),
    (["validate", "a/b"], "not a valid name"),
    (["gallery", "-5"], "not a valid name"),
    (["match", "abc"], "no 'abc'"),
    (["promote", "../../x", "1"], "not a valid name"),
    (["history", "kiln-../x"], "not a valid name"),
    (["deps", "compile@../x"], "no stage"),
])
def test_names_that_would_become_paths_are_refused(project, args, needle):
    clean_error(kiln(project, *args), 2, needle)


def test_an_escaping_engine_in_params_writes_nothing_outside(project, tmp_path):
    """[names→paths] An engine named ../../../victim used to make compile rename and delete a directory outside."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    rel = os.path.relpath(victim, project / "artifacts" / "engines")
    p = _params(project, tmp_path, lambda r: r["engines"].update({rel: r["engines"][ENGINE]}))
    clean_error(kiln(project, "--params", p, "compile", ENGINE), 2, "is not a valid name")
    clean_error(kiln(project, "--params", p, "compile", rel), 2, "is not a valid name")
    assert (victim / "precious.txt").read_text() == "keep" and sorted(os.listdir(victim)) == ["precious.txt"]
    assert not list(Path("/").glob("*.manifest.json"))


# ---------------------------------------------------------------------------------------------- [config]
@pytest.mark.parametrize("mutate, needle", [
    (lambda r: r["targets"]["ort-cpu"].update(threads="two"), "targets.ort-cpu.threads"),
    (lambda r: r["targets"]["ort-cpu"].update(threads=-3), "targets.ort-cpu.threads"),
    (lambda r: r["targets"]["ort-cpu"].update(graph_optimisation="all"), "graph_optimisation: unknown option"),
    (lambda r: r["validate"].update(cosine_min=float("nan")), "validate.cosine_min"),
    (lambda r: r["validate"].update(cosine_mim=0.9), "validate.cosine_mim: unknown key"),
    (lambda r: r["engines"][ENGINE].update(precision="fp8"), f"engines.{ENGINE}.precision"),
    (lambda r: r.pop("register"), "register: missing"),
])
def test_bad_params_are_one_line_with_the_key(project, tmp_path, mutate, needle):
    clean_error(kiln(project, "--params", _params(project, tmp_path, mutate), "compile", ENGINE), 2, needle)
    whole_or_absent(paths.engine(ENGINE, project))


@pytest.mark.parametrize("content, needle", [("a: [unclosed", "invalid YAML"), ("- just\n- a list\n", "mapping")])
def test_unreadable_params(project, tmp_path, content, needle):
    (tmp_path / "p.yaml").write_text(content)
    clean_error(kiln(project, "--params", str(tmp_path / "p.yaml"), "export", "embedder"), 2, needle)


def test_missing_params_file(project):
    clean_error(kiln(project, "--params", "nowhere.yaml", "export", "embedder"), 2, "nowhere.yaml: not found")


@pytest.mark.parametrize("args, needle", [
    (["quantize", "embedder-fp4"], "no 'embedder-fp4'"),
    (["validate", "nope"], "no 'nope'"),
    (["gallery", "12345"], "no '12345'"),
    (["verify", "no/such/dir"], "no *.manifest.json"),
    (["rebuild-check", "nope@x"], "no stage group 'nope'"),
    (["rebuild-check", "--cpu", "EPYC-Rome", "compile@" + ENGINE], "not a portable stage"),
    (["rebuild-check", "--cpu", "Pentium-9000", "golden@embedder"], "not a CPU model qemu-x86_64 knows"),
    (["lock-classes", "--against", "no-such-rev"], "no-such-rev"),
    (["promote", ENGINE, "one"], "version must be a number"),
])
def test_unknown_things_are_named(project, args, needle):
    clean_error(kiln(project, *args), 2, needle)


# ---------------------------------------------------------------------------------------------- [inputs]
def _flip(path: Path, at: int = 1000) -> bytes:
    data = path.read_bytes()
    path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    return data


@pytest.mark.parametrize("rel, args, needle", [
    ("artifacts/export/embedder/model.onnx", ["calibrate", "embedder"], "do not match their manifest"),
    ("artifacts/export/embedder/model.onnx", ["quantize", "embedder-ort"], "do not match their manifest"),
    ("artifacts/export/embedder/model.onnx", ["compile", ENGINE], "do not match their manifest"),
    ("artifacts/golden/embedder/embeddings.npy", ["validate", ENGINE], "do not match their manifest"),
    ("artifacts/engines/embedder-ort-cpu-fp32/model.onnx", ["validate", ENGINE], "refusing to load it"),
    ("artifacts/gallery/10000/vectors.npy", ["match", "10000"], "do not match their manifest"),
    ("artifacts/program/embedder/program.pt2", ["compile", AOTI], "do not match their manifest"),
])
def test_a_modified_input_is_refused_not_used(project, rel, args, needle):
    """[inputs] [verified loads] A bit-flipped upstream file was used, and the new manifest cited the old digest."""
    out = {"calibrate": paths.calibration("embedder", project), "quantize": paths.quantized("embedder", "ort", project),
           "compile": paths.engine(args[1], project), "validate": paths.validation(ENGINE, project),
           "match": paths.index(10000, project)}[args[0]]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else {}
    original = _flip(project / rel)
    try:
        clean_error(kiln(project, *args), 2, needle)
        after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else {}
        assert after == before                                    # the previous output is untouched
    finally:
        (project / rel).write_bytes(original)


def test_nan_weights_give_no_reference(project, tmp_path):
    """[inputs] NaN weights produced an all-NaN golden reference with rc 0 and an export parity of 0."""
    (project / "nanfactory.py").write_text(
        "import torch\nfrom pipeline.models.dlib_resnet import build_embedder\n"
        "def build(weights):\n    m = build_embedder(weights)\n"
        "    with torch.no_grad():\n        next(m.parameters()).fill_(float('nan'))\n    return m\n")
    p = _params(project, tmp_path, lambda r: r["models"]["embedder"].update(factory="nanfactory:build"))
    before = (paths.golden("embedder", project) / "embeddings.npy").read_bytes()
    try:
        clean_error(kiln(project, "--params", p, "golden", "embedder"), 2, "NaN or infinite")
    finally:
        (project / "nanfactory.py").unlink()
    assert (paths.golden("embedder", project) / "embeddings.npy").read_bytes() == before


@pytest.mark.parametrize("make, code, needle", [
    (lambda p: p.write_text("not an image"), 2, "not a readable image"),
    (lambda p: p.write_bytes(b"\xff\xd8\xff\xe0" + b"\0" * 100), 2, "not a readable image"),
    (lambda p: Image.new("1", (20000, 20000)).save(p, "PNG"), 2, "too large"),
])
def test_bad_photos(project, tmp_path, make, code, needle):
    photo = tmp_path / "photo.png"
    make(photo)
    clean_error(kiln(project, "identify", "--target", "pytorch", str(photo)), code, needle)


def test_a_large_photo_is_downscaled_on_decode(tmp_path):
    """[inputs] An 8000² JPEG used to take 3.8 GB: it is decoded at a reduced scale, memory stays bounded."""
    Image.new("RGB", (8000, 8000), (120, 90, 60)).save(tmp_path / "big.jpg", quality=90)
    code = ("import resource, sys; from pipeline.data import load_rgb; "
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; a = load_rgb(sys.argv[1]); "
            "print(a.shape, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)")
    out = subprocess.run([PY, "-c", code, str(tmp_path / "big.jpg")], env=_env(), capture_output=True, text=True,
                         check=True).stdout.split(")")
    shape, added_mb = out[0] + ")", int(out[1])
    assert shape == "(4000, 4000, 3)" and added_mb < 400, (shape, added_mb)   # full-size RGB alone is 192 MB


# ---------------------------------------------------------------------------------------------- [verified loads]
def _fake_aoti_engine(root: Path, entries: dict[str, bytes]) -> Path:
    d = paths.engine(AOTI, root)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    with zipfile.ZipFile(d / "model.pt2", "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    (d / "options.json").write_text('{"threads": 2}')
    write_manifest(d, build_manifest(kind="engine", name=AOTI, model="embedder", target="aoti-cpu",
                                     precision="fp32", directory=d, files=[d / "model.pt2", d / "options.json"],
                                     inputs=[], toolchain={}, build={}, code={}, params={}))
    return d


@pytest.mark.parametrize("entry", ["../escape.so", "/abs/escape.so", "model/..\\evil.so"])
def test_an_engine_package_that_could_escape_is_never_handed_to_the_loader(project, tmp_path, entry):
    """[verified loads] torch's AOTI extraction follows ../ entries: the package is checked first, in a private copy,
    even when its manifest was rewritten to match."""
    saved = tmp_path / "saved"
    if paths.engine(AOTI, project).exists():
        shutil.copytree(paths.engine(AOTI, project), saved)
    try:
        _fake_aoti_engine(project, {"model/data/x": b"x", entry: b"\x7fELF"})
        clean_error(kiln(project, "validate", AOTI), 2, "unsafe entry")
        assert not (project / "artifacts" / "engines" / "escape.so").exists() and not Path("/abs").exists()
    finally:
        shutil.rmtree(paths.engine(AOTI, project), ignore_errors=True)
        if saved.exists():
            shutil.copytree(saved, paths.engine(AOTI, project))


def test_a_swapped_library_in_a_package_is_refused_before_it_runs(project, tmp_path):
    """[verified loads] A swapped .so inside a .pt2 ran its constructor before the load failed."""
    d = _fake_aoti_engine(project, {"model/data/aotinductor/model/x.wrapper.so": b"\x7fELF real"})
    marker = tmp_path / "ran"
    with zipfile.ZipFile(d / "model.pt2", "a") as z:          # changed after the manifest was written
        z.writestr("model/data/aotinductor/model/evil.so", f"touch {marker}".encode())
    try:
        from pipeline import engines
        from pipeline.errors import KilnError

        with pytest.raises(KilnError, match="refusing to load it"):
            engines.load("aoti-cpu", d)
        assert not marker.exists()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- [promotion gate]
def test_a_failed_engine_is_not_a_candidate_and_cannot_be_promoted(registry_root, tmp_path):
    root, env = registry_root
    v = paths.validation(ENGINE, root)
    saved = {p.name: p.read_bytes() for p in v.iterdir()}
    try:
        p = _params(root, tmp_path, lambda r: r["validate"].update(l2_max=0.0))
        clean_error(kiln(root, "--params", p, "validate", ENGINE), 1, "gate failed", "l2_max")
        clean_error(kiln(root, "register", ENGINE, env=env), 1, "validation failed", "--allow-failed")
        r = kiln(root, "register", "--allow-failed", ENGINE, env=env)
        assert r.returncode == 0 and "WARNING" in r.stderr
        name = f"kiln-{ENGINE}"
        from mlflow import MlflowClient

        c = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"], registry_uri=env["MLFLOW_TRACKING_URI"])
        assert dict(c.get_registered_model(name).aliases) == {}
        c.set_model_version_tag(name, "1", "validation", "pass")                  # talk the gate around?
        clean_error(kiln(root, "promote", name, "1", env=env), 1, "stored validation verdict is 'fail'")
        assert dict(c.get_registered_model(name).aliases) == {}
    finally:
        for n, data in saved.items():
            (v / n).write_bytes(data)


def test_an_edited_local_verdict_is_caught(registry_root):
    root, env = registry_root
    f = paths.validation(ENGINE, root) / "validation.json"
    original = f.read_text()
    doc = json.loads(original)
    f.write_text(json.dumps({**doc, "metrics": {**doc["metrics"], "cosine_min": 1.0}}))
    try:
        r = kiln(root, "verify", str(paths.validation(ENGINE, root)))
        assert r.returncode == 1 and "BAD" in r.stdout
        clean_error(kiln(root, "register", ENGINE, env=env), 1, "verdict does not match its manifest")
    finally:
        f.write_text(original)


# ---------------------------------------------------------------------------------------------- [outage]
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args", [["history", ENGINE], ["promote", ENGINE, "1"], ["rollback", ENGINE],
                                  ["register", ENGINE], ["registry", "sync"]])
def test_a_dead_registry_fails_fast_without_leaking_credentials(project, args):
    """[outage] A dead server hung for ~4 minutes and printed user:password."""
    uri = f"http://alice:s3cret@127.0.0.1:{_closed_port()}"
    t0 = time.perf_counter()
    r = kiln(project, *args, env={"MLFLOW_TRACKING_URI": uri}, timeout=120)
    took = time.perf_counter() - t0
    clean_error(r, 2, "registry unreachable", "127.0.0.1")
    assert "s3cret" not in r.stdout + r.stderr and "alice" not in r.stdout + r.stderr
    assert took < 60, took                                  # bounded (register.timeout_s 10 s): not minutes


def test_a_server_that_never_answers_is_given_up_on(project):
    """[outage] A listener that accepts and stays silent: the wait is bounded by register.timeout_s."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()
    held = []

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        t0 = time.perf_counter()
        r = kiln(project, "history", ENGINE, env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{srv.getsockname()[1]}"},
                 timeout=120)
        clean_error(r, 2, "registry unreachable")
        assert time.perf_counter() - t0 < 60
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


# ---------------------------------------------------------------------------------------------- [sqlite first use]
def test_a_damaged_registry_database_is_one_clear_error(project, tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is not a database" * 100)
    clean_error(kiln(project, "history", ENGINE, env={"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}), 2,
                "kiln registry sync")


def test_eight_first_uses_of_a_new_sqlite_registry_at_once(project, tmp_path):
    """[sqlite first use] Eight concurrent first registers half-migrated the schema for good."""
    db = tmp_path / "new" / "mlflow.db"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: kiln(project, "history", ENGINE, env=env), range(8)))
    assert all(r.returncode == 0 and "Traceback" not in r.stderr for r in results), [r.stderr for r in results]
    r = kiln(project, "register", ENGINE, env=env)
    assert r.returncode == 0, r.stderr
    assert versions(db, f"kiln-{ENGINE}") == [1]
    assert not list(db.parent.glob(".mlflow.db.init-*"))


def _migrating(db: Path) -> list[Path]:
    """The temporary file a first use migrates a new SQLite registry in (renamed to `db` when complete)."""
    return list(db.parent.glob(f".{db.name}.init-*"))


@pytest.fixture(scope="module")
def migration_s(project, tmp_path_factory) -> float:
    """How long a first `kiln register` on a new SQLite registry spends migrating it, on this host now: from its
    temporary file appearing to the migrated file's rename (one uninterrupted run, polled every 2 ms)."""
    db = tmp_path_factory.mktemp("migration") / "mlflow.db"
    p = spawn(project, "register", ENGINE, env={"MLFLOW_TRACKING_URI": f"sqlite:///{db}"})
    began = ended = None
    while p.poll() is None and ended is None:
        now = time.perf_counter()
        if began is None and _migrating(db):
            began = now
        if began is not None and db.exists():
            ended = now
        time.sleep(0.002)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert began is not None and ended is not None, "the migration was not seen: its temporary file moved?"
    print(f"\nfirst use: the migration took {ended - began:.2f} s")
    return ended - began


@pytest.mark.parametrize("at", [0.1, 0.5, 0.9])
def test_a_kill_during_the_first_migration_leaves_a_usable_registry(project, tmp_path, migration_s, at):
    """[sqlite first use] A kill -9 during the first register left a half-migrated schema and tracebacks. The kill
    lands `at` of the way through the migration (its measured length, counted from its temporary file appearing),
    and is checked to have landed there — the temporary file left behind, no registry yet — else tried again
    sooner: a host too fast for a fixed delay cannot make the test pass without a kill."""
    db = tmp_path / "mlflow.db"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}

    def reset() -> None:
        for f in (db, *_migrating(db)):
            f.unlink(missing_ok=True)

    kill_after(project, migration_s * at, "register", ENGINE, env=env, armed=lambda: bool(_migrating(db)),
               landed=lambda: bool(_migrating(db)) and not db.exists(), reset=reset)
    r = kiln(project, "register", ENGINE, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert versions(db, f"kiln-{ENGINE}") == [1]
    assert not _migrating(db)                       # the killed run's half-migrated file is gone


# ---------------------------------------------------------------------------------------------- [relocated checkout]
def test_a_copied_checkout_does_not_write_into_the_original(project, tmp_path):
    """[relocated checkout] The default SQLite store stored absolute artifact paths: a copy registered into the
    original's mlruns/."""
    a = tmp_path / "a"
    a.mkdir()
    shutil.copy(project / "params.yaml", a / "params.yaml")
    for rel in (f"artifacts/engines/{ENGINE}", f"artifacts/validation/{ENGINE}", "artifacts/golden/embedder"):
        shutil.copytree(project / rel, a / rel)
    r = kiln(a, "register", ENGINE)                               # default registry: a/mlflow.db + a/mlruns
    assert r.returncode == 0, r.stderr
    before = sorted(str(p) for p in (a / "mlruns").rglob("*"))
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)
    for args in (["register", ENGINE], ["history", ENGINE], ["promote", ENGINE, "1"]):
        clean_error(kiln(b, *args), 2, "copied or moved", "kiln registry sync")
    assert sorted(str(p) for p in (a / "mlruns").rglob("*")) == before


# ---------------------------------------------------------------------------------------------- [concurrency]
def _register_8(root: Path, env: dict) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: kiln(root, "register", ENGINE, env=env), range(8)))


def test_eight_registers_of_one_engine_on_sqlite_make_one_version(registry_root):
    root, env = registry_root
    results = _register_8(root, env)
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results]
    assert sum("registered new version" in r.stdout for r in results) == 1
    assert versions(env["MLFLOW_TRACKING_URI"], f"kiln-{ENGINE}") == [1]


def test_a_lock_released_while_it_is_asked_for_is_taken_not_an_error(registry_root, monkeypatch):
    """[concurrency] MLflow's SQL store answers a duplicate `create` by reading the existing model back; a holder
    that released in between made that read "not found", and one of eight registers failed (CI, 2026-12-01). The
    interleaving is forced here: the holder's lock is deleted between the refused insert and the read."""
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore

    from pipeline import config
    from pipeline.registry.client import LOCK_SUFFIX, Registry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry_root[1]["MLFLOW_TRACKING_URI"])
    reg = Registry(config.load(REPO / "params.yaml"), registry_root[0])
    name = f"kiln-{ENGINE}"
    lock = name + LOCK_SUFFIX
    holder = {"kind": "kiln-lock", "host": socket.gethostname(), "pid": str(os.getpid()), "token": "holder",
              "expires": str(time.time() + 60)}
    reg.client.create_registered_model(lock, tags=holder)            # a live holder on this host
    read = SqlAlchemyStore.get_registered_model
    released = []

    def holder_releases_first(store, model_name):
        if model_name == lock and not released:
            released.append(True)
            store.delete_registered_model(lock)
        return read(store, model_name)

    monkeypatch.setattr(SqlAlchemyStore, "get_registered_model", holder_releases_first)
    with reg.lock(name, wait_s=10):
        assert released and reg.client.get_registered_model(lock).tags["token"] != "holder"
    assert not [m.name for m in reg.client.search_registered_models() if m.name == lock]


@pytest.mark.slow
def test_eight_registers_of_one_engine_over_http_make_one_version(project, server):
    env = {"MLFLOW_TRACKING_URI": server}
    name = f"kiln-{ENGINE}"
    already = versions(server, name)
    results = _register_8(project, env)
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results]
    assert len(versions(server, name)) == max(1, len(already))


def _consistent_history(uri: str, name: str) -> None:
    """The production moves chain (each from = the previous to) and the alias is the replayed stack's top."""
    from mlflow import MlflowClient

    from pipeline.registry.aliases import PRODUCTION, production_stack

    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        from pipeline import config, registry

        moves = registry.history(config.load(REPO / "params.yaml"), name, alias=PRODUCTION)
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    for prev, m in zip(moves, moves[1:]):
        assert m.from_version == prev.to_version, [(x.action, x.from_version, x.to_version) for x in moves]
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    stack = production_stack(moves)
    assert stack and int(c.get_registered_model(name).aliases["production"]) == stack[-1]


def _prepare_versions(root: Path, env: dict, n: int = 3) -> None:
    """n registered versions of the engine (different bytes), production at v1."""
    eng = paths.engine(ENGINE, root)
    session = eng / "session.json"
    original = session.read_text()
    try:
        for i in range(n):
            doc = {**json.loads(original), "note": i}
            session.write_text(json.dumps(doc))
            m = json.loads(manifest_path(eng, ENGINE).read_text())
            m["files"] = [{**f, **file_digests(eng / f["path"])} if f["path"] == "session.json" else f
                          for f in m["files"]]
            manifest_path(eng, ENGINE).write_text(json.dumps(m))
            r = kiln(root, "validate", ENGINE)
            assert r.returncode == 0, r.stderr
            assert kiln(root, "register", ENGINE, env=env).returncode == 0
    finally:
        session.write_text(original)
    assert kiln(root, "compile", ENGINE).returncode == 0 and kiln(root, "validate", ENGINE).returncode == 0
    assert kiln(root, "promote", f"kiln-{ENGINE}", "1", env=env).returncode == 0


def _interleave(root: Path, env: dict) -> None:
    _prepare_versions(root, env)
    name = f"kiln-{ENGINE}"
    jobs = [["promote", name, str(2 + i % 4 // 2)] if i % 2 == 0 else ["rollback", name] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda a: kiln(root, *a, env=env, timeout=300), jobs))
    for r in results:
        if r.returncode != 0:
            clean_error(r, 2)                  # e.g. "the first production version; there is no earlier one"
    _consistent_history(env["MLFLOW_TRACKING_URI"], name)
    assert versions(env["MLFLOW_TRACKING_URI"], name) == [1, 2, 3]


def test_interleaved_promotes_and_rollbacks_keep_a_consistent_history_on_sqlite(registry_root):
    """[concurrency] Interleaved rounds wrote two consecutive 'rollback v2→v1' and a stack of [1, 1]."""
    _interleave(*registry_root)


@pytest.mark.slow
def test_interleaved_promotes_and_rollbacks_keep_a_consistent_history_over_http(project, mlflow_server):
    _interleave(project, {"MLFLOW_TRACKING_URI": mlflow_server})


@pytest.mark.slow
def test_a_shared_registry_on_postgresql_serves_two_checkouts(project, postgres_server, tmp_path):
    """Two build hosts (two checkouts) and one registry on PostgreSQL: interleaved promotes and rollbacks keep one
    consistent history; eight concurrent registers of new bytes, four from each checkout, make one version; what one
    host promotes, the other releases, and the release verifies offline."""
    env = {"MLFLOW_TRACKING_URI": postgres_server}
    _interleave(project, env)                                       # v1..v3, promote/rollback racing
    host_b = tmp_path / "host-b"
    shutil.copytree(project, host_b, symlinks=True)
    name = f"kiln-{ENGINE}"
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: kiln(project if i % 2 else host_b, "register", ENGINE, env=env),
                                range(8)))
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results]
    assert sum("registered new version" in r.stdout for r in results) == 1
    assert versions(postgres_server, name) == [1, 2, 3, 4]
    r = kiln(host_b, "promote", name, "4", env=env)
    assert r.returncode == 0, r.stderr
    history = kiln(project, "history", name, "--alias", "production", env=env)
    last = history.stdout.strip().splitlines()[-1]
    assert history.returncode == 0 and "promote" in last and "v4" in last, history.stdout
    key = tmp_path / "keys" / "k.pem"
    assert kiln(project, "keygen", "--out", str(key)).returncode == 0
    r = kiln(project, "release", name, "production", "--key", str(key), "--out", str(tmp_path / "rel"), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    v = kiln(tmp_path, "verify-release", str(tmp_path / "rel" / f"{name}-v4.tar.gz"), "--key", f"{key}.pub")
    assert v.returncode == 0, v.stdout + v.stderr
    _consistent_history(postgres_server, name)


# ---------------------------------------------------------------------------------------------- kill -9 per stage
@pytest.mark.parametrize("args, out", [
    (["dataset", "golden"], "artifacts/data/golden"),
    (["export", "embedder"], "artifacts/export/embedder"),
    (["calibrate", "embedder"], "artifacts/calibration/embedder"),
    (["quantize", "embedder-ort"], "artifacts/quantized/embedder-ort"),
    (["compile", ENGINE], f"artifacts/engines/{ENGINE}"),
    pytest.param(["compile", AOTI], f"artifacts/engines/{AOTI}", marks=pytest.mark.slow),
    (["validate", ENGINE], f"artifacts/validation/{ENGINE}"),
    (["match", "10000"], "artifacts/index/gallery-10000"),
])
def test_a_killed_stage_leaves_nothing_half_written_and_recovers(project, args, out):
    """kill -9 halfway through (half of a normal run's time, measured first): no output that looks finished, the
    next run succeeds, and the killed run's temporary directory is cleared. AOTInductor's compile (half a minute
    and more on every host seen) is killed 12 s in, while Inductor compiles, without a full run to time first."""
    d = project / out
    if args == ["compile", AOTI]:
        kill_after(project, 12.0, *args)
    else:
        t0 = time.perf_counter()
        r = kiln(project, *args)
        assert r.returncode == 0, r.stderr[-3000:]
        kill_after(project, (time.perf_counter() - t0) / 2, *args)
    whole_or_absent(d)
    r = kiln(project, *args)                                         # and the next run recovers
    assert r.returncode == 0, r.stderr[-3000:]
    whole_or_absent(d)
    assert d.exists() and not list(d.parent.glob(f".{d.name}.*"))  # the killed run's temporary dir is gone


def test_a_killed_register_leaves_no_duplicate_and_no_stuck_lock(project, tmp_path, template_db):
    dbs = [tmp_path / f"r{i}" / "mlflow.db" for i in range(2)]
    for db in dbs:
        db.parent.mkdir()
        shutil.copy(template_db, db)
    first, second = ({"MLFLOW_TRACKING_URI": f"sqlite:///{db}"} for db in dbs)
    t0 = time.perf_counter()
    assert kiln(project, "register", ENGINE, env=first).returncode == 0     # how long a registration takes
    kill_after(project, (time.perf_counter() - t0) * 0.6, "register", ENGINE, env=second)
    r = kiln(project, "register", ENGINE, env=second, timeout=120)      # the dead holder's lock is taken over
    assert r.returncode == 0, r.stderr
    assert versions(dbs[1], f"kiln-{ENGINE}") == [1]
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=second["MLFLOW_TRACKING_URI"], registry_uri=second["MLFLOW_TRACKING_URI"])
    assert not [m.name for m in c.search_registered_models() if m.name.endswith(".lock")]
