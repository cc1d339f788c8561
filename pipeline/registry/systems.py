"""System versions: a face system registered, promoted, rolled back and recorded as one.

`kiln register-system <name>` registers a version of MLflow model `kiln-system-<name>` from system@<name>'s output
(artifacts/systems/<name>/: system.json, verdict.json, manifest), verified and current with params.yaml:

* Each part — every engine system.json names, by model — is pinned by its registered version AND identity digest:
  the version of `kiln-<engine>` whose registered manifest digest is the one system@ gated. A part not registered
  is refused (`kiln register <engine>`). The pins are stored (kiln/parts.json) and logged as run parameters
  (`kiln.part.<model>.{registered_model,version,xxh3_128,sha256}`), beside the digests of the system manifest
  (whose files are system.json — thresholds, preprocessing, detector settings — and verdict.json) and of the pins
  (`kiln.sha256`, the version's content digest): run parameters cannot be edited afterwards.
* Idempotent by content, as engine registration (pipeline/registry/registration.py): the same system manifest with
  the same pins is the same version, under the system's registry lock. A passing system becomes `candidate`; a failed
  one is refused unless `allow_failed` (registered without an alias).

`promote` proves the version before anything moves: its binding (aliases.py `logged_binding`), every stored file against
the stored manifest and the registered digests, the pins against the stored system.json, the system gate from the
verified verdict.json, and each part as `check_version` does (its stored, digest-checked verdict). When the system's
embedder engine differs from the production system's, the candidate is measured against the gallery production
enrolled (pipeline/gates/gallery_compat.py, limits `gallery_compat:`); outside the limits it is `re-enroll
required`, refused unless `re_enroll` (recorded in the move's reason and its run's tags). Then every part's
`production` moves to its pinned version and the system's last, under the system's lock and the parts' locks taken
in sorted order (an engine promotion takes one part lock: no lock order can deadlock). `rollback` restores every
part of the previous production version of the system at once; `history` is the engines' (`kiln-releases`).
A part whose production version `kiln upgrade-report` compared with this very build (a toolchain rebuild) has the
report's verdict recorded with the move (pipeline/registry/upgrades.py).
A part of the old version that is another registered model (the INT8 embedder replaced by the FP32 one) keeps its
own `production`: the system's production version names what is deployed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kiln_runtime.release import PARTS_FILE, Part, registered  # noqa: F401 — a system version as a deployment reads it
from kiln_runtime.release import parts_doc as _parts_doc
from kiln_runtime.release import system_content as _content
from pipeline import paths
from pipeline.dvcfiles import address
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import (artifact_digest, check_files, identity_digest, manifest_path,
                               read_manifest, verify_manifest)
from pipeline.registry.client import Registry, errors, redact, registered_name
from pipeline.registry import upgrades
from pipeline.registry.registration import (complete_registration, end_killed_runs, ensure_registered_model,
                                            flat_params, log_model, numeric_metrics)
from pipeline.registry.aliases import (CANDIDATE, KILN_DIR, PARAM, PRODUCTION, AliasMove, Verified, logged_binding,
                                       gate_verified, record_move, not_faster_note, actor_name, download_verified,
                                       move_alias, now, pins, production_pins, recorded, retire, rollback_target,
                                       settle)

if TYPE_CHECKING:
    from pipeline.config import Config

PREFIX = "system-"            # the run's artifact name: registered as kiln-system-<name> (aliases.SYSTEMS)
COMPAT = "gallery_compat"     # a system move's record of its gallery check: parameters kiln.gallery_compat.*
PART_KEYS = ("registered_model", "version", "xxh3_128", "sha256", "gated_xxh3_128")


def is_system(name: str) -> bool:
    return name.startswith(f"kiln-{PREFIX}")


def system_name(name: str) -> str:
    return registered(name).removeprefix(f"kiln-{PREFIX}")


@dataclass(frozen=True)
class SystemReceipt:
    name: str                 # kiln-system-<system>
    version: int
    sha256: str
    new: bool
    verdict: str
    parts: tuple[Part, ...]
    tracking_uri: str


@dataclass(frozen=True)
class SystemMove:
    system: AliasMove
    parts: tuple[AliasMove, ...]
    compat: Any = None        # gallery_compat.Compat when the embedder changed
    re_enroll: bool = False
    retired: tuple[AliasMove, ...] = ()   # parts of the old production version it no longer runs: alias removed
    shadow: str | None = None             # the shadow report recorded with it (pipeline/registry/shadow.py)
    upgrades: tuple[str, ...] = ()        # upgrade reports of the parts it moves (pipeline/registry/upgrades.py)


# ---------------------------------------------------------------------------------------------- the local system
def _local(cfg: Config, system: str, root: Path) -> tuple[dict, dict, dict]:
    """(manifest, system.json, verdict.json) of system@<system>'s output, verified and current with params.yaml."""
    from pipeline.e2e import resolve

    stage = address(f"system@{system}")
    d = paths.system(system, root)
    mpath = manifest_path(d, system)
    if not mpath.is_file():
        raise KilnError(f"{mpath}: missing; system {system} has not been gated here", f"run it: dvc repro {stage}")
    manifest = read_manifest(mpath)
    if (manifest.get("kind"), manifest.get("name")) != ("system", system):
        raise KilnError(f"{mpath}: describes {manifest.get('kind')} {manifest.get('name')!r}, not system {system!r}",
                        f"rerun it: dvc repro -f {stage}")
    if problems := verify_manifest(mpath, root):
        raise GateFailed(f"system {system}: its artifacts do not verify (edited, or an input changed since it was "
                         "gated): " + "; ".join(problems[:3]), f"rerun it: dvc repro {stage}")
    described = json.loads((d / paths.SYSTEM_FILE).read_text(encoding="utf-8"))
    verdict = json.loads((d / paths.VERDICT_FILE).read_text(encoding="utf-8"))
    gated = {m: e["engine"] for m, e in described["engines"].items()}
    if gated != (want := resolve(cfg, system)):
        raise KilnError(f"system {system}: gated with {gated}, but params.yaml now picks {want}",
                        f"the system output is stale; rerun it: dvc repro {stage}")
    return manifest, described, verdict


