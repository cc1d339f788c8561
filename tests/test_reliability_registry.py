"""Reliability, issue 37: the registry half — a version's binding, signals in the middle of a registry write, and
MLflow's own log lines.

* [registry binding] (class 1) A version repointed at another engine's logged model and run — with the MLflow
  client, or in the registry's SQLite rows, as any registry user can — is refused by every path that reads a
  version: promote, rollback, release, validate-release, fetch.
* [signals: registry] (class 5) SIGTERM (and kill -9) before every single MLflow call of `kiln promote` and
  `kiln register`, one kill per run; after each, the next command converges: the alias and the recorded history
  agree, rollback works, register / registry sync complete a half-registered version.
* [one line] (class 9) MLflow's loggers print nothing before Kiln's one-line error.

The engines are the fast fake ones of tests/registry/test_registry.py on a fresh SQLite registry per test. The killed
commands run in processes forked from a server that imported Kiln and MLflow once (a CLI start costs seconds);
each installs a counter on MlflowClient's public methods that signals its own process at the Nth call.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

from pipeline import registry
from pipeline.release import revalidate, signing
from pipeline.release import engine as release
from pipeline.errors import GateFailed, KilnError
from pipeline.registry.aliases import RELEASES_EXPERIMENT
from pipeline.registry import sync as registry_sync
from reliability import clean_error, kiln, versions
from test_registry import (FP32, INT8, REPO, aliases, client, make_engine, production, register,  # noqa: F401
                           root)

NAME8, NAME32 = f"kiln-{INT8}", f"kiln-{FP32}"


def db_path() -> Path:
    return Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))


def cli_env() -> dict[str, str]:
    return {"MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]}


def two_engines(cfg, root: Path) -> None:
    """INT8 v1 and FP32 v1 registered (both candidates), params.yaml in the root for the CLI."""
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    make_engine(root, cfg, INT8, b"int8-engine")
    make_engine(root, cfg, FP32, b"fp32-engine")
    assert register(cfg, INT8, root).version == register(cfg, FP32, root).version == 1


def repoint_row(name: str, version: int, to_name: str, to_version: int, columns=("source", "storage_location",
                                                                                "run_id")) -> None:
    """What a user with the registry database can do: point a version's row at another version's model and run."""
    with sqlite3.connect(db_path()) as db:
        row = db.execute(f"SELECT {', '.join(columns)} FROM model_versions WHERE name = ? AND version = ?",
                         (to_name, to_version)).fetchone()
        db.execute(f"UPDATE model_versions SET {', '.join(c + ' = ?' for c in columns)} WHERE name = ? AND "
                   "version = ?", (*row, name, version))


# ---------------------------------------------------------------------------------------------- class 1
def test_a_version_repointed_at_another_engine_is_refused_by_every_command(cfg, root, tmp_path):
    """[registry binding] The reproduced sequence: an INT8 version whose source and run are the FP32 engine's
    logged model and run was promoted, released and verified. Every path that reads a version refuses it now."""
    two_engines(cfg, root)
    c = client()
    fp32 = c.get_model_version(NAME32, "1")
    assert int(c.create_model_version(NAME8, source=fp32.source, run_id=fp32.run_id).version) == 2
    keys = signing.keygen(tmp_path / "keys" / "publisher.pem")

    r = kiln(root, "promote", INT8, "2", env=cli_env())
    clean_error(r, 1, f"{NAME8} v2", f"belongs to {NAME32}", "repointed")
    assert "production" not in aliases(NAME8)
    r = kiln(root, "release", NAME8, "2", "--key", str(keys[0]), "--out", str(tmp_path / "out"), env=cli_env())
    clean_error(r, 1, f"belongs to {NAME32}")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    with pytest.raises(GateFailed, match=f"belongs to {NAME32}"):
        revalidate.run(cfg, NAME8, 2, root)

    # an existing version edited in place after promotion: rollback, release and fetch of production refuse it
    make_engine(root, cfg, INT8, b"int8-engine, rebuilt")
    assert register(cfg, INT8, root).version == 3
    registry.promote(cfg, INT8, 1, root)
    registry.promote(cfg, INT8, 3, root)
    repoint_row(NAME8, 1, NAME32, 1)
    with pytest.raises(GateFailed, match=f"belongs to {NAME32}"):
        registry.rollback(cfg, INT8, root)
    assert production(NAME8) == 3
    client().set_registered_model_alias(NAME8, "production", "1")           # and if it is production anyway
    with pytest.raises(GateFailed, match=f"belongs to {NAME32}"):
        registry.fetch_release(cfg, INT8, tmp_path / "fetched", root)
    with pytest.raises(GateFailed, match=f"belongs to {NAME32}"):
        release.build(cfg, NAME8, "production", root, key=keys[0], out_dir=tmp_path / "out")


@pytest.mark.parametrize("edit", ["copy_model_version", "row: source and run", "row: storage location only",
                                  "row: run only", "digest tag"])
def test_every_rebinding_is_named(cfg, root, edit):
    """[registry binding] Each way of rebinding a version — MLflow's own copy, any column of its row, its digest
    tag — is refused with what does not match, before anything is downloaded or trusted."""
    two_engines(cfg, root)
    c = client()
    version, expected = 1, {
        "copy_model_version": f"belongs to {NAME32}", "row: source and run": f"belongs to {NAME32}",
        "row: storage location only": "not at its logged model's location",
        "row: run only": "was logged by run", "digest tag": "xxh3_128 tag"}[edit]
    if edit == "copy_model_version":
        version = int(c.copy_model_version(f"models:/{NAME32}/1", NAME8).version)
    elif edit == "row: source and run":
        repoint_row(NAME8, 1, NAME32, 1)
    elif edit == "row: storage location only":
        repoint_row(NAME8, 1, NAME32, 1, ("storage_location",))
    elif edit == "row: run only":                     # another build of the same engine: its run, v1's files
        make_engine(root, cfg, INT8, b"int8-engine, rebuilt")
        register(cfg, INT8, root)
        repoint_row(NAME8, 1, NAME8, 2, ("run_id",))
    else:
        c.set_model_version_tag(NAME8, "1", "xxh3_128", c.get_model_version(NAME32, "1").tags["xxh3_128"])
    with pytest.raises(GateFailed) as e:
        registry.promote(cfg, INT8, version, root)
    assert expected in e.value.message and "repointed" in e.value.hint, e.value
    assert "production" not in aliases(NAME8)


# ---------------------------------------------------------------------------------------------- class 5
def _faulty(root: str, uri: str, at: int, signum: int, argv: list[str]) -> None:
    """In a forked child: run the kiln CLI with MlflowClient counting its public calls; the `at`-th call first
    sends this process `signum`. A kill -9 counts writes only: before a read it leaves the registry exactly as
    before the next write (SIGTERM does not: the cleanup it triggers differs)."""
    import itertools

    from mlflow import MlflowClient

    from pipeline import cli

    os.chdir(root)
    os.environ.update(MLFLOW_TRACKING_URI=uri, KILN_ACTOR="tester")
    count = itertools.count(1)

    def counted(method):
        def call(*args, **kwargs):
            if next(count) == at:
                os.kill(os.getpid(), signum)
            return method(*args, **kwargs)
        return call

    reads = ("_", "get_", "search_") if signum == signal.SIGKILL else ("_",)
    for attr, method in list(vars(MlflowClient).items()):
        if callable(method) and not attr.startswith(reads):
            setattr(MlflowClient, attr, counted(method))
    os._exit(cli.main(argv))


@pytest.fixture(scope="module")
def forks():
    ctx = multiprocessing.get_context("forkserver")
    # what a registry command imports, so that each child only runs it
    ctx.set_forkserver_preload(["pipeline.cli", "pipeline.config", "pipeline.registry", "pipeline.stages.register",
                                "mlflow", "mlflow.artifacts", "mlflow.store.tracking.sqlalchemy_store",
                                "mlflow.store.model_registry.sqlalchemy_store", "mlflow.tracing.export",
                                "alembic.command", "alembic.config", "sqlalchemy.dialects.sqlite"])
    return ctx


def killed_at_every_call(forks, root: Path, argv: list[str], signum: int, converge, limit: int = 80) -> int:
    """Run `kiln <argv>` once per MLflow call, signalled just before that call, each from the same registry state;
    after each kill, `converge(n)` must bring the registry to a consistent state. Returns the number of kills."""
    state = db_path().parent
    snapshot = state.parent / "snapshot"
    shutil.copytree(state, snapshot)
    for n in range(1, limit):
        # the same inode: the test's own open SQLite connections see the restored file
        shutil.copyfile(snapshot / "mlflow.db", state / "mlflow.db")
        shutil.rmtree(state / "mlruns")
        shutil.copytree(snapshot / "mlruns", state / "mlruns")
        p = forks.Process(target=_faulty, args=(str(root), os.environ["MLFLOW_TRACKING_URI"], n, signum, argv))
        p.start()
        p.join(120)
        if p.exitcode == 0:
            return n - 1                                          # ran to the end: every call was a kill point
        assert p.exitcode in (143, -signum), (n, p.exitcode)         # 143: SIGTERM handled as Ctrl-C
        converge(n)
    pytest.fail(f"kiln {' '.join(argv)} made over {limit} MLflow calls")


def releases_in_progress() -> list:
    c = client()
    exp = c.get_experiment_by_name(RELEASES_EXPERIMENT)
    return [] if exp is None else c.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")


def no_locks() -> bool:
    return not [m.name for m in client().search_registered_models() if m.name.endswith(".lock")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "kill-9"])
def test_promote_killed_at_every_registry_call_converges(cfg, root, forks, signum):
    """[signals: registry] `kiln promote` killed before each of its MLflow calls: the next history agrees with the
    alias (the move happened and is recorded, or it did not happen), promote completes it, rollback works."""
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    for payload in (b"one", b"two"):
        make_engine(root, cfg, FP32, payload)
        register(cfg, FP32, root)
    registry.promote(cfg, FP32, 1, root)

    def converge(n: int) -> None:
        recorded = registry.history(cfg, FP32, root, alias="production")
        assert recorded[-1].to_version == production(NAME32), (n, recorded)
        assert not releases_in_progress(), n
        moved = registry.promote(cfg, FP32, 2, root)
        assert production(NAME32) == 2 and registry.history(cfg, FP32, root, alias="production")[-1].to_version == 2
        assert moved.changed == (recorded[-1].to_version == 1), n
        assert registry.rollback(cfg, FP32, root).to_version == 1 and production(NAME32) == 1, n
        assert no_locks(), n

    assert killed_at_every_call(forks, root, ["promote", FP32, "2"], signum, converge) >= 8


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "kill-9"])
def test_register_killed_at_every_registry_call_converges(cfg, root, forks, signum):
    """[signals: registry] `kiln register` killed before each of its MLflow calls: the next `register` (or
    `registry sync`, alternately) leaves exactly one version of the engine, the candidate alias on it, the move
    recorded, no registration run left RUNNING; a second run has nothing left to repair."""
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    make_engine(root, cfg, FP32, b"first")
    register(cfg, FP32, root)
    make_engine(root, cfg, FP32, b"second")                     # built and validated, not registered yet

    def converge(n: int) -> None:
        if n % 2:
            receipt = register(cfg, FP32, root)
        else:
            receipt = next(r for r in registry_sync.sync(cfg, root, progress=lambda line: None) if r.name == NAME32)
        assert receipt.version == 2 and aliases(NAME32) == {"candidate": 2}, (n, receipt, aliases(NAME32))
        assert versions(db_path(), NAME32) == [1, 2], n
        moves = registry.history(cfg, FP32, root, alias="candidate")
        assert [(m.action, m.to_version) for m in moves] == [("register", 1), ("register", 2)], (n, moves)
        c = client()
        eid = c.get_experiment_by_name(cfg.register.experiment).experiment_id
        assert not c.search_runs([eid], "attributes.status = 'RUNNING'"), n
        assert not releases_in_progress() and no_locks(), n
        again = register(cfg, FP32, root)
        assert not again.new and not getattr(again, "repaired", False) and again.version == 2, n

    assert killed_at_every_call(forks, root, ["register", FP32], signum, converge) >= 10


def test_promote_of_the_current_version_records_an_unrecorded_move(cfg, root):
    """[signals: registry] Production moved with no history entry (a kiln killed mid-promote before this fix, or
    the MLflow UI): rollback refuses and names `kiln promote NAME <current>`, and that command records the move
    instead of answering "nothing moved" — after it, rollback works."""
    for payload in (b"one", b"two"):
        make_engine(root, cfg, FP32, payload)
        register(cfg, FP32, root)
    registry.promote(cfg, FP32, 1, root)
    client().set_registered_model_alias(NAME32, "production", "2")
    with pytest.raises(KilnError, match="moved outside kiln") as e:
        registry.rollback(cfg, FP32, root)
    assert f"kiln promote {NAME32} 2" in e.value.hint
    recorded = registry.promote(cfg, FP32, 2, root)
    assert recorded.changed and (recorded.from_version, recorded.to_version) == (1, 2)
    assert registry.promote(cfg, FP32, 2, root).changed is False                 # now it is recorded
    assert registry.rollback(cfg, FP32, root).to_version == 1 and production(NAME32) == 1


# ---------------------------------------------------------------------------------------------- class 9
def test_mlflow_logs_nothing_before_kilns_one_line(cfg, root):
    """[one line] A damaged registry (a table missing) made MLflow's logger print the failed query and its
    traceback (about 100 lines) before Kiln's message; a database driver not installed was a traceback."""
    two_engines(cfg, root)
    with sqlite3.connect(db_path()) as db:
        db.execute("DROP TABLE registered_model_aliases")
    r = kiln(root, "promote", INT8, "1", env=cli_env())
    clean_error(r, 2, "no such table: registered_model_aliases", "damaged")
    assert len(r.stderr.splitlines()) == 2 and "mlflow.store" not in r.stderr, r.stderr
    r = kiln(root, "history", INT8, env={"MLFLOW_TRACKING_URI": "postgresql://kiln@127.0.0.1:9/kiln"})
    clean_error(r, 2, "database driver")
    assert len(r.stderr.splitlines()) == 2, r.stderr
