"""The connection to the MLflow registry: where it is, bounded waits, one-line errors, safe first use, locks.

* Where: `MLFLOW_TRACKING_URI` if set, else SQLite at `<root>/<register.sqlite_path>` with its artifacts in
  `mlruns/` beside the database. A copied or moved checkout whose database still points at another checkout's
  artifact store is refused (it would register into, and promote from, the original).
* Waits: MLflow retries an unreachable server for minutes by default; here an HTTP(S) server must answer its
  health check within `register.timeout_s`, and MLflow's own retries are bounded by it.
* Errors: MLflow's and SQLAlchemy's exceptions become one `KilnError` line with a hint, and every URL in any
  message has its `user:password@` removed; MLflow's own loggers are silenced, so nothing precedes that line.
* First use of SQLite: a new database is created and migrated in a temporary file under an exclusive lock and
  renamed into place, so concurrent first uses or a kill -9 can never leave a half-migrated schema.
* Locks: registration and alias moves of one registered model run under a lease lock that works on SQLite and
  on a remote server alike — the lock is a registered model `<name>.lock`, whose creation the database makes
  unique; the holder renews its lease, and a dead holder's lock is taken over (at once on this host, else once
  the lease ran out).

MLflow is imported inside functions only, so `import pipeline` stays fast.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import urlsplit

from pipeline.errors import KilnError

if TYPE_CHECKING:
    from pipeline.config import Config

LOCK_SUFFIX = ".lock"
LEASE_S = 30.0                    # a lock not renewed for this long belongs to a dead holder
LOCK_WAIT_S = 300.0               # longest wait for another kiln's lock on the same registered model
_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s:]+(?::[^/@\s]*)?@")


def redact(text: str) -> str:
    """`text` with the `user:password@` part of every URL removed."""
    return _CREDENTIALS.sub(r"\g<scheme>", str(text))


def tracking_uri(cfg: Config, root: Path = Path(".")) -> str:
    """`MLFLOW_TRACKING_URI` if set, else an absolute SQLite URI at `<root>/<register.sqlite_path>`."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    db = (Path(root) / cfg.register.sqlite_path).resolve()
    return f"sqlite:///{db}"


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    rest = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(rest) if rest and rest != ":memory:" else None


def _engine_uri(uri: str) -> str:
    """SQLite: wait up to 60 s for a concurrent writer instead of failing with "database is locked" after 5 s."""
    if sqlite_path(uri) is not None and "?" not in uri:
        return uri + "?timeout=60"
    return uri


@contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """An exclusive advisory lock on a directory (not a file: closing an extra descriptor of the SQLite file would
    drop SQLite's own POSIX locks in this process, and a lock file would litter the repository)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def init_sqlite(db: Path) -> None:
    """Create and fully migrate a new SQLite registry atomically: in a temporary file, renamed when complete."""
    if db.is_file():
        return
    with _dir_lock(db.parent):
        if db.is_file():
            return
        for stale in db.parent.glob(f".{db.name}.init-*"):  # a first use killed mid-migration
            stale.unlink(missing_ok=True)
        tmp = db.parent / f".{db.name}.init-{os.getpid()}"
        try:
            from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine

            engine = create_sqlalchemy_engine(f"sqlite:///{tmp}")
            try:
                _initialize_tables(engine)
            finally:
                engine.dispose()
            os.replace(tmp, db)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, Exception):
                raise KilnError(f"{db}: could not create the MLflow registry database ({type(e).__name__}: "
                                f"{redact(str(e)).splitlines()[0][:200]})", "check the directory is writable") from None
            raise


def _bound_waits(timeout_s: float) -> None:
    """MLflow's HTTP client retries 7 times with backoff 2 (minutes); keep the total near `timeout_s`."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "2"
    os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "1"
    os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"] = "0.2"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, int(round(timeout_s))))