def _pins(reg: Registry, cfg: Config, system: str, described: dict, root: Path) -> list[Part]:
    """Each engine of the system, pinned to the registered version of exactly the bytes system@ gated: engines are
    registered once per content digest, so a rebuild by other code (same bytes, a new manifest) pins the version
    its first build registered."""
    out = []
    for model, e in sorted(described["engines"].items()):
        engine, gated = e["engine"], e["xxh3_128"]
        mpath = manifest_path(paths.engine(engine, root), engine)
        local = read_manifest(mpath) if mpath.is_file() else None
        if local is None or identity_digest(local) != gated or verify_manifest(mpath, root):
            raise KilnError(f"system {system}: its {model} engine {engine} is not here as system@ gated it (manifest "
                            f"{gated})", f"gate the system again: dvc repro {address(f'system@{system}')}")
        content, name = artifact_digest(local), registered_name(cfg, engine)
        hint = f"register it first: kiln register {engine} (or dvc repro {address(f'register@{engine}')})"
        found = [(v, reg.client.get_run(v.run_id).data.params) for v in
                 reg.client.search_model_versions(f"name = '{name}' and tags.sha256 = '{content}'") if v.run_id]
        found = [(v, params) for v, params in found if params.get(PARAM + "sha256") == content]
        if not found:
            raise KilnError(f"system {system}: its {model} engine {engine} (sha256 {content[:12]}…) is not registered",
                            hint)
        v, params = min(found, key=lambda f: int(f[0].version))
        out.append(Part(model, engine, name, int(v.version), params[PARAM + "manifest_xxh3_128"], content, gated))
    return out


