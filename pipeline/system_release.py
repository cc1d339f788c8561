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
      lockfiles.json        sha256 of the releasing checkout's lockfiles
      slsa-provenance.json  in-toto Statement v1 / SLSA Provenance v1 (pipeline/attestation.py); subjects: every
                            file above but the three top documents
    <R>.sig                 the model-signing bundle over <R>/ (pipeline/signing.py)

The archive is written, read and signed exactly as an engine release (pipeline/release.py, pipeline/archive.py), so
the same inputs give the same bytes. An engine's upstream chain (quantized → … → assets) is its own engine
release's; a system release names each engine by its identity digest.

`check_content` is what `verify-release` adds offline after the signature holds: the system manifest and its
content digest, the pins (each shipped engine's identity digest IS the system version's pin), each engine's
verdict, the config slice against the system manifest, the gallery against the pinned embedder and the enrolment
set, that the tree holds exactly the files its manifests declare, the gallery as identify will read it (`check_gallery`:
the .npy header alone first — C-order little-endian float32 of rows × the embedder's output width recorded at release
time, exactly that many bytes, bounded — then finite, bounded values through a memory map; identity-slug labels, one
per row), the SLSA subjects. `deployed` builds the System from a verified, extracted tree alone: no checkout, no DVC, no
registry, no params.yaml.
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StrictInt, StrictStr

from pipeline import attestation, paths, release, signing
from pipeline import config as C
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import (artifact_digest, build_manifest, check_files, identity_digest, json_bytes,
                               manifest_path, params_digest, read_verified)
from pipeline.release_content import _doc, _manifest

SCHEMA = "kiln.system-release/1"
SYSTEM_DIR, ENGINES_DIR, CONFIG_FILE, GALLERY_DIR = "system", "engines", "config/params.json", "gallery"
EMBEDDINGS, LABELS = "embeddings.npy", "labels.json"
TOP_DOCS = ("release.json", "lockfiles.json", "slsa-provenance.json")     # about the payload, not in it
SECTIONS = ("data", "models", "engines", "systems")                      # what a system@ params slice holds
COMPAT_VERDICTS = ("compatible", "re-enroll required")                   # pipeline/gates/gallery_compat.py


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


def deploy_config(values: dict[str, Any], source: Path):
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
    from pipeline.registry.releases import PRODUCTION

    ref = str(ref)
    if re.fullmatch(r"v?[0-9]{1,9}", ref):
        return int(ref.removeprefix("v"))
    version = reg.aliases(name).get(paths.slug(ref, "alias"))
    if version is None:
        raise KilnError(f"{name}: no version has the alias {ref!r}",
                        f"promote one first (kiln promote --system {system} VERSION)" if ref == PRODUCTION else
                        f"see the aliases with: kiln history --system {system}")
    return int(version)


