"""`kiln release --system NAME [VERSION]`: a whole face system as one signed, deterministic archive, and what a
deployment host does with it (`kiln verify-release`, `kiln identify --release ARCHIVE`).

A system release is built from a registered system version (pipeline/registry/systems.py), proven exactly as
`promote` proves it (the system gate, every file and pin against the registered digests, every part's stored
verdict); `<R>` = `kiln-system-<name>-v<version>`:

    <R>/
      release.json          what this is: system, version, content digests, the parts, the gallery, gallery-compat
      system/               system.json, verdict.json, their manifest, kiln/parts.json (the pins), as registered
      engines/<engine>/     each part as downloaded from the registry and verified (files, manifest, kiln/)
      config/params.json    the params slice system@ gated with (its manifest's params.values, same digest): the
                            system, its models' and engines' entries, the detector's data keys — all a deployment reads
      gallery/              embeddings.npy + labels.json: the golden set's un-augmented chips (what `System.enroll`
                            enrols) embedded by the system's own embedder engine, and a manifest whose inputs are
                            that engine's manifest (its pin) and the enrolment set's identity (system.json's)
      golden/<engine>/      a few golden inputs of each engine and what its gated runtime gave for them
                            (kiln_runtime/golden.py): what --allow-runtime-drift checks on another runtime
      lockfiles.json        sha256 of the releasing checkout's lockfiles
      slsa-provenance.json  in-toto Statement v1 / SLSA Provenance v1 (pipeline/release/attestation.py); subjects: every
                            file above but the three top documents
    <R>.sig                 the model-signing bundle over <R>/ (pipeline/release/signing.py)

The archive is written, read and signed exactly as an engine release (pipeline/release/engine.py,
pipeline/release/archive.py), so the same inputs give the same bytes. An engine's upstream chain (quantized → … →
assets) is its own engine release's; a system release names each engine by its identity digest.

Reading a release is the runtime's (kiln_runtime/release.py), so `kiln verify-release` / `kiln identify --release`
and a deployment host (`kiln-run`) check and run it with one implementation: the signature, then `check_system` —
the system manifest and its content digest, the pins (each shipped engine's identity digest IS the system version's
pin), each engine's verdict, the config slice against the system manifest, the gallery against the pinned embedder
and the enrolment set (`check_gallery`: header first, bounded, through a memory map), exactly the declared files, the
SLSA subjects. The build adds `deploy_config` (the config slice against params.yaml's own types) and, in `deployed`,
the refusal to run a release this checkout would gate otherwise.
"""

from __future__ import annotations

import io
import json
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, StrictInt, StrictStr

from kiln_runtime import requirements
from kiln_runtime.release import (CONFIG_FILE, EMBEDDINGS, ENGINES_DIR, GALLERY_DIR, LABELS, SCHEMA,  # noqa: F401
                                  SYSTEM_DIR, SYSTEM_FILE, TOP_DOCS, Deployed, check_gallery, check_system,
                                  is_system_release, load, read_doc, system_content, writing)
from kiln_runtime.release import gallery_sha256 as _gallery_sha256
from kiln_runtime.release import verified as runtime_verified
from pipeline import config as C
from pipeline import paths
from pipeline.dvcfiles import address
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import build_manifest, identity_digest, json_bytes, manifest_path, read_verified
from pipeline.release import attestation, golden_samples, signing
from pipeline.release import engine as release

if TYPE_CHECKING:
    from pipeline.config import Config

SECTIONS = ("data", "models", "engines", "systems")                      # what a system@ params slice holds


# ---------------------------------------------------------------------------------------------- the config slice
@C.frozen
class DeployData:
    """The data keys system@ tracks (pipeline/stages/system.py); `photos` is where it was gated, unused here."""
    chip_size: Annotated[StrictInt, Field(ge=16)]
    template: C.Template
    min_face_size: Annotated[StrictInt, Field(ge=12)]
    photos: StrictStr = ""