# ---------------------------------------------------------------------------------------------- register
def register_system(cfg: Config, system: str, root: Path = Path("."), allow_failed: bool = False) -> SystemReceipt:
    """Register system `system` once per content (manifest + pins); a failed system gate is refused unless allowed."""
    root, system = Path(root), system_name(system)
    manifest, described, verdict = _local(cfg, system, root)
    if verdict.get("verdict") != "pass" and not allow_failed:
        raise GateFailed(f"system@{system}: its gate failed ({'; '.join(verdict.get('failures') or [])[:300]}); "
                         "not registered", "fix it, or register it deliberately with --allow-failed (no alias)")
    reg, name = Registry(cfg, root), registered(system)
    with errors(reg.uri):
        parts = _pins(reg, cfg, system, described, root)
        digest = _content(system, manifest, parts)
        art = SimpleNamespace(name=PREFIX + system)          # what registration's repair helpers read
        with reg.lock(name):
            settle(reg, name)
            end_killed_runs(reg, cfg, art)
            existing = reg.client.search_model_versions(f"name = '{name}' and tags.sha256 = '{digest}'")
            if existing:
                version, new = min(int(v.version) for v in existing), False
                complete_registration(reg, name, art, version)
            else:
                version, new = _log(reg, cfg, system, root, manifest, described, verdict, parts, digest), True
    if new and verdict.get("verdict") != "pass":
        print(f"kiln: WARNING: {name} v{version} registered with a FAILED system gate (--allow-failed); it has no "
              "alias and `kiln promote` will refuse it", file=sys.stderr)
    return SystemReceipt(name, version, digest, new, str(verdict.get("verdict")), tuple(parts), redact(reg.uri))


def _log(reg: Registry, cfg: Config, system: str, root: Path, manifest: dict, described: dict, verdict: dict,
         parts: list[Part], digest: str) -> int:
    import shutil

    from pipeline.records import read_record

    client, name, artifact = reg.client, registered(system), PREFIX + system
    eid = reg.experiment_id(cfg.register.experiment)
    ident, parts_doc = identity_digest(manifest), _parts_doc(parts)
    record = read_record(f"system@{system}", root) or {}
    embedder = next(p for p in parts if p.model == described["embedder"])
    tags = {"kind": "system", "system": system, "sha256": digest, "xxh3_128": ident,
            "validation": str(verdict.get("verdict")), "embedder": embedder.engine,
            "parts": ",".join(f"{p.model}={p.registered_model}:v{p.version}" for p in parts),
            "git_commit": str((record.get("git") or {}).get("commit", "unrecorded (restored from a cache)"))}
    params = {PARAM + "artifact": artifact, PARAM + "kind": "system", PARAM + "system": system,
              PARAM + "embedder_model": embedder.model, PARAM + "git_commit": tags["git_commit"],
              PARAM + "sha256": digest, PARAM + "manifest_xxh3_128": ident, PARAM + "verdict": tags["validation"],
              PARAM + "parts_sha256": hashlib.sha256(parts_doc).hexdigest(),
              **{f"{PARAM}part.{p.model}.{k}": str(getattr(p, k)) for p in parts for k in PART_KEYS},
              **flat_params("thresholds", described.get("thresholds") or {}),
              **flat_params("preprocessing", described.get("preprocessing") or {})}
    d = paths.system(system, root)

    def stage(staged: Path) -> None:    # copies, never links: the artifact store must not share the checkout's inodes
        for f in (paths.SYSTEM_FILE, paths.VERDICT_FILE, manifest_path(d, system).name):
            shutil.copyfile(d / f, staged / f)
        (staged / KILN_DIR).mkdir()
        (staged / KILN_DIR / PARTS_FILE).write_bytes(parts_doc)

    run_id, model_id = log_model(client, eid, artifact, tags, tags, params, "kiln-system", stage,
                                  numeric_metrics("system", verdict.get("metrics") or {}))
    ensure_registered_model(client, name, {"kind": "system", "system": system}, f"Kiln face system {system}")
    mv = client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id, tags=tags, model_id=model_id)
    version = int(mv.version)
    if verdict.get("verdict") == "pass":
        move_alias(reg, AliasMove(name, CANDIDATE, reg.aliases(name).get(CANDIDATE), version, "register",
                                  actor_name(), now(), f"registered system {system} sha256 {digest[:12]} (system gate "
                                  "pass)"))
    return version


# ---------------------------------------------------------------------------------------------- verify
@dataclass(frozen=True)
class VerifiedSystem:
    directory: Path
    system: str
    manifest: dict[str, Any]
    described: dict[str, Any]     # system.json
    verdict: dict[str, Any]       # verdict.json
    parts: tuple[Part, ...]

    @property
    def embedder(self) -> Part:
        return next(p for p in self.parts if p.model == self.described["embedder"])