def build(cfg, system: str, ref: str = "production", root: Path = Path("."), key: Path | None = None,
          out_dir: Path | None = None) -> release.Release:
    """Release version `ref` (a number or an alias; default production) of face system `system` as one signed
    deterministic archive; recorded in the registry like an engine release (alias `release`, history)."""
    from pipeline.registry import systems
    from pipeline.registry.client import Registry, errors
    from pipeline.registry.releases import KILN_DIR, settle

    root = Path(root)
    key = signing.key_path(str(key) if key else None)
    if not key.is_file():
        raise KilnError(f"{key}: signing key not found", "make one with `kiln keygen --out PATH`")
    signing.outside_repo(key, "signing key")
    out_dir = Path(out_dir) if out_dir else root / release.RELEASES
    name, system = systems.registered(system), systems.system_name(system)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-release-") as tmp, release._writing(Path(tmp)):
        scratch = Path(tmp)
        systems._require(reg, name)
        with reg.lock(name):          # the alias read and the record under the lock every move takes
            settle(reg, name)
            version = _resolve(reg, name, system, ref)
            v, _, proven = systems._prove(reg, name, version, scratch / "proof")    # what promote demands, and more
            rel = f"{name}-v{version}"
            tree = scratch / rel
            sdir = tree / SYSTEM_DIR
            for f in (paths.SYSTEM_FILE, paths.VERDICT_FILE, manifest_path(Path(""), system).as_posix(),
                      f"{KILN_DIR}/{systems.PARTS_FILE}"):
                release._copy(v.directory / f, sdir / f)
            parts = _stage_parts(v, proven, tree)
            values = v.manifest["params"]["values"]
            release._write(tree / CONFIG_FILE, values)
            gallery = _enrol(tree, v, deploy_config(values, tree / CONFIG_FILE), root)
            re_enrolled = _check_re_enrolment(reg, name, version, gallery, tree / GALLERY_DIR)
            doc = {"schema": SCHEMA, "kind": "system", "registered_model": name, "version": version, "system": system,
                   "artifact": systems.PREFIX + system,
                   "system_manifest": f"{SYSTEM_DIR}/{manifest_path(Path(''), system).as_posix()}",
                   "system_manifest_xxh3_128": identity_digest(v.manifest),
                   "system_sha256": systems._content(system, v.manifest, v.parts),
                   "verdict": v.verdict.get("verdict"), "parts": parts, "config": CONFIG_FILE, "gallery": gallery,
                   "gallery_compat": _compat(reg, name, version, re_enrolled)}
            payload = _payload(tree)
            lockfiles = attestation.lockfiles()
            release._write(tree / "release.json", doc)
            release._write(tree / "lockfiles.json", lockfiles)
            release._write(tree / "slsa-provenance.json", _statement(reg, tree, doc, v, payload, lockfiles))
            signing.sign_tree(tree, scratch / f"{rel}{release.SIG_SUFFIX}", key)
            dest = out_dir / f"{rel}.tar.gz"
            staged = scratch / "archive.tar.gz"
            sha = release.write_archive(staged, scratch, [rel, f"{rel}{release.SIG_SUFFIX}"])
            release._place(staged, dest, sha)
            recorded = release._record(reg, name, version, str(ref), dest, sha, locked=True)
    return release.Release(dest, sha, name, version, recorded)


def _stage_parts(v, proven: dict, tree: Path) -> list[dict[str, Any]]:
    """Each pinned part, as `_prove` downloaded and verified it (`proven`: model → Verified), copied to
    tree/engines/<engine>/; release.json's rows of them. A system's engines all ran on system@'s host, so each must
    carry its own stored pass (a verdict attached later by another host is not enough here)."""
    from pipeline.registry.releases import KILN_DIR, PARAM

    parts = []
    for p in v.parts:
        ev = proven[p.model]
        if ev.verdict.get("verdict") != "pass":
            raise GateFailed(f"{p.registered_model} v{p.version}: its stored verdict is not pass",
                             "validate it on a host with its runtime, then register the system again")
        edir = tree / ENGINES_DIR / p.engine
        for f in [e["path"] for e in ev.manifest["files"]] + [manifest_path(Path(""), p.engine).as_posix()]:
            release._copy(ev.directory / f, edir / f)
        for f in sorted((ev.directory / KILN_DIR).iterdir()):
            release._copy(f, edir / KILN_DIR / f.name)
        parts.append({**asdict(p), "dir": f"{ENGINES_DIR}/{p.engine}",
                      "validation_manifest_xxh3_128": ev.params[PARAM + "validation_manifest_xxh3_128"]})
    return parts