@dataclass(frozen=True)
class _Slice:
    """The sections of a deployment's Config: what `System` reads (pipeline/e2e.py), nothing else, so a deployed
    system cannot silently depend on a setting its release does not carry."""
    data: Any
    models: dict[str, Any]
    engines: dict[str, Any]
    systems: dict[str, Any]


def deploy_config(values: dict[str, Any], source: Path) -> Config:
    """A Config of a params slice (dotted keys → raw values, as a system manifest records them), each entry validated
    by params.yaml's own types. Only the sections a deployed system reads exist on it."""
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(values, dict):
        raise GateFailed(f"{source}: not a params slice (a mapping of dotted keys)", "do not use this release")
    raw: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for dotted, value in values.items():
        section, _, key = str(dotted).partition(".")
        if section not in raw or not key or "." in key:
            raise GateFailed(f"{source}: {str(dotted)[:100]!r} is not a key a face system reads",
                             "do not use this release")
        raw[section][key] = value
    sections = {s: {k: {**v, "name": k} if s != "data" and isinstance(v, dict) else v for k, v in raw[s].items()}
                for s in SECTIONS}          # named as config.load names them (the key it is listed under)
    types = {"data": DeployData, "models": dict[str, C.ModelConfig], "engines": dict[str, C.EngineSpec],
             "systems": dict[str, C.SystemSpec]}
    made = {}
    for section, kind in types.items():
        try:
            made[section] = TypeAdapter(kind).validate_python(sections[section])
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join((section, *(str(x) for x in first.get("loc", ()))))
            raise GateFailed(f"{source}: {where}: {first.get('msg')}", "do not use this release") from None
    return C.Config(Path(source), raw, _Slice(**made))


# ---------------------------------------------------------------------------------------------- building
def _resolve(reg, name: str, system: str, ref: str) -> int:
    from pipeline.registry.aliases import PRODUCTION

    ref = str(ref)
    if re.fullmatch(r"v?[0-9]{1,9}", ref):
        return int(ref.removeprefix("v"))
    version = reg.aliases(name).get(paths.slug(ref, "alias"))
    if version is None:
        raise KilnError(f"{name}: no version has the alias {ref!r}",
                        f"promote one first (kiln promote --system {system} VERSION)" if ref == PRODUCTION else
                        f"see the aliases with: kiln history --system {system}")
    return int(version)


def build(cfg: Config, system: str, ref: str = "production", root: Path = Path("."), key: Path | None = None,
          out_dir: Path | None = None) -> release.Release:
    """Release version `ref` (a number or an alias; default production) of face system `system` as one signed
    deterministic archive; recorded in the registry like an engine release (alias `release`, history)."""
    from pipeline.registry import systems
    from pipeline.registry.client import Registry, errors
    from pipeline.registry.aliases import KILN_DIR, settle

    root = Path(root)
    key = signing.key_path(str(key) if key else None)
    if not key.is_file():
        raise KilnError(f"{key}: signing key not found", "make one with `kiln keygen --out PATH`")
    signing.outside_repo(key, "signing key")
    out_dir = Path(out_dir) if out_dir else root / release.RELEASES
    name, system = systems.registered(system), systems.system_name(system)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-release-") as tmp, writing(Path(tmp)):
        scratch = Path(tmp)
        systems.require_model(reg, name)
        with reg.lock(name):          # the alias read and the record under the lock every move takes
            settle(reg, name)
            version = _resolve(reg, name, system, ref)
            # what promote demands, and more
            v, _, proven = systems.prove_system(reg, name, version, scratch / "proof")
            rel = f"{name}-v{version}"
            tree = scratch / rel
            sdir = tree / SYSTEM_DIR
            for f in (paths.SYSTEM_FILE, paths.VERDICT_FILE, manifest_path(Path(""), system).as_posix(),
                      f"{KILN_DIR}/{systems.PARTS_FILE}"):
                release.copy_file(v.directory / f, sdir / f)
            parts = _stage_parts(v, proven, tree)
            values = v.manifest["params"]["values"]
            release.write_json(tree / CONFIG_FILE, values)
            gallery = _enrol(tree, v, deploy_config(values, tree / CONFIG_FILE), root)
            goldens = golden_samples.write(cfg, tree, parts, root)
            re_enrolled = _check_re_enrolment(reg, name, version, gallery, tree / GALLERY_DIR)
            doc = {"schema": SCHEMA, "kind": "system", "registered_model": name, "version": version, "system": system,
                   "artifact": systems.PREFIX + system,
                   "system_manifest": f"{SYSTEM_DIR}/{manifest_path(Path(''), system).as_posix()}",
                   "system_manifest_xxh3_128": identity_digest(v.manifest),
                   "system_sha256": system_content(system, v.manifest, v.parts),
                   "verdict": v.verdict.get("verdict"), "parts": parts, "config": CONFIG_FILE, "gallery": gallery,
                   "gallery_compat": _compat(reg, name, version, re_enrolled), "golden": goldens}
            payload = _payload(tree)
            lockfiles = attestation.lockfiles()
            release.write_json(tree / "release.json", doc)
            release.write_json(tree / "lockfiles.json", lockfiles)
            release.write_json(tree / "slsa-provenance.json", _statement(reg, tree, doc, v, payload, lockfiles))
            signing.sign_tree(tree, scratch / f"{rel}{release.SIG_SUFFIX}", key)
            dest = out_dir / f"{rel}.tar.gz"
            staged = scratch / "archive.tar.gz"
            sha = release.write_archive(staged, scratch, [rel, f"{rel}{release.SIG_SUFFIX}"])
            release.place_archive(staged, dest, sha)
            recorded = release.record_release(reg, name, version, str(ref), dest, sha, locked=True)
    return release.Release(dest, sha, name, version, recorded)