def download_system(reg: Registry, name: str, version: int, dst: Path) -> VerifiedSystem:
    """Download a system version into `dst` and prove it: bound to what it was registered for, its files against
    the stored manifest, the manifest, the pins and the content against the digests logged as run parameters, and
    the pins against the stored system.json. Any mismatch is a GateFailed naming it."""
    from mlflow.artifacts import download_artifacts

    mv = reg.version(name, version)
    params = dict(reg.client.get_run(mv.run_id).data.params) if mv.run_id else {}
    need = ("artifact", "system", "sha256", "manifest_xxh3_128", "parts_sha256")
    missing = [k for k in need if PARAM + k not in params] + ([] if params.get(PARAM + "kind") == "system" else
                                                               ["kind"])
    if missing:
        raise GateFailed(f"{name} v{version}: its run has no system parameter {PARAM}{missing[0]}; it was not "
                         "registered by kiln register-system", "register the system again (kiln register-system NAME)")
    model_id = logged_binding(reg, name, version, mv, params)
    local = Path(download_artifacts(artifact_uri=f"models:/{model_id}", dst_path=str(dst),
                                    tracking_uri=reg.engine_uri, registry_uri=reg.engine_uri))
    system = paths.slug(params[PARAM + "system"], "system")
    tampered = (f"{name} v{version}: stored artifacts do not match their registered digests (tampered or corrupted): "
                "{}")
    hint = "do not ship it; register the system again from a verified build (kiln register-system)"

    def load(rel: str, parse=json.loads) -> Any:
        try:
            return parse((local / rel).read_bytes())
        except (OSError, ValueError) as e:
            raise GateFailed(tampered.format(f"{rel} unreadable ({type(e).__name__})"), hint) from None

    mfile = manifest_path(local, system)
    try:
        manifest = read_manifest(mfile)
    except KilnError as e:
        raise GateFailed(tampered.format(e.message.replace(str(local) + os.sep, "")), hint) from None
    problems = [] if (manifest.get("kind"), manifest.get("name")) == ("system", system) else [
        f"the stored manifest describes {str(manifest.get('kind'))[:40]} {str(manifest.get('name'))[:100]!r}"]
    problems += check_files(mfile, manifest)
    if (d := identity_digest(manifest)) != params[PARAM + "manifest_xxh3_128"]:
        problems.append(f"stored manifest's identity digest is {d}, registered {params[PARAM + 'manifest_xxh3_128']}")
    raw_parts = load(f"{KILN_DIR}/{PARTS_FILE}", parse=lambda b: b)
    if (d := hashlib.sha256(raw_parts).hexdigest()) != params[PARAM + "parts_sha256"]:
        problems.append(f"stored {PARTS_FILE} digest is {d}, registered {params[PARAM + 'parts_sha256']}")
    try:
        parts = tuple(Part(**{**p, "version": int(p["version"])}) for p in json.loads(raw_parts))
    except (ValueError, TypeError, KeyError):
        raise GateFailed(tampered.format(f"{PARTS_FILE} is not a list of parts"), hint) from None
    if bad := [p for p in parts if not (paths.is_slug(p.engine) and paths.is_slug(p.model))]:   # they become paths
        raise GateFailed(tampered.format(f"{PARTS_FILE} names a part that is not a valid name "
                                         f"({str(bad[0].model)[:40]!r}: {str(bad[0].engine)[:80]!r})"), hint)
    for p in parts:
        if any(params.get(f"{PARAM}part.{p.model}.{k}") != str(getattr(p, k)) for k in PART_KEYS):
            problems.append(f"the stored pin of {p.model} is not the registered one")
    if not problems and _content(system, manifest, parts) != params[PARAM + "sha256"]:
        problems.append("the content digest of the stored manifest and pins is not the registered one")
    described, verdict = load(paths.SYSTEM_FILE), load(paths.VERDICT_FILE)
    gated = {m: (e.get("engine"), e.get("xxh3_128")) for m, e in (described.get("engines") or {}).items()}
    if gated != {p.model: (p.engine, p.gated_xxh3_128) for p in parts}:
        problems.append("the pinned parts are not the engines its system.json was gated with")
    if verdict.get("system") != system:
        problems.append(f"its verdict.json is about system {str(verdict.get('system'))[:100]!r}")
    if problems:
        raise GateFailed(tampered.format("; ".join(p.replace(str(local) + os.sep, "") for p in problems)), hint)
    return VerifiedSystem(local, system, manifest, described, verdict, parts)


