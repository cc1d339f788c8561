"""register@<engine>, promote, rollback, history: Kiln's edge to the MLflow model registry.

* `register` logs one compiled engine (its files, manifest, validation.json and bench metrics) as an MLflow
  LoggedModel and registers it as a version of the registered model `kiln-<engine>` (one per
  model × target × precision). It is idempotent by checksum: a version whose `sha256` tag equals the engine
  digest is reused and nothing new is logged, so DVC may rerun the stage freely. A new version gets the alias
  `candidate`; nothing here moves `production`.
* `promote` moves `production` to a version only if its `validation` tag is `pass` and its stored files still
  match: the version's artifacts are downloaded and every file is checked against the stored manifest, and the
  manifest itself against the version's `sha256` / `xxh3_128` tags (which live in the database, not the
  artifact store), so editing a stored file or the stored manifest is caught.
* `rollback` moves `production` back to the version it held before the current one.
* MLflow keeps no alias history, so every alias move (candidate on register, promote, rollback) is appended to the
  experiment `kiln-releases` as one run tagged with who, when, from, to, alias, action and reason; `history`
  reads it back in order, and `rollback` walks it as a stack (promote pushes, rollback pops).

Digests recorded on every version (tags, also on the run and the LoggedModel):
  `sha256`   — the engine digest: sha256 over the sorted (path, sha256) list of the manifest's files;
  `xxh3_128` — the manifest's identity digest (`manifest.identity_digest`: files, inputs, toolchain, build, source).
validation.json's `engine_manifest_xxh3_128` must equal that identity digest, else the validation is stale.

Exit codes through the CLI: a refusal because an artifact fails a check (manifest does not verify, validation
verdict is not pass, stored files or manifest tampered) is `GateFailed` (exit 1); anything the user must fix
first (unknown engine or version, missing validation, no earlier production version) is `KilnError` (exit 2).

MLflow is imported inside functions only, so `import pipeline` stays fast.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

from pipeline import paths
from pipeline.config import Config, EngineSpec
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import (canonical_json, identity_digest, manifest_path, read_manifest, verify_manifest,
                               write_json_atomic)

RELEASES_EXPERIMENT = "kiln-releases"
PRODUCTION, CANDIDATE = "production", "candidate"
VALIDATION_FILE, BENCH_FILE = "validation.json", "bench.json"
KILN_DIR = "kiln"            # where validation.json and the engine's bench metrics sit inside the stored model
MODEL_TYPE = "kiln-engine"
_PREFIX = "kiln-"


@dataclass(frozen=True)
class Receipt:
    """What `register` did. The receipt file holds everything but `new`, so it is identical across reruns."""

    name: str
    version: int
    sha256: str
    tracking_uri: str
    new: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256, "tracking_uri": self.tracking_uri}


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias, as recorded in the `kiln-releases` experiment."""

    name: str
    alias: str
    from_version: int | None
    to_version: int
    action: str               # register | promote | rollback
    actor: str
    at: str                   # UTC ISO 8601, microseconds
    reason: str
    changed: bool = True      # False: the alias already pointed there, nothing was moved or recorded


# ---------------------------------------------------------------------------------------------- pure helpers
def model_name(engine_name: str) -> str:
    return f"{_PREFIX}{engine_name}"


def engine_digest(manifest: dict[str, Any]) -> str:
    """sha256 over the sorted (path, sha256) pairs of the manifest's files: the engine's content identity."""
    pairs = sorted([f["path"], f["sha256"]] for f in manifest["files"])
    return hashlib.sha256(canonical_json(pairs)).hexdigest()


def actor_name(actor: str | None = None) -> str:
    if actor:
        return actor
    if env := os.environ.get("KILN_ACTOR"):
        return env
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (containers) and no LOGNAME/USER
        return "unknown"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _redact(uri: str) -> str:
    """The tracking URI without user:password@, for receipts and messages."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def _flat(prefix: str, value: Any) -> dict[str, str]:
    """Nested dict → {"a.b.c": str}; lists and other non-strings as canonical JSON."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in sorted(value.items()):
            out.update(_flat(f"{prefix}.{k}" if prefix else str(k), v))
        return out
    text = value if isinstance(value, str) else canonical_json(value).decode()
    return {prefix: text}