def _stage_parts(v, proven: dict, tree: Path) -> list[dict[str, Any]]:
    """Each pinned part, as `prove_system` downloaded and verified it (`proven`: model → Verified), copied to
    tree/engines/<engine>/; release.json's rows of them. A system's engines all ran on system@'s host, so each must
    carry its own stored pass (a verdict attached later by another host is not enough here)."""
    from pipeline.registry.aliases import KILN_DIR, PARAM

    parts = []
    for p in v.parts:
        ev = proven[p.model]
        if ev.verdict.get("verdict") != "pass":
            raise GateFailed(f"{p.registered_model} v{p.version}: its stored verdict is not pass",
                             "validate it on a host with its runtime, then register the system again")
        edir = tree / ENGINES_DIR / p.engine
        for f in [e["path"] for e in ev.manifest["files"]] + [manifest_path(Path(""), p.engine).as_posix()]:
            release.copy_file(ev.directory / f, edir / f)
        for f in sorted((ev.directory / KILN_DIR).iterdir()):
            release.copy_file(f, edir / KILN_DIR / f.name)
        parts.append({**asdict(p), "dir": f"{ENGINES_DIR}/{p.engine}",
                      "validation_manifest_xxh3_128": ev.params[PARAM + "validation_manifest_xxh3_128"],
                      "runtime": requirements.of_engine(ev.manifest)})
    return parts


def re_enroll(cfg: Config, system: str, version: int | str, root: Path = Path(".")) -> dict[str, Any]:
    """`kiln re-enroll --system NAME VERSION`: enrol the gallery with version VERSION's embedder exactly as its
    release will (the same parts, config slice and enrolment set: `_enrol`), and record it in the registry
    (`kiln-enrolments`, immutable parameters) — the step a `re-enroll required` promotion needs first, and what a
    release of that version is later checked against."""
    from pipeline.registry import systems
    from pipeline.registry.client import Registry, errors
    from pipeline.toolchain import host_class

    name, system, root = systems.registered(system), systems.system_name(system), Path(root)
    version = systems.version_number(version)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-enrol-") as tmp:
        scratch = Path(tmp)
        systems.require_model(reg, name)
        v, _, proven = systems.prove_system(reg, name, version, scratch / "proof")
        tree = scratch / "tree"
        _stage_parts(v, proven, tree)
        values = v.manifest["params"]["values"]
        release.write_json(tree / CONFIG_FILE, values)
        gallery = _enrol(tree, v, deploy_config(values, tree / CONFIG_FILE), root)
        doc = {"embedder": gallery["embedder"], "embedder_xxh3_128": gallery["embedder_xxh3_128"],
               "enrolment_xxh3_128": gallery["enrolment_xxh3_128"], "rows": gallery["rows"], "dim": gallery["dim"],
               "sha256": _gallery_sha256(tree / GALLERY_DIR), "host_class": host_class()}
        return {**doc, "run": systems.record_enrolment(reg, name, version, doc), "system": name, "version": version}