def prove_system(reg: Registry, name: str, version: int,
                 scratch: Path) -> tuple[VerifiedSystem, str, dict[str, Verified]]:
    """Gate one system version for production: verified, its system gate passed, every part's stored verdict too.
    Each part stays downloaded and verified under `scratch` (model → Verified): what a release ships and
    `identify --release` runs, never downloaded twice."""
    v = download_system(reg, name, version, scratch / f"system-v{version}")
    if v.verdict.get("verdict") != "pass":
        raise GateFailed(f"{name} v{version}: its stored system verdict is {str(v.verdict.get('verdict'))[:40]!r}, "
                         f"not 'pass' ({'; '.join(v.verdict.get('failures') or [])[:300]}); refusing to promote",
                         f"fix the system, gate it again (dvc repro {address('system@NAME')}), register and "
                         "promote that version")
    parts = {}
    for p in v.parts:
        params = reg.client.get_run(reg.version(p.registered_model, p.version).run_id).data.params
        if (params.get(PARAM + "manifest_xxh3_128"), params.get(PARAM + "sha256")) != (p.xxh3_128, p.sha256):
            raise GateFailed(f"{name} v{version}: its part {p.registered_model} v{p.version} is no longer the build "
                             "the system pinned", "register the system again (kiln register-system)")
        parts[p.model] = download_verified(reg, p.registered_model, p.version, scratch / "parts" / p.engine)
        # = check_version
        gate_verified(reg, p.registered_model, p.version, parts[p.model], scratch / "attached" / p.engine)
    return v, (f"system gate pass (stored, digest-checked); {len(v.parts)} parts' validations pass (stored, "
               "digest-checked)"), parts


# ---------------------------------------------------------------------------------------------- gallery
def gallery_check(cfg: Config, reg: Registry, candidate: VerifiedSystem, production: VerifiedSystem | None, root: Path,
                  scratch: Path):
    """The candidate's embedder against the gallery production's embedder enrolled (None: no production system, or
    the same embedder build)."""
    from pipeline.gates import gallery_compat

    if production is None:
        return None
    new, old = candidate.embedder, production.embedder
    if (new.model, new.xxh3_128) == (old.model, old.xxh3_128):
        return None
    if new.model != old.model:        # another embedder model: another vector space, nothing to measure
        return gallery_compat.Compat(new.engine, old.engine, new.model, {}, {}, [
            f"another embedder model ({old.model} → {new.model}): its vectors are in another space"])
    new_dir, old_dir = (download_verified(reg, p.registered_model, p.version, scratch / f"gallery-{p.engine}-v"
                                          f"{p.version}").directory for p in (new, old))
    return gallery_compat.compare(cfg, new.engine, old.engine, root, new_dir, old_dir, new.model)


# ---------------------------------------------------------------------------------------------- moves
def _compat_record(compat, current: int | None, re_enroll: bool) -> dict[str, str]:
    """The gallery check a move decided by, as the move's run parameters (immutable): what `kiln release --system`
    and `kiln history` show of it — the verdict, what it was measured against, the limits and the measured values."""
    if compat is None:
        return {}
    head = f"{PARAM}{COMPAT}."
    fields = {"verdict": compat.verdict, "candidate": compat.candidate,
              "vs": f"{compat.production} (v{current})" if current is not None else compat.production,
              "limits": json.dumps(compat.limits, sort_keys=True, default=float),
              "metrics": json.dumps(compat.metrics, sort_keys=True, default=float),
              "failures": "; ".join(compat.failures), "re_enroll": str(bool(re_enroll and compat.failures)).lower()}
    if compat.enrolment:
        fields["enrolment"] = json.dumps(compat.enrolment, sort_keys=True)
    return {head + k: v for k, v in fields.items()}