def _gallery_sha256(gdir: Path) -> str:
    """One digest of an enrolled gallery: its embeddings file and its labels file, as released."""
    import hashlib

    h = hashlib.sha256()
    for f in (EMBEDDINGS, LABELS):
        data = (gdir / f).read_bytes()
        h.update(f"{f}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def re_enroll(cfg, system: str, version: int | str, root: Path = Path(".")) -> dict[str, Any]:
    """`kiln re-enroll --system NAME VERSION`: enrol the gallery with version VERSION's embedder exactly as its
    release will (the same parts, config slice and enrolment set: `_enrol`), and record it in the registry
    (`kiln-enrolments`, immutable parameters) — the step a `re-enroll required` promotion needs first, and what a
    release of that version is later checked against."""
    from pipeline.registry import systems
    from pipeline.registry.client import Registry, errors
    from pipeline.toolchain import host_class

    name, system, root = systems.registered(system), systems.system_name(system), Path(root)
    version = systems._version(version)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-enrol-") as tmp:
        scratch = Path(tmp)
        systems._require(reg, name)
        v, _, proven = systems._prove(reg, name, version, scratch / "proof")
        tree = scratch / "tree"
        _stage_parts(v, proven, tree)
        values = v.manifest["params"]["values"]
        release._write(tree / CONFIG_FILE, values)
        gallery = _enrol(tree, v, deploy_config(values, tree / CONFIG_FILE), root)
        doc = {"embedder": gallery["embedder"], "embedder_xxh3_128": gallery["embedder_xxh3_128"],
               "enrolment_xxh3_128": gallery["enrolment_xxh3_128"], "rows": gallery["rows"], "dim": gallery["dim"],
               "sha256": _gallery_sha256(tree / GALLERY_DIR), "host_class": host_class()}
        return {**doc, "run": systems.record_enrolment(reg, name, version, doc), "system": name, "version": version}


def _check_re_enrolment(reg, name: str, version: int, gallery: dict[str, Any], gdir: Path) -> dict[str, Any] | None:
    """When this version was promoted past `re-enroll required`, the gallery a release enrols now is checked against
    the re-enrolment that promotion relied on: the same embedder build, enrolment set, rows and dimension — and,
    enrolled on the same host class, the same bytes. None when no re-enrolment was needed."""
    from pipeline.registry.releases import recorded
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


def _enrol(tree: Path, v, dcfg, root: Path) -> dict[str, Any]:
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
                         "(dvc checkout), or gate the system again (dvc repro system@NAME) and register it")
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
        code=code_digests(closure(["pipeline.system_release", "pipeline.e2e"])[0]),
        params={f"models.{embedder.model}": dcfg.raw["models"][embedder.model]},
        model=embedder.model, target=engine_manifest.get("target"), precision=engine_manifest.get("precision"))
    release._write(manifest_path(gdir, system), m)
    return {"manifest": f"{GALLERY_DIR}/{manifest_path(Path(''), system).as_posix()}",
            "manifest_xxh3_128": identity_digest(m), "embedder": embedder.engine,
            "embedder_xxh3_128": embedder.xxh3_128, "enrolment_xxh3_128": enrol_id, "rows": int(emb.shape[0]),
            "dim": int(emb.shape[1]), "identities": len(set(labels))}