def _check_re_enrolment(reg, name: str, version: int, gallery: dict[str, Any], gdir: Path) -> dict[str, Any] | None:
    """When this version was promoted past `re-enroll required`, the gallery a release enrols now is checked against
    the re-enrolment that promotion relied on: the same embedder build, enrolment set, rows and dimension — and,
    enrolled on the same host class, the same bytes. None when no re-enrolment was needed."""
    from pipeline.registry.aliases import recorded
    from pipeline.registry.systems import COMPAT
    from pipeline.toolchain import host_class

    rec = recorded(reg, name, version, COMPAT)
    if rec.get("re_enroll") != "true":
        return None
    enrolled = json.loads(rec.get("enrolment") or "{}")
    mine = {"embedder_xxh3_128": gallery["embedder_xxh3_128"], "enrolment_xxh3_128": gallery["enrolment_xxh3_128"],
            "rows": str(gallery["rows"]), "dim": str(gallery["dim"])}
    if enrolled.get("host_class") == host_class():      # the same kernels: the same bytes, or something changed
        mine["sha256"] = _gallery_sha256(gdir)
    if bad := [k for k, val in mine.items() if enrolled.get(k) != val]:
        raise GateFailed(f"{name} v{version}: the gallery enrolled now differs from the re-enrolment its promotion "
                         f"relied on (run {enrolled.get('run', '?')}): {bad[0]} {mine[bad[0]]} vs "
                         f"{str(enrolled.get(bad[0]))[:64]}", "re-enrol again (kiln re-enroll --system), then "
                         "promote with --re-enroll")
    return {k: enrolled.get(k) for k in ("run", "sha256", "rows", "dim", "embedder", "host_class")}