def _move_all(reg: Registry, name: str, version: int, v: VerifiedSystem, action: str, actor: str | None,
              reason: str | None, summary: str, compat, re_enroll: bool, current: int | None,
              shadow: dict | None = None, reports: dict[str, dict[str, str]] | None = None) -> SystemMove:
    """Every part's production to its pin; the parts of the current production version the new one does not run
    (another embedder model or build registered apart) lose their engine-level `production`, unless another
    production system pins them; then the system's. Under the parts' locks in sorted order (the caller holds the
    system's)."""
    note = ""
    if compat is not None:
        note = (f"gallery check: {compat.summary()}" if not compat.failures else
                f"re-enroll: the gallery was re-enrolled with {compat.candidate} (run "
                f"{(compat.enrolment or {}).get('run', '?')}: {(compat.enrolment or {}).get('rows', '?')} rows, sha256 "
                f"{(compat.enrolment or {}).get('sha256', '?')[:12]}; --re-enroll; {compat.summary()})")
    seen = None
    if shadow is not None:
        from pipeline.registry import shadow as shadow_report

        seen = shadow_report.record(shadow)[shadow_report.HEAD + "summary"]
    upgraded = upgrades.lines(reports or {})
    text = "; ".join(x for x in (reason, note, seen, *upgraded) if x) or None
    mine = {p.registered_model for p in v.parts}
    old = {p.registered_model for p in pins(reg, name, current)} if current not in (None, version) else set()
    with ExitStack() as stack:
        for part in sorted(mine | old):
            stack.enter_context(reg.lock(part))
            settle(reg, part)
        part_moves = []
        for p in v.parts:
            why = f"{action} of system {v.system} v{version}" + (f": {reason}" if reason else "")
            part_moves.append(record_move(reg, p.registered_model, p.version, action, actor,
                                    not_faster_note(reg, p.registered_model, p.version, why), summary))
        others = {p.registered_model for p in production_pins(reg) if p.system != name}
        retired = [m for part in sorted(old - mine - others) if (m := retire(
            reg, part, actor, f"{action} of system {v.system} v{version}: no production system runs it any more"))]
        extra = {**_compat_record(compat, current, re_enroll)}
        if shadow is not None:
            extra.update(shadow_report.record(shadow))
        extra.update(upgrades.record(reports or {}))
        m = record_move(reg, name, version, action, actor, text, summary, extra)
    if m.changed and compat is not None:          # the record's own tags, beside its reason (display)
        run_id = (reg.version(name, version).tags or {}).get(f"{PRODUCTION}_release_run")
        if run_id:
            reg.client.set_tag(run_id, "gallery_compat", compat.verdict)
            reg.client.set_tag(run_id, "re_enroll", str(bool(re_enroll and compat.failures)).lower())
    return SystemMove(m, tuple(part_moves), compat, bool(re_enroll and compat is not None and compat.failures),
                      tuple(retired), seen, tuple(upgraded))


def require_model(reg: Registry, name: str) -> None:
    try:
        reg.require_model(name)
    except KilnError as e:
        raise KilnError(e.message, f"register it first: kiln register-system {system_name(name)}") from None


def version_number(version: int | str) -> int:
    try:
        return int(str(version).removeprefix("v"))
    except ValueError:
        raise KilnError(f"version must be a number, got {version!r}", "e.g. kiln promote --system NAME 3") from None


