"""Aliases of registered versions: the verified download, promote, rollback, history.

* Every alias move (candidate on register, promote, rollback) is appended to the experiment `kiln-releases` as one
  run tagged with who, when, from, to, alias, action and reason — MLflow keeps no alias history — and moves of one
  model run under its registry lock, so concurrent promotes and rollbacks serialize and the history stays a
  consistent stack (promote pushes, rollback pops). A move is recorded before it is made and marked done after
  (`move_alias`), so a kill at any point is completed or undone by the next command (`settle`).
* A version is bound to what it was registered for: its registered name is its run's artifact's, its source the
  logged model of that run, and what is downloaded comes from that model (`logged_binding`). Repointing a version's
  source, run or storage location at another engine — an edit any registry user can make — is refused.
* `promote` moves `production` only to a version whose *stored* artifacts prove it: the version's files are
  downloaded and checked against the stored manifest; the manifest, the stored validation.json and its manifest
  against the digests logged as the version's run parameters at registration (run parameters cannot be changed
  afterwards, unlike tags); and the verdict is read from that verified validation.json, never from a tag. Editing
  a tag, a stored file, a manifest or the verdict is refused.
* A version whose bench verdict is `not-faster-here` on a host class it was benched on (run parameter
  `kiln.bench.<host class>.verdict`) is promoted with that said in the move's record and output
  (`not_faster_note`): it is correct, only not worth its INT8 there — where it is deployed decides, so promote
  marks it instead of refusing it.
* A built-only version (verdict `not-run`: no runtime on the build host) is promoted only once a host with the
  runtime validated it: `kiln validate-release` (pipeline/release/revalidate.py) logs that validation as a run of the
  experiment `kiln-validations`, its digests as run parameters; promote checks it exactly as the stored one.
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import paths
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import artifact_digest, check_files, identity_digest, manifest_path, read_manifest
from pipeline.registry.client import Registry, errors, is_lock, redact, registered_name

if TYPE_CHECKING:
    from pipeline.config import Config

RELEASES_EXPERIMENT = "kiln-releases"
VALIDATIONS_EXPERIMENT = "kiln-validations"     # validations of registered versions made on another host
PRODUCTION, CANDIDATE, BUILT = "production", "candidate", "built"
RETIRE = "retire"            # a move that removes an alias (a part the production system no longer runs)
KILN_DIR = "kiln"            # validation.json, its manifest, bench metrics and the build record inside a version
PARAM = "kiln."              # run parameters holding the digests a version is checked against
SYSTEMS = "kiln-system-"     # registered face systems (pipeline/registry/systems.py)
MAX_RECORD = 6000            # MLflow's longest parameter value


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


def actor_name(actor: str | None = None) -> str:
    if actor:
        return actor
    if env := os.environ.get("KILN_ACTOR"):
        return env
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 — no passwd entry (containers) and no LOGNAME/USER
        return "unknown"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


# ---------------------------------------------------------------------------------------------- history
# Record, then move: a move is first written as a RUNNING run of `kiln-releases` (its intent), then the alias is
# set, then the version is stamped and the run marked FINISHED. A kill anywhere in between leaves an unfinished
# intent that the next command on the model settles under its lock (`settle`): finished if the alias did move,
# KILLED if it did not. History lists FINISHED moves only, so the alias and the history always agree.
MOVE = PARAM + "move."        # a move's fields as run parameters: the record (its tags are for search and display)


def _intend(reg: Registry, move: AliasMove, record: dict[str, str] | None = None) -> str:
    """The move's run, RUNNING: its fields as tags (searchable) and as parameters (immutable: what history reads),
    with `record` (what the decision used, e.g. a gallery check and its limits) as parameters beside them."""
    from mlflow.entities import Param

    eid = reg.experiment_id(RELEASES_EXPERIMENT)
    tags = {"model": move.name, "alias": move.alias, "action": move.action, "to_version": str(move.to_version),
            "from_version": "" if move.from_version is None else str(move.from_version), "actor": move.actor,
            "at": move.at, "reason": move.reason}
    run = reg.client.create_run(eid, run_name=f"{move.action} {move.name}@{move.alias} → v{move.to_version}",
                                tags=tags)
    params = {MOVE + k: v for k, v in tags.items()} | (record or {})
    reg.client.log_batch(run.info.run_id, params=[Param(k, v[:MAX_RECORD]) for k, v in sorted(params.items())])
    return run.info.run_id


def _finish(reg: Registry, move: AliasMove, run_id: str) -> None:
    stamps = ((f"{move.alias}_at", move.at), (f"{move.alias}_by", move.actor), (f"{move.alias}_release_run", run_id))
    for key, value in () if move.action == RETIRE else stamps:     # a removal stamps no version
        reg.client.set_model_version_tag(move.name, str(move.to_version), key, value)
    reg.client.set_terminated(run_id, "FINISHED")                  # last: the move now counts as recorded


def move_alias(reg: Registry, move: AliasMove, record: dict[str, str] | None = None) -> AliasMove:
    """Move an alias and record it, so that a kill at any point leaves a state `settle` completes or undoes.
    Call under the model's lock, after `settle`."""
    run_id = _intend(reg, move, record)
    reg.client.set_registered_model_alias(move.name, move.alias, str(move.to_version))
    _finish(reg, move, run_id)
    return move