def check_reachable(uri: str, timeout_s: float) -> None:
    """An HTTP(S) tracking server must answer `/health` within `timeout_s`, else one clear error, at once."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    import urllib.error
    import urllib.request

    url = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:   # noqa: S310 (the user's own tracking URI)
            r.read(64)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise KilnError(f"MLflow registry unreachable at {redact(uri)} ({redact(str(reason))[:200]}; waited at most "
                        f"{timeout_s:g} s)", "start the tracking server or fix MLFLOW_TRACKING_URI "
                        "(register.timeout_s bounds the wait)") from None


@contextmanager
def errors(uri: str) -> Iterator[None]:
    """MLflow / SQLAlchemy / HTTP exceptions become one-line KilnErrors, credentials redacted."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except KilnError:
        raise
    except MlflowException as e:
        text = redact(str(getattr(e, "message", e))).strip()
        first = (text.splitlines() or [type(e).__name__])[0][:300]
        hint = "check MLFLOW_TRACKING_URI and that the tracking server is up"
        if "out-of-date database schema" in text:
            hint = f"run `mlflow db upgrade {redact(uri)}` (back the database up first)"
        elif "OperationalError" in text or "DatabaseError" in text:
            hint = _DAMAGED
        elif "Max retries exceeded" in text or "Connection" in text:
            first = f"registry unreachable ({first})"
        raise KilnError(f"MLflow ({redact(uri)}): {first}", hint) from None
    except ModuleNotFoundError as e:            # SQLAlchemy imports a database's driver on first use
        tb = e.__traceback__
        while tb.tb_next:
            tb = tb.tb_next
        if "sqlalchemy" not in tb.tb_frame.f_code.co_filename:
            raise
        raise KilnError(f"MLflow ({redact(uri)}): the database driver {str(e.name)[:100]!r} is not installed",
                        "install it into the venv, or use another MLFLOW_TRACKING_URI") from None
    except Exception as e:
        mod = type(e).__module__
        if not mod.startswith(("sqlalchemy", "sqlite3", "requests", "urllib3", "alembic")):
            raise
        text = redact(str(e)).strip().splitlines()
        raise KilnError(f"MLflow ({redact(uri)}): {type(e).__name__}: {(text or ['?'])[0][:300]}", _DAMAGED) from None


_DAMAGED = ("the registry database is damaged or locked; if it is a local SQLite file, move it away and rebuild it "
            "with `kiln registry sync`")


def quiet_mlflow_logs() -> None:
    """MLflow logs a failed SQL query with its traceback (about 100 lines) just before raising the error that
    `errors` turns into Kiln's one line, and warns on its own retries: Kiln reports registry failures itself, so
    MLflow's loggers (and alembic's, which MLflow drives) stay silent."""
    import logging

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