def _compat_gate(cfg: Config, reg, name: str, version: int, v: VerifiedSystem, current: int | None, root: Path,
                 scratch: Path, re_enroll: bool, action: str):
    prod = None if current is None or current == version else download_system(reg, name, current,
                                                                              scratch / f"system-v{current}")
    compat = gallery_check(cfg, reg, v, prod, root, scratch)
    if compat is not None:
        reg.client.set_model_version_tag(name, str(version), "gallery_compat", compat.verdict)
        reg.client.set_model_version_tag(name, str(version), "gallery_compat.vs",
                                         f"{prod.embedder.engine} (v{current})")
        if compat.failures and not re_enroll:
            raise GateFailed(f"{name} v{version}: re-enroll required — its embedder {compat.candidate} cannot read "
                             f"the gallery {compat.production} enrolled: {'; '.join(compat.failures)}; refusing to "
                             f"{action}", f"re-enrol the gallery with {compat.candidate} (kiln re-enroll --system "
                             f"{system_name(name)} {version}), then {action} with --re-enroll (recorded in the "
                             "history)")
        if compat.failures and not (found := enrolments(reg, name, version, v.embedder.xxh3_128)):
            raise GateFailed(f"{name} v{version}: re-enroll required, and no re-enrolment of its gallery by "
                             f"{compat.candidate} is recorded; refusing to {action}",
                             f"re-enrol it first: kiln re-enroll --system {system_name(name)} {version}")
        if compat.failures:
            compat = replace(compat, enrolment=found[-1])
    return compat


# ---------------------------------------------------------------------------------------------- re-enrolment
ENROLMENTS_EXPERIMENT = "kiln-enrolments"   # galleries enrolled by a system version's embedder (kiln re-enroll)
ENROL = PARAM + "enrol."
ENROL_KEYS = ("system", "version", "embedder", "embedder_xxh3_128", "enrolment_xxh3_128", "rows", "dim", "sha256",
              "host_class")


def record_enrolment(reg: Registry, name: str, version: int, doc: dict[str, Any]) -> str:
    """Record a gallery enrolled by system version `version`'s embedder (`doc`: ENROL_KEYS but system/version) as a
    run of `kiln-enrolments`, its fields as parameters (immutable); returns the run id."""
    from mlflow.entities import Param

    eid = reg.experiment_id(ENROLMENTS_EXPERIMENT)
    fields = {**{k: str(doc[k]) for k in ENROL_KEYS[2:]}, "system": name, "version": str(version)}
    run = reg.client.create_run(eid, run_name=f"re-enroll {name} v{version}", tags={"model": name,
                                                                                    "version": str(version)})
    reg.client.log_batch(run.info.run_id, params=[Param(ENROL + k, v) for k, v in sorted(fields.items())])
    reg.client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def enrolments(reg: Registry, name: str, version: int, embedder_xxh3_128: str | None = None
               ) -> list[dict[str, str]]:
    """The recorded re-enrolments of system version `version` (oldest first), each {field: value, "run": id}, by
    their parameters; `embedder_xxh3_128`: only those enrolled by that embedder build."""
    exp = reg.client.get_experiment_by_name(ENROLMENTS_EXPERIMENT)
    if exp is None:
        return []
    quoted = name.replace("'", "\\'")
    out = []
    for r in reg.client.search_runs([exp.experiment_id], filter_string=f"tags.model = '{quoted}'", max_results=1000,
                                    order_by=["attributes.start_time ASC"]):
        p = {k[len(ENROL):]: v for k, v in r.data.params.items() if k.startswith(ENROL)}
        if r.info.status != "FINISHED" or (p.get("system"), p.get("version")) != (name, str(version)):
            continue
        if embedder_xxh3_128 is None or p.get("embedder_xxh3_128") == embedder_xxh3_128:
            out.append({**p, "run": r.info.run_id})
    return out


def promote(cfg: Config, system: str, version: int | str, root: Path = Path("."), actor: str | None = None,
            reason: str | None = None, re_enroll: bool = False, shadow: dict | None = None) -> SystemMove:
    """Move the system's `production`, and every part's, to `version` after proving it (module doc); `shadow`: a
    shadow report's summary (pipeline/registry/shadow.py load) of this version beside production, recorded."""
    name, version, root = registered(system), version_number(version), Path(root)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-system-") as tmp:
        require_model(reg, name)
        with reg.lock(name):
            settle(reg, name)
            v, summary, _ = prove_system(reg, name, version, Path(tmp))
            current = reg.aliases(name).get(PRODUCTION)
            if shadow is not None:
                from pipeline.registry import shadow as shadow_report

                shadow_report.check(shadow, name, version, v, current)
            compat = _compat_gate(cfg, reg, name, version, v, current, root, Path(tmp), re_enroll, "promote")
            running = {p.registered_model: x for p in v.parts
                       if (x := reg.aliases(p.registered_model).get(PRODUCTION)) is not None}
            return _move_all(reg, name, version, v, "promote", actor, reason, summary, compat, re_enroll, current,
                             shadow, upgrades.found(reg, v.parts, running))