def _runs(reg: Registry, name: str, status: str | None = None) -> list:
    exp = reg.client.get_experiment_by_name(RELEASES_EXPERIMENT)
    if exp is None:
        return []
    quoted = name.replace("'", "\\'")
    query = f"tags.model = '{quoted}'" + (f" and attributes.status = '{status}'" if status else "")
    runs, token = [], None
    while True:
        page = reg.client.search_runs([exp.experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    return runs


def _fields(run) -> dict[str, str] | None:
    """A move run's fields: its parameters (immutable) — or, for a run recorded before moves had them, its tags.
    None when its tags name another move than its parameters (tags edited through the registry): not history."""
    p, t = run.data.params, run.data.tags
    if MOVE + "to_version" not in p:
        return t if "to_version" in t else None
    fields = {k[len(MOVE):]: v for k, v in p.items() if k.startswith(MOVE)}
    if any(t.get(k) != fields.get(k) for k in ("model", "alias", "to_version")):
        return None
    return fields


def _move_of(t: dict[str, str]) -> AliasMove:
    return AliasMove(name=t["model"], alias=t["alias"], action=t.get("action", ""), actor=t.get("actor", ""),
                     at=t.get("at", ""), reason=t.get("reason", ""), to_version=int(t["to_version"]),
                     from_version=int(t["from_version"]) if t.get("from_version") else None)


def settle(reg: Registry, name: str) -> int:
    """Complete or undo the moves of `name` a killed kiln left unfinished; returns how many. Under the model's lock
    (no live kiln has a move of it in flight then)."""
    pending = [r for r in _runs(reg, name, "RUNNING") if "to_version" in r.data.tags]
    if not pending:
        return 0
    current = reg.aliases(name)
    for r in sorted(pending, key=lambda r: (r.data.tags.get("at", ""), r.info.start_time or 0)):
        if (fields := _fields(r)) is None:
            reg.client.set_terminated(r.info.run_id, "KILLED")
            continue
        move = _move_of(fields)
        done = move.alias not in current if move.action == RETIRE else current.get(move.alias) == move.to_version
        if done:
            _finish(reg, move, r.info.run_id)                       # the alias moved: the record completes
        else:
            reg.client.set_terminated(r.info.run_id, "KILLED")      # it never moved: not history
    return len(pending)


def moves(reg: Registry, name: str) -> list[AliasMove]:
    out = []
    for r in _runs(reg, name):
        if r.info.status != "FINISHED" or (t := _fields(r)) is None or t.get("model") != name:
            continue
        out.append((t.get("at", ""), r.info.start_time or 0, _move_of(t)))
    return [m for _, _, m in sorted(out, key=lambda x: (x[0], x[1]))]


def recorded(reg: Registry, name: str, version: int, key: str) -> dict[str, str]:
    """The parameters under `kiln.<key>.` of the newest recorded production move of `name` to `version` that has
    them (e.g. the gallery check a system promotion made): {} when none."""
    head, found = f"{PARAM}{key}.", []
    for r in _runs(reg, name, "FINISHED"):
        t = _fields(r)
        if t is None or t.get("model") != name or t.get("alias") != PRODUCTION or t.get("to_version") != str(version):
            continue
        if rec := {k[len(head):]: v for k, v in r.data.params.items() if k.startswith(head)}:
            found.append((t.get("at", ""), r.info.start_time or 0, rec))
    return max(found, key=lambda f: (f[0], f[1]))[2] if found else {}


def production_stack(history: list[AliasMove]) -> list[int]:
    """Production versions as a stack: promote pushes, rollback pops back to the one below."""
    stack: list[int] = []
    for m in history:
        if m.alias != PRODUCTION:
            continue
        if m.action == RETIRE:                  # nothing of this model is in production any more
            stack.clear()
        elif m.action == "rollback" and len(stack) >= 2 and stack[-2] == m.to_version:
            stack.pop()
        else:
            stack.append(m.to_version)
    return stack


OUTSIDE = "outside kiln"       # the action of a move kiln did not record (`history(..., gaps=True)`)


def with_gaps(name: str, found: list[AliasMove], current: dict[str, int]) -> list[AliasMove]:
    """The recorded moves (oldest first) with each move kiln did not record marked as one of action OUTSIDE: where a
    move starts from another version than the alias's previous recorded move left it at, and where the alias now
    points elsewhere than the last recorded move left it (to_version None: removed)."""
    out: list[AliasMove] = []
    last: dict[str, int | None] = {}
    for m in found:
        if m.alias in last and m.from_version != last[m.alias]:
            out.append(AliasMove(name, m.alias, last[m.alias], m.from_version, OUTSIDE, "?", "",   # type: ignore
                                 "not recorded by kiln: the alias was moved outside kiln between these two moves"))
        out.append(m)
        last[m.alias] = None if m.action == RETIRE else m.to_version
    for alias, was in last.items():
        if current.get(alias) != was:
            out.append(AliasMove(name, alias, was, current.get(alias), OUTSIDE, "?", "now",     # type: ignore
                                 "not recorded by kiln: the alias was moved outside kiln after the last recorded "
                                 "move"))
    return out


def history(cfg: Config, name: str, root: Path = Path("."), alias: str | None = None,
            gaps: bool = False) -> list[AliasMove]:
    """Every recorded alias move of a registered model (or engine name), oldest first; with `gaps`, the moves made
    outside kiln marked where they fall (`with_gaps`)."""
    name = registered_name(cfg, name)
    reg = Registry(cfg, root)
    with errors(reg.uri):
        if any("to_version" in r.data.tags for r in _runs(reg, name, "RUNNING")):   # a move in flight or killed
            with reg.lock(name):
                settle(reg, name)
        found = moves(reg, name)
        if gaps and found:                  # no recorded move, no gap to mark (and maybe no registered model yet)
            found = with_gaps(name, found, reg.aliases(name))
    return [m for m in found if alias is None or m.alias == alias]


# ---------------------------------------------------------------------------------------------- verified download
@dataclass(frozen=True)
class Verified:
    directory: Path           # the downloaded version
    manifest: dict[str, Any]  # the artifact's manifest, verified
    verdict: dict[str, Any]   # its validation.json, verified
    params: dict[str, str]    # the immutable digests it was checked against


def download_verified(reg: Registry, name: str, version: int, dst: Path) -> Verified:
    """Download a version into `dst` and prove it: that it is bound to what it was registered for (`logged_binding`),
    files vs stored manifest, manifest and verdict vs the digests logged as run parameters at registration. Any
    mismatch is a GateFailed naming the item."""
    import json

    from mlflow.artifacts import download_artifacts

    mv = reg.version(name, version)
    params = dict(reg.client.get_run(mv.run_id).data.params) if mv.run_id else {}
    need = ("sha256", "manifest_xxh3_128", "validation_manifest_xxh3_128", "artifact")
    if missing := [k for k in need if PARAM + k not in params]:
        raise GateFailed(f"{name} v{version}: its run has no {PARAM}{missing[0]} parameter; it was not registered by "
                         "this kiln", "register the engine again with `kiln register` (or kiln registry sync)")
    model_id = logged_binding(reg, name, version, mv, params)
    # from the logged model checked above, not the version's own storage location (a column of its own)
    local = Path(download_artifacts(artifact_uri=f"models:/{model_id}", dst_path=str(dst),
                                    tracking_uri=reg.engine_uri, registry_uri=reg.engine_uri))
    artifact = params[PARAM + "artifact"]
    problems: list[str] = []

    def read(path: Path, what: str) -> dict[str, Any]:
        try:
            return read_manifest(path)
        except KilnError as e:
            why = e.message.replace(str(local) + os.sep, "")
            raise GateFailed(f"{name} v{version}: stored {what} unreadable: {why}",
                             "the artifact store was altered; do not ship it") from None

    manifest = read(manifest_path(local, artifact), "manifest")
    if (manifest.get("name"), manifest.get("kind")) != (artifact, params.get(PARAM + "kind", manifest.get("kind"))):
        raise GateFailed(f"{name} v{version}: the stored manifest describes {str(manifest.get('kind'))[:40]} "
                         f"{str(manifest.get('name'))[:200]!r}, but the version was registered for {artifact!r}",
                         _REBOUND)
    problems += check_files(manifest_path(local, artifact), manifest)
    if (d := artifact_digest(manifest)) != params[PARAM + "sha256"]:
        problems.append(f"stored manifest's content digest is {d}, registered {params[PARAM + 'sha256']}")
    if (d := identity_digest(manifest)) != params[PARAM + "manifest_xxh3_128"]:
        problems.append(f"stored manifest's identity digest is {d}, registered {params[PARAM + 'manifest_xxh3_128']}")
    vdir = local / KILN_DIR
    vmanifest = read(manifest_path(vdir, artifact), "validation manifest")
    problems += check_files(manifest_path(vdir, artifact), vmanifest)
    if (d := identity_digest(vmanifest)) != params[PARAM + "validation_manifest_xxh3_128"]:
        problems.append(f"stored validation manifest's digest is {d}, registered "
                        f"{params[PARAM + 'validation_manifest_xxh3_128']}")
    try:
        verdict = json.loads((vdir / paths.VALIDATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GateFailed(f"{name} v{version}: stored {paths.VALIDATION_FILE} unreadable ({e})",
                         "the artifact store was altered; do not ship it") from None
    if verdict.get("engine_manifest_xxh3_128") != identity_digest(manifest):
        problems.append("the stored validation is about another build (engine digest mismatch)")
    refs = [r.get("xxh3_128") for r in vmanifest.get("inputs", []) if r.get("role") in ("engine", "index")]
    if identity_digest(manifest) not in refs:
        problems.append("the stored validation manifest does not reference this artifact")
    if problems:
        shown = [p.replace(str(local) + os.sep, "") for p in problems]
        raise GateFailed(f"{name} v{version}: stored artifacts do not match their registered digests (tampered or "
                         "corrupted): " + "; ".join(shown),
                         "do not ship it; register the engine again from a verified build (kiln verify, kiln register)")
    return Verified(local, manifest, verdict, params)


_REBOUND = ("do not ship it: the version was repointed at another artifact (an edit of its source or run); register "
            "the intended engine again (kiln register) and promote that version")


def logged_binding(reg: Registry, name: str, version: int, mv, params: dict[str, str]) -> str:
    """The logged model a version is bound to, refused unless the binding is the one registration made: the
    registered name is the run's artifact's, the version's source is a logged model whose source run is the
    version's run, the registry downloads it from that model's location, and its digest tags are its run's."""
    from mlflow.exceptions import MlflowException

    artifact = params[PARAM + "artifact"]
    paths.slug(artifact, "stored artifact name")
    where = f"{name} v{version}"
    if registered_name(None, artifact) != name:
        raise GateFailed(f"{where}: its run {mv.run_id} registered {artifact[:200]!r}, which belongs to "
                         f"{registered_name(None, artifact)}, not {name}", _REBOUND)
    source = str(mv.source or "")
    model_id = source.removeprefix("models:/")
    if not source.startswith("models:/") or not model_id or "/" in model_id:
        raise GateFailed(f"{where}: its source {source[:200]!r} is not the logged model kiln registered", _REBOUND)
    try:
        lm = reg.client.get_logged_model(model_id)
    except MlflowException:
        raise GateFailed(f"{where}: its source {source[:200]!r} names no logged model in this registry",
                         _REBOUND) from None
    if lm.source_run_id != mv.run_id:
        raise GateFailed(f"{where}: its source {source[:200]} was logged by run {lm.source_run_id}, but the version "
                         f"names run {mv.run_id}", _REBOUND)
    if (at := reg.client.get_model_version_download_uri(name, str(version))) != lm.artifact_location:
        raise GateFailed(f"{where}: the registry stores it at {str(at)[:200]}, not at its logged model's location "
                         f"{str(lm.artifact_location)[:200]}", _REBOUND)
    tags = mv.tags or {}
    for tag, param in (("sha256", "sha256"), ("xxh3_128", "manifest_xxh3_128")):
        if tags.get(tag) != params[PARAM + param]:
            raise GateFailed(f"{where}: its {tag} tag {str(tags.get(tag))[:64]} is not its run's digest "
                             f"{params[PARAM + param]}", _REBOUND)
    return model_id


def attached_verdicts(reg: Registry, name: str, version: int, manifest: dict[str, Any], dst: Path
                      ) -> list[tuple[str, dict[str, Any]]]:
    """Validations of this exact version made on another host (`kiln validate-release`), each verified against its
    run's parameters: [(run id, validation.json)]; a run that does not verify is left out."""
    import json

    from mlflow.artifacts import download_artifacts

    exp = reg.client.get_experiment_by_name(VALIDATIONS_EXPERIMENT)
    if exp is None:
        return []
    ident = identity_digest(manifest)
    found = []
    for run in reg.client.search_runs([exp.experiment_id], filter_string=f"tags.model = '{name}'", max_results=1000):
        p = run.data.params
        if run.info.status != "FINISHED" or p.get(PARAM + "manifest_xxh3_128") != ident \
                or p.get(PARAM + "version") != str(version) or p.get(PARAM + "registered_model") != name:
            continue
        local = Path(download_artifacts(run_id=run.info.run_id, artifact_path=KILN_DIR, dst_path=str(dst / run.info
                                                                                                   .run_id),
                                        tracking_uri=reg.engine_uri))
        mfiles = list(local.glob("*.manifest.json"))
        if len(mfiles) != 1:
            continue
        try:
            vm = read_manifest(mfiles[0])
        except KilnError:
            continue
        if check_files(mfiles[0], vm) or identity_digest(vm) != p.get(PARAM + "validation_manifest_xxh3_128"):
            continue
        doc = json.loads((local / paths.VALIDATION_FILE).read_text(encoding="utf-8"))
        if doc.get("engine_manifest_xxh3_128") == ident:
            found.append((run.info.run_id, doc))
    return found


def check_version(reg: Registry, name: str, version: int) -> str:
    """Gate one version for production: every stored file verified, and its verified verdict is pass — the one
    stored at registration or, for a built-only version, one attached later by a host with the runtime."""
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        return gate_verified(reg, name, version, download_verified(reg, name, version, Path(tmp)), Path(tmp))


def gate_verified(reg: Registry, name: str, version: int, v: Verified, scratch: Path) -> str:
    """check_version on a version already downloaded and verified (`v`); `scratch` holds attached verdicts."""
    verdict = v.verdict.get("verdict")
    tag = (reg.version(name, version).tags or {}).get("validation")
    note = "" if tag in (None, verdict) else f" (its `validation` tag says {tag!r}; the stored verdict rules)"
    if verdict == "not-run":
        passed = [rid for rid, doc in attached_verdicts(reg, name, version, v.manifest, scratch / "attached")
                  if doc.get("verdict") == "pass"]
        if not passed:
            raise GateFailed(f"{name} v{version}: built only — its build host could not run it "
                             f"({v.verdict.get('not_run', 'no runtime')}), and no host with the runtime has "
                             "validated it; refusing to promote",
                             f"on a host with the runtime: kiln validate-release {name} {version}")
        return f"validation pass attached by run {passed[-1]} (the build host could not run it)"
    if verdict != "pass":
        raise GateFailed(f"{name} v{version}: its stored validation verdict is {verdict!r}, not "
                         "'pass'; refusing to promote", "fix the engine, rebuild and validate it, register the new "
                         "version, and promote that")
    return f"validation pass (stored, digest-checked), {len(v.manifest['files'])} file(s) verified{note}"


def fetch_release(cfg: Config, engine_name: str, dst: Path, root: Path = Path(".")) -> tuple[Path, int]:
    """The `production` version of an engine, downloaded into `dst` and verified. Returns (engine dir, version)."""
    reg = Registry(cfg, root)
    name = registered_name(cfg, engine_name)
    with errors(reg.uri):
        reg.require_model(name)
        version = reg.aliases(name).get(PRODUCTION)
        if version is None:
            raise KilnError(f"{name}: no production version", f"promote one first: kiln promote {name} VERSION")
        v = download_verified(reg, name, version, Path(dst))       # once: the gate reads this verified copy
        with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
            gate_verified(reg, name, version, v, Path(tmp))
    return v.directory, version


# ---------------------------------------------------------------------------------------------- moves
def record_move(reg: Registry, name: str, version: int, action: str, actor: str | None, reason: str | None,
          summary: str, record: dict[str, str] | None = None) -> AliasMove:
    current = reg.aliases(name).get(PRODUCTION)
    who, at = actor_name(actor), now()
    if current == version:
        stack = production_stack(moves(reg, name))
        if stack and stack[-1] == current:
            return AliasMove(name, PRODUCTION, current, version, action, who, at, reason or "already production",
                             changed=False)
        # production was moved without a record (outside kiln, or by a kiln killed before this fix): record it, so
        # the history agrees with the alias and rollback works again
        print(f"kiln: WARNING: {name}: production is v{version} without a record (moved outside kiln); recording it",
              file=sys.stderr)
        return move_alias(reg, AliasMove(name, PRODUCTION, stack[-1] if stack else None, version, action, who, at,
                                         reason or f"recorded: production was already v{version}, moved without a "
                                                   f"record; {summary}"))
    stack = production_stack(moves(reg, name))
    if current != (stack[-1] if stack else None):   # moved (or removed) outside kiln: say so, and record it
        note = (f"production was {'v' + str(current) if current is not None else 'unset'}, but the release history "
                f"says {'v' + str(stack[-1]) if stack else 'none'}: the alias was moved outside kiln")
        print(f"kiln: WARNING: {name}: {note}", file=sys.stderr)
        reason = f"{reason}; {note}" if reason else f"{action} v{version}: {summary}; {note}"
    return move_alias(reg, AliasMove(name, PRODUCTION, current, version, action, who, at,
                                     reason or f"{action} v{version}: {summary}"), record)


def retire(reg: Registry, name: str, actor: str | None, reason: str) -> AliasMove | None:
    """Remove `name`'s production alias, recorded (intent, removal, done: `settle` completes or undoes a kill);
    None when it has none. Call under the model's lock, after `settle`."""
    current = reg.aliases(name).get(PRODUCTION)
    if current is None:
        return None
    move = AliasMove(name, PRODUCTION, current, current, RETIRE, actor_name(actor), now(), reason)
    run_id = _intend(reg, move)
    reg.client.delete_registered_model_alias(name, PRODUCTION)
    _finish(reg, move, run_id)
    return move


def not_faster_note(reg: Registry, name: str, version: int, reason: str | None) -> str | None:
    """`reason` (or None: the default record) with a note when the version's bench verdict is `not-faster-here` on
    a host class it was benched on (an INT8 engine that does not beat its FP32 sibling by bench.int8_min_speedup
    there), read from its run's parameters `kiln.bench.<host class>.verdict` (immutable, unlike the tags)."""
    mv = reg.version(name, version)
    params = reg.client.get_run(mv.run_id).data.params if mv.run_id else {}
    head, tail = PARAM + "bench.", ".verdict"
    slow = sorted(k[len(head):-len(tail)] for k, v in params.items()
                  if k.startswith(head) and k.endswith(tail) and v == "not-faster-here")
    if not slow:
        return reason
    note = (f"not faster here on host class {', '.join(slow)}: this INT8 engine does not beat its FP32 sibling by "
            "bench.int8_min_speedup there")
    return f"{reason}; {note}" if reason else f"promote v{version}; {note}"


# ---------------------------------------------------------------------------------------------- what systems pin
@dataclass(frozen=True)
class Pin:
    """One part of a face system version, as the version's run recorded it (parameters `kiln.part.<model>.*`)."""

    system: str               # kiln-system-<name>
    system_version: int
    model: str
    registered_model: str
    version: int


def pins(reg: Registry, name: str, version: int) -> list[Pin]:
    """The parts a system version pins, from its run's parameters (immutable; its `parts` tag is display only)."""
    mv = reg.version(name, version)
    params = reg.client.get_run(mv.run_id).data.params if mv.run_id else {}
    head, tail = PARAM + "part.", ".registered_model"
    return [Pin(name, int(version), k[len(head):-len(tail)], v, int(params[k[:-len(tail)] + ".version"]))
            for k, v in sorted(params.items()) if k.startswith(head) and k.endswith(tail)]


def production_pins(reg: Registry) -> list[Pin]:
    """Every part of every face system's production version: what production runs."""
    found = reg.client.search_registered_models(filter_string=f"name LIKE '{SYSTEMS}%'", max_results=1000)
    out: list[Pin] = []
    for rm in sorted(found, key=lambda m: m.name):
        if not is_lock(rm) and (v := (rm.aliases or {}).get(PRODUCTION)) is not None:
            out += pins(reg, rm.name, int(str(v)))
    return out


def _guard(reg: Registry, name: str, version: int, action: str, force: bool, reason: str | None
           ) -> tuple[str | None, str | None]:
    """An engine-level move that would change what a production face system runs is refused: the production
    system version is the one truth, and its parts move with it (`kiln promote --system`). `force` (with a reason)
    moves it anyway; the returned reason says so in the move's record. (the reason, a note for the record when no
    production system runs the engine at all: the move changes no deployed system, and says so)"""
    pins = production_pins(reg)
    if not any(p.registered_model == name for p in pins):
        running = sorted({p.system.removeprefix(SYSTEMS) for p in pins})
        note = (f"outside every production system: no production system runs {name} ("
                + (f"production systems: {', '.join(running)}" if running else "no system is in production")
                + "), so this moves no deployed system")     # in the record, so in promote's output line too
        return reason, note
    held = [p for p in pins if p.registered_model == name and p.version != version]
    if not held:
        return reason, None
    p = held[0]
    system = p.system.removeprefix(SYSTEMS)
    if not force:
        raise KilnError(f"{name}: production system {system} v{p.system_version} runs v{p.version} as its {p.model}; "
                        f"refusing to {action} the engine alone to v{version}",
                        f"move the whole system: kiln promote --system {system} VERSION (or --force --reason WHY)")
    if not reason:
        raise KilnError(f"{name}: --force needs --reason (recorded in the history)", "e.g. --reason 'hotfix: …'")
    return f"FORCED past production system {system} v{p.system_version} (which pins v{p.version}): {reason}", None


def _noted(reason: str | None, note: str | None, action: str, version: int, summary: str) -> str | None:
    """The move's reason with the guard's note appended (the default reason spelled out, so neither is lost)."""
    if note is None:
        return reason
    return f"{reason or f'{action} v{version}: {summary}'}; {note}"


def promote(cfg: Config, name: str, version: int | str, root: Path = Path("."), actor: str | None = None,
            reason: str | None = None, force: bool = False) -> AliasMove:
    """Move `production` to `version` of registered model `name` (or engine name) after proving it; refused when a
    production face system pins another version of it (`_guard`), unless forced with a reason."""
    name = registered_name(cfg, name)
    try:
        version = int(str(version).removeprefix("v"))
    except ValueError:
        raise KilnError(f"version must be a number, got {version!r}", "e.g. kiln promote NAME 3") from None
    reg = Registry(cfg, root)
    with errors(reg.uri):
        reg.require_model(name)
        with reg.lock(name):
            settle(reg, name)
            reason, note = _guard(reg, name, version, "promote", force, reason)
            summary = check_version(reg, name, version)
            reason = not_faster_note(reg, name, version, _noted(reason, note, "promote", version, summary))
            return record_move(reg, name, version, "promote", actor, reason, summary)


def rollback_target(reg: Registry, name: str, promote: str) -> tuple[int, int]:
    """(the production version, the one it replaced) from the recorded release history — or why there is none: no
    production, an alias moved outside kiln, or a first production version. `promote` is the command that promotes a
    version of `name` (for the hints: `kiln promote NAME`, `kiln promote --system SYSTEM`). Call under its lock."""
    stack = production_stack(moves(reg, name))
    current = reg.aliases(name).get(PRODUCTION)
    if current is None:
        raise KilnError(f"{name}: nothing is in production, so there is nothing to roll back",
                        f"promote a version first ({promote} VERSION)")
    if not stack or stack[-1] != current:
        raise KilnError(f"{name}: production is v{current}, but the release history says "
                        f"{'v' + str(stack[-1]) if stack else 'nothing'}; the alias was moved outside kiln",
                        f"record the current one with `{promote} {current}`, or promote the intended version "
                        f"({promote} VERSION)")
    if len(stack) < 2:
        raise KilnError(f"{name}: v{current} is the first production version; there is no earlier one",
                        f"promote a specific version instead ({promote} VERSION)")
    return current, stack[-2]


def rollback(cfg: Config, name: str, root: Path = Path("."), actor: str | None = None,
             reason: str | None = None, force: bool = False) -> AliasMove:
    """Move `production` back to the version it held before the current one (per the recorded history); guarded
    as `promote`."""
    name = registered_name(cfg, name)
    reg = Registry(cfg, root)
    with errors(reg.uri):
        reg.require_model(name)
        with reg.lock(name):
            settle(reg, name)
            _, target = rollback_target(reg, name, f"kiln promote {name}")
            reason, note = _guard(reg, name, target, "roll back", force, reason)
            summary = check_version(reg, name, target)
            return record_move(reg, name, target, "rollback", actor, _noted(reason, note, "rollback", target, summary),
                               summary)


__all__ = ["AliasMove", "BUILT", "CANDIDATE", "OUTSIDE", "PRODUCTION", "Pin", "RELEASES_EXPERIMENT", "SYSTEMS",
           "VALIDATIONS_EXPERIMENT", "attached_verdicts", "check_version", "download_verified", "fetch_release",
           "history", "move_alias", "pins", "production_pins", "promote", "recorded", "redact", "rollback",
           "rollback_target", "settle", "with_gaps"]