def _compat(reg, name: str, version: int, re_enrolled: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The gallery check the newest production move of this version decided by, as that move's run recorded it
    (parameters, never the version's editable tags); None: never measured (the same embedder, or never promoted)."""
    from pipeline.registry.releases import recorded
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
def is_system_release(tree: Path) -> bool:
    doc = _doc(tree / "release.json", "release.json")
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


def _fail(what: str, why: str) -> GateFailed:
    return GateFailed(f"{what}: {why}", "do not use this release")


def check_content(tree: Path, signed_name: str) -> list[str]:
    """Check a signed system release tree offline (after its signature holds); returns what was checked, raises
    GateFailed at the first failure."""
    from pipeline.manifest import sha256_file
    from pipeline.registry import systems

    doc = _doc(tree / "release.json", "release.json")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise _fail("release.json", f"missing or not schema {SCHEMA}")
    system = paths.slug(doc.get("system"), "released system")
    name = systems.registered(system)
    expected = f"{name}-v{doc.get('version')}"
    if doc.get("registered_model") != name or not (tree.name == signed_name == expected):
        raise _fail("release.json", f"this is {expected}, but the archive's directory is {tree.name!r} and the "
                    f"signature's subject {signed_name!r}")
    # the system version: its files, content digest, pins, gate
    sdir = tree / SYSTEM_DIR
    mrel = f"{SYSTEM_DIR}/{manifest_path(Path(''), system).as_posix()}"
    manifest = _manifest(tree / mrel, mrel)
    if (manifest.get("kind"), manifest.get("name")) != ("system", system):
        raise _fail(mrel, f"describes {str(manifest.get('kind'))[:40]} {str(manifest.get('name'))[:100]!r}")
    if problems := check_files(tree / mrel, manifest):
        raise _fail(mrel, "; ".join(p.replace(str(tree) + os.sep, "") for p in problems[:3]))
    if identity_digest(manifest) != doc.get("system_manifest_xxh3_128"):
        raise _fail(mrel, f"identity {identity_digest(manifest)}, release.json says "
                    f"{doc.get('system_manifest_xxh3_128')}")
    prel = f"{SYSTEM_DIR}/kiln/{systems.PARTS_FILE}"
    try:
        parts = tuple(systems.Part(**{**p, "version": int(p["version"])}) for p in _doc(tree / prel, prel))
    except (TypeError, KeyError, ValueError):
        raise _fail(prel, "not a list of parts") from None
    if systems._content(system, manifest, parts) != doc.get("system_sha256"):
        raise _fail(prel, "the system's files and pins are not the registered content (release.json system_sha256)")
    described = _doc(sdir / paths.SYSTEM_FILE, f"{SYSTEM_DIR}/{paths.SYSTEM_FILE}")
    verdict = _doc(sdir / paths.VERDICT_FILE, f"{SYSTEM_DIR}/{paths.VERDICT_FILE}")
    gated = {m: (e.get("engine"), e.get("xxh3_128")) for m, e in (described.get("engines") or {}).items()}
    if gated != {p.model: (p.engine, p.gated_xxh3_128) for p in parts}:
        raise _fail(prel, "the pins are not the engines its system.json was gated with")
    if verdict.get("system") != system or verdict.get("verdict") != "pass":
        raise _fail(f"{SYSTEM_DIR}/{paths.VERDICT_FILE}", f"system {str(verdict.get('system'))[:100]!r}, verdict "
                    f"{str(verdict.get('verdict'))[:40]!r}; a release needs system {system!r}, pass")
    listed = [{k: p.get(k) for k in ("model", "engine", "registered_model", "version", "xxh3_128", "sha256",
                                         "gated_xxh3_128")}
              for p in doc.get("parts") or []]
    if listed != [asdict(p) for p in parts]:
        raise _fail("release.json", f"its parts are not the pins in {prel}")
    done = [f"system: {name} v{doc['version']}, system.json + verdict.json match {mrel}; content digest and pins "
            f"= release.json's, as signed ({len(parts)} parts); system gate pass"]
    # each engine IS its pin
    for p, entry in zip(parts, doc["parts"]):
        edir = tree / ENGINES_DIR / paths.slug(p.engine, "engine")
        if entry.get("dir") != f"{ENGINES_DIR}/{p.engine}":
            raise _fail("release.json", f"part {p.model}: dir {str(entry.get('dir'))[:100]!r}")
        erel = f"{ENGINES_DIR}/{p.engine}/{p.engine}.manifest.json"
        em = _manifest(tree / erel, erel)
        if em.get("kind") != "engine" or em.get("model") != p.model:
            raise _fail(erel, f"not a {p.model} engine")
        if problems := check_files(tree / erel, em):
            raise _fail(erel, "; ".join(x.replace(str(tree) + os.sep, "") for x in problems[:3]))
        if identity_digest(em) != p.xxh3_128:
            raise _fail(erel, f"identity {identity_digest(em)}, but the system version pins {p.engine} at "
                        f"{p.xxh3_128}")
        if artifact_digest(em) != p.sha256:
            raise _fail(erel, "content digest differs from the registered one the system version pins")
        vrel = f"{ENGINES_DIR}/{p.engine}/kiln/{p.engine}.manifest.json"
        vm = _manifest(tree / vrel, vrel)
        if check_files(tree / vrel, vm) or identity_digest(vm) != entry.get("validation_manifest_xxh3_128"):
            raise _fail(vrel, "validation manifest or its files differ from the registered ones")
        vdoc = _doc(edir / "kiln" / paths.VALIDATION_FILE, f"{ENGINES_DIR}/{p.engine}/kiln/{paths.VALIDATION_FILE}")
        if not isinstance(vdoc, dict) or vdoc.get("engine_manifest_xxh3_128") != p.xxh3_128 or \
                vdoc.get("verdict") != "pass":
            raise _fail(f"{ENGINES_DIR}/{p.engine}/kiln/{paths.VALIDATION_FILE}",
                        "not a pass about this exact build")
    done.append(f"engines: {len(parts)}, each one's files match its manifest and its identity digest is the system "
                "version's pin (" + ", ".join(f"{p.engine} {p.xxh3_128[:8]}" for p in parts) + "); each "
                "validation pass about its exact build")
    # the config slice
    values = _doc(tree / CONFIG_FILE, CONFIG_FILE)
    if values != (manifest.get("params") or {}).get("values") or \
            params_digest(values) != (manifest.get("params") or {}).get("sha256"):
        raise _fail(CONFIG_FILE, "not the params slice the system was gated with (its manifest's params)")
    dcfg = deploy_config(values, Path(CONFIG_FILE))
    dcfg.system(system)
    done.append(f"config: {CONFIG_FILE} is the params slice system@ gated with ({len(values)} keys, sha256 "
                f"{params_digest(values)[:12]})")
    # the gallery
    g = doc.get("gallery") or {}
    grel = f"{GALLERY_DIR}/{manifest_path(Path(''), system).as_posix()}"
    gm = _manifest(tree / grel, grel)
    if (gm.get("kind"), gm.get("name")) != ("gallery", system) or g.get("manifest") != grel:
        raise _fail(grel, f"not the gallery of system {system}")
    if problems := check_files(tree / grel, gm):
        raise _fail(grel, "; ".join(x.replace(str(tree) + os.sep, "") for x in problems[:3]))
    embedder = next((p for p in parts if p.model == described.get("embedder")), None)
    if embedder is None:
        raise _fail(f"{SYSTEM_DIR}/{paths.SYSTEM_FILE}", "names no pinned embedder")
    refs = {r.get("role"): r for r in gm["inputs"] if isinstance(r, dict)}
    want = {"manifest": f"{ENGINES_DIR}/{embedder.engine}/{embedder.engine}.manifest.json",
            "xxh3_128": embedder.xxh3_128}
    if {k: (refs.get("embedder") or {}).get(k) for k in want} != want:
        raise _fail(grel, f"the gallery was made by {str((refs.get('embedder') or {}).get('manifest'))[:200]} "
                    f"{(refs.get('embedder') or {}).get('xxh3_128')}, not by the pinned embedder {embedder.engine} "
                    f"{embedder.xxh3_128}")
    if (refs.get("enrolment") or {}).get("xxh3_128") != described.get("enrolment_xxh3_128"):
        raise _fail(grel, "enrolled from another set than the one the system was gated with")
    if identity_digest(gm) != g.get("manifest_xxh3_128") or \
            (g.get("embedder"), g.get("embedder_xxh3_128")) != (embedder.engine, embedder.xxh3_128):
        raise _fail("release.json", "its gallery entry is not the shipped gallery")
    if sorted(str(e.get("path")) for e in gm["files"]) != sorted((EMBEDDINGS, LABELS)):
        raise _fail(grel, f"its files are not exactly {EMBEDDINGS} and {LABELS}")
    rows, dim = _gallery_shape(gm, g, grel)
    _declared_files(tree, system, parts)                  # nothing else in the tree, nothing missing
    labels = check_gallery(tree / GALLERY_DIR, rows, dim)
    done.append(f"gallery: {rows} enrolment embeddings × {dim} of {len(set(labels))} identities, "
                f"made by {embedder.engine} (manifest {embedder.xxh3_128[:8]}) = the pinned embedder, from the "
                f"enrolment set system@ gated ({described.get('enrolment_xxh3_128', '')[:8]})")
    # the statement
    st = _doc(tree / "slsa-provenance.json", "slsa-provenance.json")
    if not isinstance(st, dict) or st.get("predicateType") != attestation.SLSA_PREDICATE:
        raise _fail("slsa-provenance.json", "missing or not a SLSA Provenance v1 statement")
    subjects = {s.get("name"): (s.get("digest") or {}).get("sha256") for s in st.get("subject", [])}
    payload = {p.relative_to(tree).as_posix(): p for p in tree.rglob("*")
               if p.is_file() and p.relative_to(tree).as_posix() not in TOP_DOCS}
    if set(subjects) != set(payload) or any(sha256_file(payload[n]) != sha for n, sha in subjects.items()):
        raise _fail("slsa-provenance.json", "its subjects are not exactly the released files and digests")
    done.append(f"slsa: {len(subjects)} subject(s) = every released file; "
                f"{len(st['predicate']['buildDefinition']['resolvedDependencies'])} resolved dependencies")
    compat = doc.get("gallery_compat")
    if compat is not None and (not isinstance(compat, dict) or compat.get("verdict") not in COMPAT_VERDICTS):
        raise _fail("release.json", "its gallery_compat is not a verdict a gallery check gives")
    if compat:
        done.append(f"gallery-compat at promotion: {str(compat.get('verdict'))[:40]} vs "
                    f"{str(compat.get('vs'))[:100]}" + ("; a gallery enrolled by that engine must be re-enrolled "
                                                         "with this release's embedder" if
                                                         compat.get("verdict") != "compatible" else ""))
    if compat and isinstance(enrolled := compat.get("re_enrolment"), dict):      # the check release --system made
        shipped = _gallery_sha256(tree / GALLERY_DIR)
        if enrolled.get("sha256") == shipped:
            done.append(f"re-enrolment at promotion (run {str(enrolled.get('run'))[:40]}): this gallery, byte for byte")
        elif str(enrolled.get("host_class")) == str((gm.get("toolchain") or {}).get("host_class")):
            raise _fail(f"{GALLERY_DIR}/{EMBEDDINGS}", "not the gallery re-enrolled at promotion on the same host "
                        f"class (sha256 {shipped[:12]} vs {str(enrolled.get('sha256'))[:12]})")
        else:
            done.append(f"re-enrolment at promotion (run {str(enrolled.get('run'))[:40]}): enrolled on host class "
                        f"{str(enrolled.get('host_class'))[:40]}, this gallery on another")
    return done


# Bounds on a release's gallery, checked from the .npy header before a byte of it is read. The gallery is the
# enrolment set's un-augmented chips (tens of rows); identify searches it by brute force, holding a (faces × rows ×
# dim) float32 difference, so 100 000 rows of ≤ 4096 (a 512-d embedder: 200 MB per face searched) is past anything
# it can serve — a larger gallery is a FAISS index, never part of a system release. |values| ≤ 1e6: any real
# embedding is far inside, and squared L2 distances over 4096 dims of such values cannot overflow float32.
MAX_GALLERY_ROWS, MAX_GALLERY_DIM, MAX_GALLERY_ABS = 100_000, 4096, 1e6
_CHUNK = 1 << 22                  # values checked at a time (16 MiB): the memory-mapped file is never read whole


def _count(value: Any, low: int, high: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high else None


def _gallery_shape(gm: dict, g: dict, grel: str) -> tuple[int, int]:
    """(rows, dim) of the gallery: as its manifest recorded them when the pinned embedder made it at release time
    (dim = the embedder's output width), the same in release.json, and within the bounds above."""
    build = gm.get("build") or {}
    rows, dim = _count(build.get("rows"), 1, MAX_GALLERY_ROWS), _count(build.get("dim"), 1, MAX_GALLERY_DIM)
    if rows is None or dim is None:
        raise _fail(grel, f"build rows {str(build.get('rows'))[:40]!r} × dim {str(build.get('dim'))[:40]!r}: a "
                    f"gallery is 1-{MAX_GALLERY_ROWS} rows of the embedder's 1-{MAX_GALLERY_DIM}-d output")
    if (g.get("rows"), g.get("dim")) != (rows, dim):
        raise _fail("release.json", f"its gallery is {str(g.get('rows'))[:40]} × {str(g.get('dim'))[:40]}, the "
                    f"gallery manifest's {rows} × {dim}")
    return rows, dim


def check_gallery(gdir: Path, rows: int, dim: int) -> list[str]:
    """A release's gallery/ as identify will read it, checked without loading it: labels.json is `rows` identity
    slugs; embeddings.npy's header says exactly C-order little-endian float32 (rows, dim) and the file is that many
    bytes after it; every value is finite and |x| ≤ MAX_GALLERY_ABS (read through a memory map, in chunks).
    Returns the labels; raises GateFailed naming the first problem."""
    import numpy as np
    from numpy.lib import format as npy

    from pipeline.tables import shown

    lrel, erel = f"{GALLERY_DIR}/{LABELS}", f"{GALLERY_DIR}/{EMBEDDINGS}"
    labels = _doc(gdir / LABELS, lrel)
    if not isinstance(labels, list) or len(labels) != rows:
        raise _fail(lrel, f"not a list of {rows} identity names (one per gallery row)")
    bad = next((i for i, x in enumerate(labels) if not paths.is_identity(x)), None)
    if bad is not None:                   # printed by identify: a newline in one would forge an output line
        raise _fail(lrel, f"row {bad}: {shown(repr(labels[bad]), 80)} is not an identity name (1-64 letters, digits, "
                    "'-' or '_')")
    path = gdir / EMBEDDINGS
    try:
        with open(path, "rb") as f:
            version = npy.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"format version {version}")
            shape, fortran, dtype = (npy.read_array_header_1_0 if version == (1, 0) else
                                     npy.read_array_header_2_0)(f)
            offset = f.tell()
    except (OSError, ValueError, SyntaxError, TypeError) as e:
        raise _fail(erel, f"not a .npy array header ({shown(str(e), 100)})") from None
    if dtype != np.dtype("<f4") or dtype.str != "<f4" or fortran or tuple(shape) != (rows, dim):
        raise _fail(erel, f"{'Fortran' if fortran else 'C'}-order {dtype.str} {tuple(shape)}; the gallery is "
                    f"C-order <f4 ({rows}, {dim}): {rows} rows × the embedder's {dim}-d output")
    size = path.stat().st_size
    if size != offset + rows * dim * 4:
        raise _fail(erel, f"{size} bytes; its header declares {offset} + {rows}×{dim}×4 = {offset + rows * dim * 4}")
    values = np.memmap(path, dtype="<f4", mode="r", offset=offset, shape=(rows * dim,))
    try:
        for at in range(0, rows * dim, _CHUNK):
            chunk = values[at:at + _CHUNK]
            if not np.isfinite(chunk).all():
                raise _fail(erel, f"row {(at + int(np.argmin(np.isfinite(chunk)))) // dim} holds a NaN or infinity")
            if np.abs(chunk).max() > MAX_GALLERY_ABS:
                raise _fail(erel, f"row {(at + int(np.argmax(np.abs(chunk)))) // dim} holds a value beyond "
                            f"±{MAX_GALLERY_ABS:g}; no embedder outputs that")
    finally:
        del values
    return labels


def _declared_files(tree: Path, system: str, parts) -> None:
    """The tree holds exactly the files a system release declares: the top documents, system/ (its manifest's
    files, the manifest, the pins), each engine's manifest files, manifest and kiln/ (its validation manifest and
    that manifest's files; bench.json and build-record.json when registered with them), the config slice and
    gallery/ (its manifest's two files and the manifest)."""
    from pipeline.registry import systems
    from pipeline.registry.registration import BENCH_FILE, RECORD_FILE
    from pipeline.tables import shown

    def listed(mrel: str) -> set[str]:
        m = _manifest(tree / mrel, mrel)
        base = str(Path(mrel).parent.as_posix())
        return {mrel, *(f"{base}/{e['path']}" for e in m["files"])}

    mname = manifest_path(Path(""), system).as_posix()
    want = {*TOP_DOCS, CONFIG_FILE, f"{SYSTEM_DIR}/kiln/{systems.PARTS_FILE}", *listed(f"{SYSTEM_DIR}/{mname}"),
            *listed(f"{GALLERY_DIR}/{mname}")}
    optional = set()
    for p in parts:
        edir = f"{ENGINES_DIR}/{p.engine}"
        want |= listed(f"{edir}/{p.engine}.manifest.json") | listed(f"{edir}/kiln/{p.engine}.manifest.json")
        optional |= {f"{edir}/kiln/{BENCH_FILE}", f"{edir}/kiln/{RECORD_FILE}"}
    have = {q.relative_to(tree).as_posix() for q in tree.rglob("*") if not q.is_dir()}
    if extra := sorted(have - want - optional):
        raise _fail(shown(extra[0], 200), "not a file this system release declares (its manifests, pins and "
                    "documents)" + (f"; {len(extra) - 1} more" if len(extra) > 1 else ""))
    if missing := sorted(want - have):
        raise _fail(shown(missing[0], 200), "declared but not in the release")


def check_any(tree: Path, signed_name: str) -> list[str]:
    """The content check of a signed release tree of either kind: a system's (above) or an engine's."""
    from pipeline import release_content

    return (check_content if is_system_release(tree) else release_content.check_content)(tree, signed_name)


def verified(archive: Path, public_key: Path):
    """pipeline/release.py `verified` of a release of either kind: a context yielding (the signed tree, what was
    checked)."""
    return release.verified(archive, public_key, check_any)


def verify(archive: Path, public_key: Path) -> list[str]:
    """Verify a release archive of either kind offline (`kiln verify-release`); returns what was checked, raises
    GateFailed at the first failure."""
    with verified(archive, public_key) as (_, done):
        return done


# ---------------------------------------------------------------------------------------------- deploying
@dataclass(frozen=True)
class Deployed:
    system: Any               # pipeline.e2e.System, its gallery the release's
    name: str                 # kiln-system-<name>
    version: int
    checked: list[str]        # what verify-release checked


def deployed(tree: Path, checked: list[str] | None = None) -> Deployed:
    """The System of a verified, extracted system release tree, from its files alone: engines (each verified again as
    it loads), the config slice, the gallery. Refused if this code would run the system otherwise than it was
    gated: its detector settings, thresholds or preprocessing (pipeline/gates/system.py `describe`) differ."""
    import numpy as np

    from pipeline.e2e import System
    from pipeline.gates import system as gate

    doc = json.loads((tree / "release.json").read_bytes())
    system = doc["system"]
    described = json.loads((tree / SYSTEM_DIR / paths.SYSTEM_FILE).read_bytes())
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
    made = System.from_dirs(dcfg, f"{doc['registered_model']}-v{doc['version']}",
                            {m: tree / p for m, p in ((p["model"], p["dir"]) for p in doc["parts"])}, picks, system)
    made.engines = {m: f"{e} ({doc['registered_model']} v{doc['version']})" for m, e in made.engines.items()}
    emb = np.array(np.load(tree / GALLERY_DIR / EMBEDDINGS, allow_pickle=False, mmap_mode="r"))   # checked above
    made.gallery = (emb, json.loads((tree / GALLERY_DIR / LABELS).read_bytes()))
    made.embed = _same_width(made.embed, emb.shape[1], f"{doc['registered_model']} v{doc['version']}")
    return Deployed(made, doc["registered_model"], int(doc["version"]), list(checked or []))


def _same_width(embed, dim: int, what: str):
    """The embedder, refusing in one line an output that is not (faces, dim): the gallery's width is what the release
    recorded at build time; an embedder that disagrees would otherwise fail inside the search with a traceback."""
    def run(x):
        out = embed(x)
        if getattr(out, "ndim", None) != 2 or out.shape[1] != dim:
            raise GateFailed(f"{what}: its embedder outputs {tuple(getattr(out, 'shape', ()))}, its gallery holds "
                             f"{dim}-d embeddings", "do not use this release")
        return out
    return run


__all__ = ["Deployed", "SCHEMA", "build", "check_any", "check_content", "check_gallery", "deploy_config", "deployed",
           "is_system_release", "verified", "verify"]