def _enrol(tree: Path, v, dcfg: Config, root: Path) -> dict[str, Any]:
    """gallery/: the enrolment embeddings of the shipped embedder engine over the enrolment set system@ gated with,
    their labels and a manifest; returns release.json's summary of it."""
    import numpy as np

    from pipeline import samples
    from pipeline.closure import closure, code_digests
    from pipeline.e2e import System
    from pipeline.toolchain import host_class

    system, described = v.system, v.described
    embedder = v.embedder
    enrol = paths.data_set(samples.chip_set(dcfg, embedder.model, "golden"), root)
    mpath = manifest_path(enrol, enrol.name)
    if not mpath.is_file():
        raise KilnError(f"{mpath}: the enrolment set is not here", f"build or restore it: dvc repro "
                        f"{'dataset@' + enrol.name}, or dvc checkout")
    enrol_id = identity_digest(read_verified(mpath, hint="restore it: dvc checkout"))
    if enrol_id != described.get("enrolment_xxh3_128"):
        raise GateFailed(f"{mpath}: identity {enrol_id}, but system {system} was gated with enrolment set "
                         f"{described.get('enrolment_xxh3_128')}", "restore the set the system was gated with "
                         f"(dvc checkout), or gate the system again (dvc repro {address(f'system@{system}')}) and "
                         "register it")
    dirs = {p.model: tree / ENGINES_DIR / p.engine for p in v.parts}
    made = System.from_dirs(dcfg, system, dirs, {p.model: p.engine for p in v.parts}, system)
    made.enroll(root)
    emb, labels = made.gallery
    emb = np.ascontiguousarray(emb, np.float32)
    gdir = tree / GALLERY_DIR
    gdir.mkdir(parents=True)
    buf = io.BytesIO()
    np.save(buf, emb, allow_pickle=False)
    (gdir / EMBEDDINGS).write_bytes(buf.getvalue())
    (gdir / LABELS).write_bytes(json_bytes(list(labels)))
    eman = tree / ENGINES_DIR / embedder.engine / manifest_path(Path(""), embedder.engine)
    emodel = dcfg.model(embedder.model)
    engine_manifest = json.loads(eman.read_bytes())
    m = build_manifest(
        kind="gallery", name=system, directory=gdir, files=[gdir / EMBEDDINGS, gdir / LABELS],
        inputs=[{"role": "embedder", "manifest": eman.relative_to(tree).as_posix(), "xxh3_128": embedder.xxh3_128},
                {"role": "enrolment", "manifest": mpath.relative_to(root).as_posix(), "xxh3_128": enrol_id}],
        toolchain={**(engine_manifest.get("toolchain") or {}), "host_class": host_class()},
        build={"enrolled": "the enrolment set's un-augmented chips, embedded by the embedder engine (System.enroll)",
               "embedder": embedder.engine, "rows": int(emb.shape[0]), "dim": int(emb.shape[1]),
               "metric": emodel.metric, "verify_threshold": emodel.verify_threshold},
        code=code_digests(closure(["pipeline.release.system", "pipeline.e2e"])[0]),
        params={f"models.{embedder.model}": dcfg.raw["models"][embedder.model]},
        model=embedder.model, target=engine_manifest.get("target"), precision=engine_manifest.get("precision"))
    release.write_json(manifest_path(gdir, system), m)
    return {"manifest": f"{GALLERY_DIR}/{manifest_path(Path(''), system).as_posix()}",
            "manifest_xxh3_128": identity_digest(m), "embedder": embedder.engine,
            "embedder_xxh3_128": embedder.xxh3_128, "enrolment_xxh3_128": enrol_id, "rows": int(emb.shape[0]),
            "dim": int(emb.shape[1]), "identities": len(set(labels))}