def rollback(cfg: Config, system: str, root: Path = Path("."), actor: str | None = None, reason: str | None = None,
             re_enroll: bool = False) -> SystemMove:
    """Move the system back to the production version it held before the current one, every part at once."""
    name, root = registered(system), Path(root)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-system-") as tmp:
        require_model(reg, name)
        with reg.lock(name):
            settle(reg, name)
            current, target = rollback_target(reg, name, f"kiln promote --system {system_name(name)}")
            v, summary, _ = prove_system(reg, name, target, Path(tmp))
            compat = _compat_gate(cfg, reg, name, target, v, current, root, Path(tmp), re_enroll, "roll back")
            return _move_all(reg, name, target, v, "rollback", actor, reason, summary, compat, re_enroll, current)


def versions(cfg: Config, system: str, root: Path = Path(".")) -> tuple[list[dict[str, Any]], list[str]]:
    """Every version of the system as its run recorded it — verdict, embedder, parts (run parameters) and the
    gallery check its newest production move made (that move's parameters) — and every tag that says otherwise
    (for a warning: tags are display, anyone with registry write access can edit them)."""
    name = registered(system)
    reg = Registry(cfg, root)
    rows, forged = [], []
    with errors(reg.uri):
        prod = reg.aliases(name).get(PRODUCTION) if reg.client.search_registered_models(
            filter_string=f"name = '{name}'") else None
        for mv in sorted(reg.client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
            version, tags = int(mv.version), mv.tags or {}
            params = reg.client.get_run(mv.run_id).data.params if mv.run_id else {}
            parts = {p.model: p for p in pins(reg, name, version)}
            embedder = parts.get(params.get(PARAM + "embedder_model", ""))
            compat = recorded(reg, name, version, COMPAT)
            row = {"version": version, "production": version == prod, "verdict": params.get(PARAM + "verdict", "-"),
                   "embedder": embedder.registered_model.removeprefix("kiln-") if embedder else "-",
                   "parts": ",".join(f"{p.model}={p.registered_model}:v{p.version}" for p in parts.values()) or "-",
                   "gallery_compat": compat.get("verdict", "-")}
            for key, tag in (("verdict", "validation"), ("embedder", "embedder"), ("parts", "parts")):
                if tag in tags and row[key] != "-" and tags[tag] != row[key]:
                    forged.append(f"{name} v{version}: its {tag!r} tag says {tags[tag]!r}, its run recorded "
                                  f"{row[key]!r}")
            if "gallery_compat" in tags and tags["gallery_compat"] != row["gallery_compat"]:
                forged.append(f"{name} v{version}: its 'gallery_compat' tag says {tags['gallery_compat']!r}, its "
                              f"moves recorded {row['gallery_compat']!r}")
            rows.append(row)
    return rows, forged


def fetch_production(cfg: Config, system: str, dst: Path, root: Path = Path(".")
                     ) -> tuple[int, VerifiedSystem, dict[str, Path]]:
    """The production version of face system `system` — the one truth of what production runs — proven as promote
    proves it, and each part's pinned version downloaded into `dst` and verified: (version, the system, model →
    engine directory). The alias is read under the system's lock, so no move is half-seen."""
    name, root, dst = registered(system), Path(root), Path(dst)
    reg = Registry(cfg, root)
    with errors(reg.uri):
        require_model(reg, name)
        with reg.lock(name):
            settle(reg, name)
            version = reg.aliases(name).get(PRODUCTION)
            if version is None:
                raise KilnError(f"{name}: no production version; production is what a face system's production "
                                "version pins", f"promote one first: kiln promote --system {system_name(name)} VERSION")
            v, _, parts = prove_system(reg, name, version, dst)
    return version, v, {model: part.directory for model, part in parts.items()}


__all__ = ["Part", "SystemMove", "SystemReceipt", "VerifiedSystem", "download_system", "fetch_production",
           "gallery_check", "is_system", "promote", "register_system", "registered", "rollback", "system_name",
           "versions"]