_BAD_KEY = re.compile(r"[^/\w.\- ]")


def _metric_key(name: str) -> str:
    """MLflow accepts only alphanumerics, _ - . / space (and : off Windows) in metric names."""
    return _BAD_KEY.sub("_", name)


def _metrics(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[_metric_key(f"{prefix}.{k}")] = float(v)
    return out


def _version_int(v: Any) -> int:
    return int(str(v))


# ---------------------------------------------------------------------------------------------- connection
def tracking_uri(cfg: Config, root: Path = Path(".")) -> str:
    """`MLFLOW_TRACKING_URI` if set, else an absolute SQLite URI at `<root>/<register.sqlite_path>`."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    db = (Path(root) / cfg.register.sqlite_path).resolve()
    return f"sqlite:///{db}"


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    rest = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(rest) if rest and rest != ":memory:" else None


@contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """An exclusive advisory lock on a directory: serialises first-time schema creation between processes.

    The directory, not the database file, is locked: closing an extra descriptor of the SQLite file would drop
    SQLite's own POSIX locks in this process, and a lock file would litter the repository.
    """
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class _Registry:
    """One MLflow client bound to one tracking URI (also set process-wide: see the note below)."""

    def __init__(self, cfg: Config, root: Path) -> None:
        self.uri = tracking_uri(cfg, root)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # kiln prints its own line
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # "🏃 View run …" on every run end
        import mlflow
        from mlflow import MlflowClient

        # The SQL registry store resolves `models:/<model_id>` sources through a *global* MlflowClient()
        # (mlflow/store/model_registry/sqlalchemy_store.py, create_model_version), so the process-wide URIs
        # must match this client's, or registration looks in ./mlflow.db of the working directory.
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_registry_uri(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.db = _sqlite_path(self.uri)
        self._experiments: dict[str, str] = {}
        # A fresh SQLite file is migrated by whichever process touches it first; two at once corrupt the schema
        # (dvc-mlflow.md §2.3). Touch both stores once under a lock so later calls find the tables made.
        with self._init_lock(), _mlflow_errors(self.uri):
            self.client.search_experiments(max_results=1)
            self.client.search_registered_models(max_results=1)

    def _init_lock(self):
        if self.db is None:
            from contextlib import nullcontext

            return nullcontext()
        return _dir_lock(self.db.parent)

    def experiment_id(self, name: str) -> str:
        """Get or create an experiment. With SQLite its artifacts go to `<db dir>/mlruns/<name>` (absolute), not to
        MLflow's default `./mlruns`, which depends on the working directory."""
        if name in self._experiments:
            return self._experiments[name]
        from mlflow.exceptions import MlflowException

        with self._init_lock():
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                location = (self.db.parent / "mlruns" / name).as_uri() if self.db else None
                try:
                    eid = self.client.create_experiment(name, artifact_location=location)
                except MlflowException as e:  # created concurrently (mlflow/mlflow#4123)
                    if e.error_code != "RESOURCE_ALREADY_EXISTS":
                        raise
                    eid = self.client.get_experiment_by_name(name).experiment_id
            else:
                if exp.lifecycle_stage == "deleted":
                    raise KilnError(f"MLflow experiment {name!r} is deleted",
                                    f"restore it (mlflow experiments restore --experiment-id {exp.experiment_id})")
                eid = exp.experiment_id
        self._experiments[name] = eid
        return eid

    def aliases(self, name: str) -> dict[str, int]:
        # search_model_versions() leaves aliases empty (mlflow/mlflow#16734); the registered model has them.
        return {a: _version_int(v) for a, v in self.client.get_registered_model(name).aliases.items()}

    def version(self, name: str, version: int | str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version(name, str(version))
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"):
                raise
            raise KilnError(f"{name}: no version {version} in the registry at {_redact(self.uri)}",
                            f"list the versions with `kiln history {name}`, or register the engine first") from None

    def require_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
                raise
            raise KilnError(f"no registered model {name!r} at {_redact(self.uri)}",
                            "register an engine first (kiln register ENGINE), or check MLFLOW_TRACKING_URI") from None


@contextmanager
def _mlflow_errors(uri: str) -> Iterator[None]:
    """MLflow's own exceptions (server down, schema too old, …) become one-line KilnErrors."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        lines = str(getattr(e, "message", e)).strip().splitlines()
        first = (lines[0] if lines else type(e).__name__)[:500]
        hint = "check MLFLOW_TRACKING_URI and that the tracking server is up"
        if "out-of-date database schema" in str(e):
            hint = f"run `mlflow db upgrade {_redact(uri)}` (back the database up first)"
        raise KilnError(f"MLflow ({_redact(uri)}): {first}", hint) from None


def _resolve_name(cfg: Config, name: str) -> str:
    """Accept the registered model name (kiln-<engine>) or the engine name."""
    known = name in cfg.engines or name.startswith("gallery-")      # engines and gallery indexes
    return model_name(name) if known and not name.startswith(_PREFIX) else name


# ---------------------------------------------------------------------------------------------- history
def _record(reg: _Registry, move: AliasMove) -> AliasMove:
    """Append one alias move to the releases experiment and stamp the target version with it."""
    eid = reg.experiment_id(RELEASES_EXPERIMENT)
    tags = {"model": move.name, "alias": move.alias, "action": move.action, "to_version": str(move.to_version),
            "from_version": "" if move.from_version is None else str(move.from_version), "actor": move.actor,
            "at": move.at, "reason": move.reason}
    run = reg.client.create_run(eid, run_name=f"{move.action} {move.name}@{move.alias} → v{move.to_version}",
                                tags=tags)
    reg.client.set_terminated(run.info.run_id, "FINISHED")
    for key, value in ((f"{move.alias}_at", move.at), (f"{move.alias}_by", move.actor),
                       (f"{move.alias}_release_run", run.info.run_id)):
        reg.client.set_model_version_tag(move.name, str(move.to_version), key, value)
    return move


def _history(reg: _Registry, name: str) -> list[AliasMove]:
    from mlflow.exceptions import MlflowException

    try:
        exp = reg.client.get_experiment_by_name(RELEASES_EXPERIMENT)
    except MlflowException:
        exp = None
    if exp is None:
        return []
    quoted = name.replace("'", "\\'")
    runs, token = [], None
    while True:
        page = reg.client.search_runs([exp.experiment_id], filter_string=f"tags.model = '{quoted}'",
                                      max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    moves = []
    for r in runs:
        t = r.data.tags
        if r.info.status != "FINISHED" or "to_version" not in t:
            continue
        moves.append((t.get("at", ""), r.info.start_time or 0, AliasMove(
            name=t["model"], alias=t["alias"], action=t.get("action", ""), actor=t.get("actor", ""),
            at=t.get("at", ""), reason=t.get("reason", ""), to_version=int(t["to_version"]),
            from_version=int(t["from_version"]) if t.get("from_version") else None)))
    return [m for _, _, m in sorted(moves, key=lambda x: (x[0], x[1]))]


def history(cfg: Config, name: str, root: Path = Path("."), alias: str | None = None) -> list[AliasMove]:
    """Every recorded alias move of a registered model (or engine name), oldest first."""
    name = _resolve_name(cfg, name)
    reg = _Registry(cfg, root)
    with _mlflow_errors(reg.uri):
        moves = _history(reg, name)
    return [m for m in moves if alias is None or m.alias == alias]


def _production_stack(moves: list[AliasMove]) -> list[int]:
    """Production versions as a stack: promote pushes, rollback pops back to the one below."""
    stack: list[int] = []
    for m in moves:
        if m.alias != PRODUCTION:
            continue
        if m.action == "rollback" and len(stack) >= 2 and stack[-2] == m.to_version:
            stack.pop()
        else:
            stack.append(m.to_version)
    return stack


# ---------------------------------------------------------------------------------------------- register
def _read_validation(engine_name: str, manifest: dict[str, Any], root: Path, path: Path | None = None) -> dict[str, Any]:
    path = path or paths.validation(engine_name, root) / VALIDATION_FILE
    try:
        v = json.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path}: missing; {engine_name} has not been validated",
                        f"run the validation first (dvc repro validate@{engine_name})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not valid JSON ({e})", f"rerun dvc repro -f validate@{engine_name}") from None
    if not isinstance(v, dict) or v.get("verdict") not in ("pass", "fail") or not isinstance(v.get("metrics", {}), dict):
        raise KilnError(f"{path}: not a validation result (needs verdict pass|fail and a metrics mapping)",
                        f"rerun dvc repro -f validate@{engine_name}")
    if v.get("engine") != engine_name:
        raise KilnError(f"{path}: validates {v.get('engine')!r}, not {engine_name!r}",
                        f"rerun dvc repro -f validate@{engine_name}")
    if v.get("engine_manifest_xxh3_128") != identity_digest(manifest):
        raise KilnError(f"{path}: validated a different build of {engine_name} (manifest digest "
                        f"{v.get('engine_manifest_xxh3_128')}, engine is {identity_digest(manifest)})",
                        f"the engine changed since validation; run dvc repro validate@{engine_name}")
    return v


def _read_bench(model: str, engine_name: str, root: Path) -> dict[str, Any]:
    path = paths.bench(model, root) / BENCH_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not valid JSON ({e})", f"rerun dvc repro -f bench@{model}") from None
    entry = (data.get("engines") or {}).get(engine_name) if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else {}


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _read_kind(mpath: Path, kind: str, name: str, stage: str) -> dict[str, Any]:
    manifest = read_manifest(mpath)
    if manifest.get("kind") != kind or manifest.get("name") != name:
        raise KilnError(f"{mpath}: describes {manifest.get('kind')} {manifest.get('name')!r}, not {kind} {name!r}",
                        f"rebuild it (dvc repro -f {stage})")
    return manifest


def register(cfg: Config, engine_name: str, root: Path = Path(".")) -> Receipt:
    """register@<engine>: log + register the engine once per content digest; write the receipt."""
    spec = cfg.engine(engine_name)
    root = Path(root)
    engine_dir = paths.engine(engine_name, root)
    mpath = manifest_path(engine_dir, engine_name)
    manifest = _read_kind(mpath, "engine", engine_name, f"compile@{engine_name}")
    for key in ("model", "target", "precision"):
        if manifest.get(key) != getattr(spec, key):
            raise KilnError(f"{mpath}: {key} is {manifest.get(key)!r}, params.yaml says {getattr(spec, key)!r}",
                            f"the engine is stale; rebuild it (dvc repro compile@{engine_name})")
    # Only the engine's own files: its inputs may legitimately be absent on a runner that pulled just the engine.
    if problems := verify_manifest(mpath):
        raise GateFailed(f"{engine_name}: engine files do not match their manifest: " + "; ".join(problems),
                         f"rebuild it (dvc repro -f compile@{engine_name}) or restore it (dvc checkout)")
    validation = _read_validation(engine_name, manifest, root)
    bench = _read_bench(spec.model, engine_name, root)

    name, digest, ident = model_name(engine_name), engine_digest(manifest), identity_digest(manifest)
    reg = _Registry(cfg, root)
    with _mlflow_errors(reg.uri):
        existing = reg.client.search_model_versions(f"name = '{name}' and tags.sha256 = '{digest}'")
        if existing:
            version = min(_version_int(v.version) for v in existing)
            receipt = Receipt(name, version, digest, _redact(reg.uri), new=False)
        else:
            version = _log_and_register(reg, cfg, spec, name, engine_dir, mpath, manifest, digest, ident,
                                        validation, paths.validation(engine_name, root) / VALIDATION_FILE, bench)
            receipt = Receipt(name, version, digest, _redact(reg.uri), new=True)
    write_json_atomic(paths.receipt(engine_name, root), receipt.to_json())
    return receipt


def register_index(cfg: Config, size: int, root: Path = Path(".")) -> Receipt:
    """register-index@<size>: the chosen FAISS index of a gallery, as registered model `kiln-gallery-<size>`.

    Same rules as engines: manifest (kind "index") must verify, the gate verdict (match@<size>'s validation.json)
    must be about this very build, and registration is idempotent by the files' sha256. The curve row of the
    chosen index (recall, latency, bytes) is logged as its bench metrics.
    """
    from pipeline.stages.matching import VALIDATION_FILE as GATE_FILE, index_name

    if cfg.matching is None or size not in cfg.matching.sizes:
        raise KilnError(f"gallery size {size} is not in params.yaml matching.gallery_sizes",
                        "add it there (dvc.yaml builds one stage per size)")
    root, name = Path(root), index_name(size)
    index_dir = paths.index(name, root)
    mpath = manifest_path(index_dir, name)
    manifest = _read_kind(mpath, "index", name, f"match@{size}")
    if problems := verify_manifest(mpath):
        raise GateFailed(f"{name}: index files do not match their manifest: " + "; ".join(problems),
                         f"rebuild it (dvc repro -f match@{size}) or restore it (dvc checkout)")
    gate_path = paths.matching(name, root) / GATE_FILE
    validation = _read_validation(name, manifest, root, gate_path)
    spec = EngineSpec(name, manifest.get("model") or "embedder", manifest.get("target") or "faiss-cpu",
                      manifest.get("precision") or "fp32", None)
    bench = {k: v for k, v in (validation.get("metrics") or {}).items() if k.startswith(("p50", "p99", "build", "bytes"))}
    rname, digest, ident = model_name(name), engine_digest(manifest), identity_digest(manifest)
    reg = _Registry(cfg, root)
    with _mlflow_errors(reg.uri):
        existing = reg.client.search_model_versions(f"name = '{rname}' and tags.sha256 = '{digest}'")
        if existing:
            receipt = Receipt(rname, min(_version_int(v.version) for v in existing), digest, _redact(reg.uri), False)
        else:
            version = _log_and_register(reg, cfg, spec, rname, index_dir, mpath, manifest, digest, ident, validation,
                                        gate_path, bench, kind="index")
            receipt = Receipt(rname, version, digest, _redact(reg.uri), new=True)
    write_json_atomic(paths.receipt(name, root), receipt.to_json())
    return receipt


def _tags(spec: EngineSpec, manifest: dict[str, Any], digest: str, ident: str, verdict: str) -> dict[str, str]:
    source = manifest.get("source") or {}
    tags = {"engine": spec.name, "model": spec.model, "target": spec.target, "precision": spec.precision,
            "sha256": digest, "xxh3_128": ident, "git_commit": str(source.get("git_commit", "unknown")),
            "dirty": str(bool(source.get("dirty", True))).lower(),
            "params_sha256": str(source.get("params_sha256", "")), "validation": verdict}
    if spec.recipe:
        tags["recipe"] = spec.recipe
    tags.update(_flat("toolchain", manifest.get("toolchain") or {}))
    return tags


def _params(manifest: dict[str, Any]) -> dict[str, str]:
    params = _flat("build", manifest.get("build") or {})
    params.update(_flat("toolchain", manifest.get("toolchain") or {}))
    for ref in manifest.get("inputs") or []:
        params[f"input.{ref.get('role', 'input')}"] = str(ref.get("xxh3_128", ""))
    params["params_sha256"] = str((manifest.get("source") or {}).get("params_sha256", ""))
    return params


def _log_and_register(reg: _Registry, cfg: Config, spec: EngineSpec, name: str, engine_dir: Path, mpath: Path,
                      manifest: dict[str, Any], digest: str, ident: str, validation: dict[str, Any],
                      validation_path: Path, bench: dict[str, Any], kind: str = "engine") -> int:
    from mlflow.entities import LoggedModelOutput, Metric, Param
    from mlflow.exceptions import MlflowException

    client = reg.client
    eid = reg.experiment_id(cfg.register.experiment)
    tags = _tags(spec, manifest, digest, ident, validation["verdict"])
    params = _params(manifest)
    run_tags = dict(tags)
    if stage := os.environ.get("DVC_STAGE"):
        run_tags["dvc_stage"] = stage
    run = client.create_run(eid, run_name=spec.name, tags=run_tags)
    run_id, model_id = run.info.run_id, None
    try:
        client.log_batch(run_id, params=[Param(k, v) for k, v in sorted(params.items())])
        lm = client.create_logged_model(eid, name=spec.name, source_run_id=run_id, tags=tags, params=params,
                                        model_type=f"kiln-{kind}")
        model_id = lm.model_id
        with tempfile.TemporaryDirectory(prefix="kiln-register-") as tmp:
            stage = Path(tmp)
            for entry in manifest["files"]:
                _link_or_copy(engine_dir / entry["path"], stage / entry["path"])
            _link_or_copy(mpath, stage / mpath.name)
            _link_or_copy(validation_path, stage / KILN_DIR / VALIDATION_FILE)
            if bench:
                write_json_atomic(stage / KILN_DIR / BENCH_FILE, {"engine": spec.name, "metrics": bench})
            client.log_model_artifacts(model_id, str(stage))
        client.finalize_logged_model(model_id, "READY")
        ts = int(time.time() * 1000)
        values = {**_metrics("validation", validation.get("metrics") or {}), **_metrics("bench", bench)}
        if values:
            client.log_batch(run_id, metrics=[Metric(k, v, ts, 0, model_id=model_id, run_id=run_id)
                                              for k, v in sorted(values.items())])
        client.log_outputs(run_id, [LoggedModelOutput(model_id, step=0)])
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        try:
            if model_id:
                client.finalize_logged_model(model_id, "FAILED")
            client.set_terminated(run_id, "FAILED")
        except MlflowException:
            pass
        raise

    try:
        client.create_registered_model(name, tags={"kind": kind, "model": spec.model, "target": spec.target,
                                                   "precision": spec.precision},
                                       description=f"Kiln {kind} {spec.name}")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    # = mlflow.register_model(f"models:/{model_id}", name, tags=tags), minus its global client and its chatter
    mv = client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id, tags=tags,
                                     model_id=model_id)
    version = _version_int(mv.version)
    previous = reg.aliases(name).get(CANDIDATE)
    client.set_registered_model_alias(name, CANDIDATE, str(version))
    _record(reg, AliasMove(name, CANDIDATE, previous, version, "register", actor_name(), _now(),
                           f"registered {spec.name} sha256 {digest[:12]} (validation {validation['verdict']})"))
    return version


# ---------------------------------------------------------------------------------------------- promote / rollback
def check_version(reg: _Registry, name: str, version: int) -> str:
    """Gate one version for production: verdict pass, and stored files + manifest unchanged. Returns a summary."""
    mv = reg.version(name, version)
    tags = mv.tags or {}
    verdict = tags.get("validation")
    if verdict != "pass":
        raise GateFailed(f"{name} v{version}: validation verdict is {verdict!r}, not 'pass'; refusing to promote",
                         "fix the engine, rebuild and validate it, register the new version, and promote that")
    engine = tags.get("engine") or name.removeprefix(_PREFIX)
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        _, manifest = _download_verified(reg, name, version, engine, tags, Path(tmp))
        return f"validation pass, {len(manifest['files'])} file(s) verified"


def _download_verified(reg: _Registry, name: str, version: int, engine: str, tags: dict[str, str],
                       dst: Path) -> tuple[Path, dict[str, Any]]:
    """Download a version's files into `dst`; check them against the stored manifest and the manifest against the
    version's digest tags. Returns (local directory, manifest); any mismatch is a GateFailed."""
    from mlflow.artifacts import download_artifacts

    for key in ("sha256", "xxh3_128"):
        if not tags.get(key):
            raise GateFailed(f"{name} v{version}: no {key} tag; it was not registered by kiln",
                             "register the engine with `kiln register`")
    local = Path(download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dst),
                                    tracking_uri=reg.uri, registry_uri=reg.uri))
    mpath = manifest_path(local, engine)
    if not mpath.is_file():
        raise GateFailed(f"{name} v{version}: the stored model has no {mpath.name}",
                         "the artifact store was altered; re-register the engine")
    try:
        manifest = read_manifest(mpath)
    except KilnError as e:
        raise GateFailed(f"{name} v{version}: stored manifest unreadable: {e.message}",
                         "the artifact store was altered; re-register the engine") from None
    problems = verify_manifest(mpath)
    if (d := engine_digest(manifest)) != tags["sha256"]:
        problems.append(f"stored manifest's engine digest is {d}, the version's sha256 tag is {tags['sha256']}")
    if (d := identity_digest(manifest)) != tags["xxh3_128"]:
        problems.append(f"stored manifest's identity digest is {d}, the version's xxh3_128 tag is {tags['xxh3_128']}")
    if problems:
        shown = [p.replace(str(local) + os.sep, "") for p in problems]
        raise GateFailed(f"{name} v{version}: stored artifacts do not match their checksums (tampered or "
                         f"corrupted): " + "; ".join(shown),
                         "do not ship it; re-register the engine from a verified build (kiln verify, "
                         "kiln register)")
    return local, manifest


def fetch_release(cfg: Config, engine_name: str, dst: Path, root: Path = Path(".")) -> tuple[Path, int]:
    """The `production` version of an engine, downloaded into `dst` and verified. Returns (engine dir, version)."""
    reg = _Registry(cfg, root)
    name = _resolve_name(cfg, engine_name)
    with _mlflow_errors(reg.uri):
        reg.require_model(name)
        version = reg.aliases(name).get(PRODUCTION)
        if version is None:
            raise KilnError(f"{name}: no production version", f"promote one first: kiln promote {name} VERSION")
        tags = reg.version(name, version).tags or {}
        local, _ = _download_verified(reg, name, version, engine_name, tags, Path(dst))
    return local, version


def _move_production(reg: _Registry, name: str, version: int, action: str, actor: str | None,
                     reason: str | None, summary: str) -> AliasMove:
    current = reg.aliases(name).get(PRODUCTION)
    who, at = actor_name(actor), _now()
    if current == version:
        return AliasMove(name, PRODUCTION, current, version, action, who, at, reason or "already production",
                         changed=False)
    reg.client.set_registered_model_alias(name, PRODUCTION, str(version))
    return _record(reg, AliasMove(name, PRODUCTION, current, version, action, who, at,
                                  reason or f"{action} v{version}: {summary}"))


def promote(cfg: Config, name: str, version: int | str, root: Path = Path("."), actor: str | None = None,
            reason: str | None = None) -> AliasMove:
    """Move `production` to `version` of registered model `name` (or engine name) after gating it."""
    name = _resolve_name(cfg, name)
    try:
        version = int(str(version).removeprefix("v"))
    except ValueError:
        raise KilnError(f"version must be a number, got {version!r}", "e.g. kiln promote NAME 3") from None
    reg = _Registry(cfg, root)
    with _mlflow_errors(reg.uri):
        reg.require_model(name)
        summary = check_version(reg, name, version)
        return _move_production(reg, name, version, "promote", actor, reason, summary)


def rollback(cfg: Config, name: str, root: Path = Path("."), actor: str | None = None,
             reason: str | None = None) -> AliasMove:
    """Move `production` back to the version it held before the current one (per the recorded history)."""
    name = _resolve_name(cfg, name)
    reg = _Registry(cfg, root)
    with _mlflow_errors(reg.uri):
        reg.require_model(name)
        stack = _production_stack(_history(reg, name))
        current = reg.aliases(name).get(PRODUCTION)
        if current is None:
            raise KilnError(f"{name}: nothing is in production, so there is nothing to roll back",
                            f"promote a version first (kiln promote {name} VERSION)")
        if not stack or stack[-1] != current:
            raise KilnError(f"{name}: production is v{current}, but the release history says "
                            f"{'v' + str(stack[-1]) if stack else 'nothing'}; the alias was moved outside kiln",
                            f"promote the intended version explicitly (kiln promote {name} VERSION)")
        if len(stack) < 2:
            raise KilnError(f"{name}: v{current} is the first production version; there is no earlier one",
                            f"promote a specific version instead (kiln promote {name} VERSION)")
        target = stack[-2]
        summary = check_version(reg, name, target)
        return _move_production(reg, name, target, "rollback", actor, reason, summary)