def _compat(reg, name: str, version: int, re_enrolled: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The gallery check the newest production move of this version decided by, as that move's run recorded it
    (parameters, never the version's editable tags); None: never measured (the same embedder, or never promoted)."""
    from pipeline.registry.aliases import recorded
    from pipeline.registry.systems import COMPAT

    rec = recorded(reg, name, version, COMPAT)
    if not rec:
        return None
    return {"verdict": rec.get("verdict"), "vs": rec.get("vs"), "limits": json.loads(rec.get("limits") or "{}"),
            "re_enroll": rec.get("re_enroll") == "true", **({"re_enrolment": re_enrolled} if re_enrolled else {})}


def _payload(tree: Path) -> dict[str, str]:
    from pipeline.manifest import sha256_file

    return {p.relative_to(tree).as_posix(): sha256_file(p) for p in sorted(tree.rglob("*"))
            if p.is_file() and p.relative_to(tree).as_posix() not in TOP_DOCS}


def _statement(reg, tree: Path, doc: dict, v, payload: dict[str, str], lockfiles: dict[str, str]) -> dict:
    """The engine releases' SLSA statement (attestation.slsa_statement): its build nodes are the shipped
    manifests (the system's, each engine's, the gallery's); its subjects every payload file."""
    def node(rel: str, stage: str) -> dict[str, Any]:
        m = json.loads((tree / rel).read_bytes())
        return {"manifest": rel, "kind": m["kind"], "name": m["name"], "stage": stage,
                "params": {"values": (m.get("params") or {}).get("values") or {}},
                "toolchain": m.get("toolchain") or {}, "code": {"modules": m.get("code") or {}}}

    engines = [node(f"{p['dir']}/{p['engine']}.manifest.json", f"compile@{p['engine']}") for p in doc["parts"]]
    gallery = node(doc["gallery"]["manifest"], f"release --system {doc['system']}")
    chain = {**node(doc["system_manifest"], f"system@{doc['system']}"),
             "inputs": [{"node": n} for n in (*engines, gallery)]}
    mv = reg.version(doc["registered_model"], doc["version"])      # the run's record, not the editable tag
    commit = (reg.client.get_run(mv.run_id).data.params if mv.run_id else {}).get("kiln.git_commit", "")
    record = {"stage": f"system@{doc['system']}"} | (
        {"git": {"commit": commit}} if re.fullmatch(r"[0-9a-f]{40}", commit) else {})
    verdict = {"verdict": v.verdict.get("verdict"), "metrics": v.verdict.get("metrics") or {}}
    st = attestation.slsa_statement(doc, payload, chain, record, verdict, None, lockfiles)
    # its subjects are named engine/<path> (one engine's files); a system release's are the tree's own paths
    st["subject"] = [{"name": rel, "digest": {"sha256": sha}} for rel, sha in sorted(payload.items())]
    return st


# ---------------------------------------------------------------------------------------------- verifying
def check_content(tree: Path, signed_name: str) -> list[str]:
    """Check a signed system release tree offline (after its signature holds): the runtime's checks
    (kiln_runtime.release.check_system — what a deployment host checks), then the config slice against params.yaml's
    own types (`deploy_config`: the build's schema). Returns what was checked; GateFailed at the first failure."""
    done = check_system(tree, signed_name)
    doc = read_doc(tree / "release.json", "release.json")
    deploy_config(read_doc(tree / CONFIG_FILE, CONFIG_FILE), Path(CONFIG_FILE)).system(doc["system"])
    return done


def check_any(tree: Path, signed_name: str) -> list[str]:
    """The content check of a signed release tree of either kind: a system's (above) or an engine's."""
    from pipeline.release import content as release_content

    return (check_content if is_system_release(tree) else release_content.check_content)(tree, signed_name)


def verified(archive: Path, public_key: Path, runtime: bool = True):
    """kiln_runtime.release `verified` of a release of either kind: a context yielding (the signed tree, what was
    checked); `runtime`: check a system release's engines against this host's runtime (not for `kiln push`)."""
    return runtime_verified(archive, public_key, check_any, runtime=runtime)


def verify(archive: Path, public_key: Path) -> list[str]:
    """Verify a release archive of either kind offline (`kiln verify-release`); returns what was checked, raises
    GateFailed at the first failure."""
    with verified(archive, public_key) as (_, done):
        return done


# ---------------------------------------------------------------------------------------------- deploying
def deployed(tree: Path, checked: list[str] | None = None) -> Deployed:
    """The System of a verified, extracted system release tree (kiln_runtime.release.load: what a deployment host
    runs, from the release's files alone). Refused if this checkout would gate the system otherwise than it was gated:
    its detector settings, thresholds or preprocessing (pipeline/gates/system.py `describe`) differ."""
    from pipeline.gates import system as gate

    doc = json.loads((tree / "release.json").read_bytes())
    system = doc["system"]
    described = json.loads((tree / SYSTEM_DIR / SYSTEM_FILE).read_bytes())
    dcfg = deploy_config(json.loads((tree / CONFIG_FILE).read_bytes()), tree / CONFIG_FILE)
    picks = {p["model"]: p["engine"] for p in doc["parts"]}
    refs = {m: {"engine": {"xxh3_128": e["xxh3_128"]}, "validation": {"xxh3_128": e["validation_xxh3_128"]}}
            for m, e in described["engines"].items()}
    here = json.loads(json.dumps(gate.describe(dcfg, system, picks, refs)))      # as system.json holds it
    if differ := sorted(k for k in here if here[k] != described.get(k)):
        raise GateFailed(f"{doc['registered_model']} v{doc['version']}: this kiln would run it otherwise than it was "
                         f"gated: {', '.join(differ)} differ from its system.json",
                         "run it with the kiln version that gated it (see slsa-provenance.json), or gate, register "
                         "and release the system again with this one")
    return load(tree, checked)


__all__ = ["Deployed", "SCHEMA", "build", "check_any", "check_content", "check_gallery", "deploy_config", "deployed",
           "is_system_release", "verified", "verify"]