class Registry:
    """One MLflow client bound to one tracking URI (also set process-wide: see the note in __init__)."""

    def __init__(self, cfg: Config, root: Path = Path(".")) -> None:
        self.uri = tracking_uri(cfg, root)
        self.timeout_s = cfg.register.timeout_s
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # kiln prints its own line
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # "🏃 View run …" on every run end
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        _bound_waits(self.timeout_s)
        import mlflow
        from mlflow import MlflowClient

        quiet_mlflow_logs()                # after `import mlflow`, which sets its loggers' levels
        check_reachable(self.uri, self.timeout_s)
        self.db = sqlite_path(self.uri)
        if self.db is not None:
            init_sqlite(self.db)

        self.engine_uri = engine_uri = _engine_uri(self.uri)
        # The SQL registry store resolves `models:/<model_id>` sources through a *global* MlflowClient()
        # (mlflow/store/model_registry/sqlalchemy_store.py, create_model_version), so the process-wide URIs
        # must match this client's, or registration looks in ./mlflow.db of the working directory.
        saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        mlflow.set_tracking_uri(engine_uri)        # (also exports MLFLOW_TRACKING_URI: put the user's back)
        mlflow.set_registry_uri(engine_uri)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._experiments: dict[str, str] = {}
        with errors(self.uri):
            self.client = MlflowClient(tracking_uri=engine_uri, registry_uri=engine_uri)
            found = self.client.search_experiments(max_results=1000)
        for exp in found:                  # a copied checkout: refuse before anything is read or written
            if exp.name.startswith("kiln-"):
                self._check_location(exp.name, exp.artifact_location)

    # ------------------------------------------------------------------------------------------ experiments
    def artifact_root(self, experiment: str) -> str | None:
        """SQLite: `<db dir>/mlruns/<experiment>` (absolute), not MLflow's cwd-relative `./mlruns`."""
        return (self.db.parent / "mlruns" / experiment).as_uri() if self.db else None

    def experiment_id(self, name: str) -> str:
        """Get or create an experiment; a SQLite store's artifacts must live beside its database."""
        if name in self._experiments:
            return self._experiments[name]
        from mlflow.exceptions import MlflowException

        with errors(self.uri):
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                try:
                    eid = self.client.create_experiment(name, artifact_location=self.artifact_root(name))
                except MlflowException as e:  # created concurrently (mlflow/mlflow#4123)
                    if e.error_code != "RESOURCE_ALREADY_EXISTS":
                        raise
                    eid = self.client.get_experiment_by_name(name).experiment_id
            else:
                if exp.lifecycle_stage == "deleted":
                    raise KilnError(f"MLflow experiment {name!r} is deleted",
                                    f"restore it (mlflow experiments restore --experiment-id {exp.experiment_id})")
                self._check_location(name, exp.artifact_location)
                eid = exp.experiment_id
        self._experiments[name] = eid
        return eid

    def _check_location(self, name: str, location: str) -> None:
        """A file-store location must be the one beside this database; other stores (s3://, …) are the user's."""
        expected = self.artifact_root(name)
        if expected is None or location == expected or not str(location).startswith("file:"):
            return
        raise KilnError(f"{self.db}: experiment {name!r} stores its artifacts at {location}, not beside this "
                        f"database ({expected}): this checkout was copied or moved, and would write into the other one",
                        f"use that registry explicitly (MLFLOW_TRACKING_URI), or start a fresh one here: move "
                        f"{self.db.name} and mlruns/ away, then `kiln registry sync`")

    # ------------------------------------------------------------------------------------------ models
    def aliases(self, name: str) -> dict[str, int]:
        # search_model_versions() leaves aliases empty (mlflow/mlflow#16734); the registered model has them.
        return {a: int(str(v)) for a, v in self.client.get_registered_model(name).aliases.items()}

    def version(self, name: str, version: int | str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version(name, str(version))
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"):
                raise
            raise KilnError(f"{name}: no version {version} in the registry at {redact(self.uri)}",
                            f"list the versions with `kiln history {name}`, or register the engine first") from None

    def require_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
                raise
            raise KilnError(f"no registered model {name!r} at {redact(self.uri)}",
                            "register it first (dvc repro, or kiln registry sync), "
                            "or check MLFLOW_TRACKING_URI") from None

    # ------------------------------------------------------------------------------------------ locks
    @contextmanager
    def lock(self, name: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Exclusive lease on registered model `name` across processes and hosts (see the module doc)."""
        from mlflow.exceptions import MlflowException

        lock_name, token = name + LOCK_SUFFIX, uuid.uuid4().hex
        me = {"kind": "kiln-lock", "host": socket.gethostname(), "pid": str(os.getpid()), "token": token}
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.client.create_registered_model(lock_name, tags={**me, "expires": str(time.time() + LEASE_S)},
                                                    description=f"kiln lease lock on {name}")
                break
            except MlflowException as e:
                # Taken: RESOURCE_ALREADY_EXISTS. MLflow's SQL store answers a duplicate by reading the existing
                # model back, so a holder releasing in between makes it RESOURCE_DOES_NOT_EXIST: free, try again.
                if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                    raise
            holder = self._lock_holder(lock_name)
            if holder is not None and self._is_stale(holder):
                self._release(lock_name, holder.get("token"))
                continue
            if time.monotonic() > deadline:
                who = f"{holder.get('host')}:{holder.get('pid')}" if holder else "another process"
                raise KilnError(f"registry busy: {name} is locked by kiln at {who} for over {wait_s:g} s",
                                "wait for it to finish; a crashed holder's lock expires after "
                                f"{LEASE_S:g} s without renewal")
            time.sleep(0.05 + random.random() * 0.2)
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(LEASE_S / 3):
                try:
                    self.client.set_registered_model_tag(lock_name, "expires", str(time.time() + LEASE_S))
                except Exception:  # noqa: BLE001 — renewal is best effort; the lease then simply runs out
                    pass

        keeper = threading.Thread(target=renew, daemon=True)
        keeper.start()
        try:
            yield
        finally:
            stop.set()
            keeper.join(timeout=5)
            self._release(lock_name, token)

    def _lock_holder(self, lock_name: str) -> dict[str, str] | None:
        from mlflow.exceptions import MlflowException

        try:
            return dict(self.client.get_registered_model(lock_name).tags or {})
        except MlflowException:
            return None

    @staticmethod
    def _is_stale(holder: dict[str, str]) -> bool:
        """A holder on this host is judged by whether its process lives (a starved holder whose renewal waited on a
        busy database must not lose its lock while it works); one on another host by its lease, and a lease long
        past (10× its length: a reused pid) expires anywhere."""
        try:
            expires = float(holder.get("expires", "0"))
        except ValueError:
            return True
        if expires < time.time() - 9 * LEASE_S:
            return True
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder.get("pid", "0")), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, ValueError):
                return False
            return False
        return expires < time.time()

    def _release(self, lock_name: str, token: str | None) -> None:
        from mlflow.exceptions import MlflowException

        holder = self._lock_holder(lock_name)
        if holder is None or holder.get("token") != token:
            return                                         # not ours (any more): leave it
        try:
            self.client.delete_registered_model(lock_name)
        except MlflowException:
            pass


def registered_name(cfg: Config, name: str) -> str:
    """Accept the registered model name (kiln-<engine>, kiln-gallery-<size>) or the engine / gallery name."""
    from pipeline import paths

    bare = name.removeprefix("kiln-")
    paths.slug(bare, "registered name")
    return f"kiln-{bare}"


def is_lock(model: Any) -> bool:
    return str(getattr(model, "name", "")).endswith(LOCK_SUFFIX)
