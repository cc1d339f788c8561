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
set, the SLSA subjects. `deployed` builds the System from a verified, extracted tree alone: no checkout, no DVC, no
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
    from pipeline.registry.releases import KILN_DIR, PARAM, _gate, download_verified

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
        version = _resolve(reg, name, system, ref)
        v, _ = systems._prove(reg, name, version, scratch / "proof")        # what promote demands, and more
        rel = f"{name}-v{version}"
        tree = scratch / rel
        sdir = tree / SYSTEM_DIR
        for f in (paths.SYSTEM_FILE, paths.VERDICT_FILE, manifest_path(Path(""), system).as_posix(),
                  f"{KILN_DIR}/{systems.PARTS_FILE}"):
            release._copy(v.directory / f, sdir / f)
        parts = []
        for p in v.parts:
            ev = download_verified(reg, p.registered_model, p.version, scratch / "download" / p.engine)
            if (identity_digest(ev.manifest), ev.params.get(PARAM + "sha256")) != (p.xxh3_128, p.sha256):
                raise GateFailed(f"{name} v{version}: its part {p.registered_model} v{p.version} is no longer the "
                                 "build the system pinned", "register the system again (kiln register-system)")
            _gate(reg, p.registered_model, p.version, ev, scratch / "attached" / p.engine)
            if ev.verdict.get("verdict") != "pass":          # a system's engines all ran on system@'s host
                raise GateFailed(f"{p.registered_model} v{p.version}: its stored verdict is not pass",
                                 "validate it on a host with its runtime, then register the system again")
            edir = tree / ENGINES_DIR / p.engine
            for f in [e["path"] for e in ev.manifest["files"]] + [manifest_path(Path(""), p.engine).as_posix()]:
                release._copy(ev.directory / f, edir / f)
            for f in sorted((ev.directory / KILN_DIR).iterdir()):
                release._copy(f, edir / KILN_DIR / f.name)
            parts.append({**asdict(p), "dir": f"{ENGINES_DIR}/{p.engine}",
                          "validation_manifest_xxh3_128": ev.params[PARAM + "validation_manifest_xxh3_128"]})
        values = v.manifest["params"]["values"]
        release._write(tree / CONFIG_FILE, values)
        gallery = _enrol(tree, v, deploy_config(values, tree / CONFIG_FILE), root)
        doc = {"schema": SCHEMA, "kind": "system", "registered_model": name, "version": version, "system": system,
               "artifact": systems.PREFIX + system,
               "system_manifest": f"{SYSTEM_DIR}/{manifest_path(Path(''), system).as_posix()}",
               "system_manifest_xxh3_128": identity_digest(v.manifest),
               "system_sha256": systems._content(system, v.manifest, v.parts),
               "verdict": v.verdict.get("verdict"), "parts": parts, "config": CONFIG_FILE, "gallery": gallery,
               "gallery_compat": _compat(reg, name, version)}
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
        recorded = release._record(reg, name, version, str(ref), dest, sha)
    return release.Release(dest, sha, name, version, recorded)


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


def _compat(reg, name: str, version: int) -> dict[str, Any] | None:
    """What promote measured of this version's embedder against the production gallery (None: never measured)."""
    tags = reg.version(name, version).tags or {}
    if "gallery_compat" not in tags:
        return None
    return {"verdict": tags["gallery_compat"], "vs": tags.get("gallery_compat.vs")}


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
    commit = (reg.version(doc["registered_model"], doc["version"]).tags or {}).get("git_commit", "")
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
    import numpy as np

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
    labels = _doc(tree / GALLERY_DIR / LABELS, f"{GALLERY_DIR}/{LABELS}")
    try:
        emb = np.load(tree / GALLERY_DIR / EMBEDDINGS, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise _fail(f"{GALLERY_DIR}/{EMBEDDINGS}", f"not a numpy array ({type(e).__name__})") from None
    rows = (gm.get("build") or {}).get("rows")
    if emb.dtype != np.float32 or emb.ndim != 2 or emb.shape[0] != rows or not np.isfinite(emb).all() or \
            not isinstance(labels, list) or len(labels) != rows or not all(isinstance(x, str) for x in labels):
        raise _fail(f"{GALLERY_DIR}/", f"{EMBEDDINGS} and {LABELS} are not {rows} float32 rows with a name each")
    done.append(f"gallery: {emb.shape[0]} enrolment embeddings × {emb.shape[1]} of {len(set(labels))} identities, "
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
    if compat:
        done.append(f"gallery-compat at promotion: {str(compat.get('verdict'))[:40]} vs "
                    f"{str(compat.get('vs'))[:100]}" + ("; a gallery enrolled by that engine must be re-enrolled "
                                                         "with this release's embedder" if
                                                         compat.get("verdict") != "compatible" else ""))
    return done


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
    return Deployed(made, doc["registered_model"], int(doc["version"]), list(checked or []))


__all__ = ["Deployed", "SCHEMA", "build", "check_any", "check_content", "deploy_config", "deployed",
           "is_system_release", "verified", "verify"]
