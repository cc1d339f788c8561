"""A system release as a deployment host reads it: verify the archive offline (signature, then content), and load
the system it holds. The build's `kiln verify-release` / `kiln identify --release` use this same code
(pipeline/release/system.py adds only the build's schema check of the config slice and the build-side refusal to run a
release another kiln gated).

`<R>` = `kiln-system-<name>-v<version>`:

    <R>/
      release.json          what this is: system, version, content digests, the parts (each with the runtime
                            it requires: kiln_runtime/requirements.py), the gallery, gallery-compat, golden
      system/               system.json, verdict.json, their manifest, kiln/parts.json (the pins), as registered
      engines/<engine>/     each part as registered (files, manifest, kiln/: validation manifest, verdict …)
      config/params.json    the params slice system@ gated with (its manifest's params.values, same digest)
      gallery/              embeddings.npy + labels.json, and a manifest whose inputs are the pinned embedder's manifest
      golden/<engine>/      a few golden inputs of each engine and what its gated runtime gave for them
                            (kiln_runtime/golden.py): what --allow-runtime-drift checks on another runtime
      lockfiles.json        sha256 of the releasing checkout's lockfiles
      slsa-provenance.json  in-toto Statement v1 / SLSA Provenance v1; subjects: every file above but the top documents
    <R>.sig                 the model-signing bundle over <R>/ (kiln_runtime/signature.py verifies it)

`verified(archive, key)`: the archive extracted by the strict reader (kiln_runtime/archive.py) into a private temporary
folder; exactly `<R>/` and `<R>.sig` at the top; the signature over every file; then `check_system`: the system
manifest and its content digest, the pins (each shipped engine's identity digest IS the system version's pin), each
engine's verdict, the config slice against the system manifest, the gallery against the pinned embedder and the
enrolment set, exactly the declared files, the gallery as identify will read it (`check_gallery`), the SLSA subjects.
`load(tree)`: the System of a verified tree — each engine loaded only after its files verify again (runners.load), the
detector, chip geometry and thresholds read from its system.json (system.Spec), the gallery.
"""

from __future__ import annotations

import errno
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from numpy.lib import format as npy

from kiln_runtime import golden, requirements, runners, signature
from kiln_runtime.archive import safe_extract
from kiln_runtime.digests import (artifact_digest, canonical_json, check_files, identity_digest, manifest_path,
                                  params_digest, read_manifest, sha256_file)
from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.files import scratch
from kiln_runtime.names import is_identity, slug
from kiln_runtime.system import Spec, System
from kiln_runtime.text import shown

SCHEMA = "kiln.system-release/1"
SIG_SUFFIX = ".sig"
SYSTEM_DIR, ENGINES_DIR, CONFIG_FILE, GALLERY_DIR = "system", "engines", "config/params.json", "gallery"
EMBEDDINGS, LABELS = "embeddings.npy", "labels.json"
SYSTEM_FILE, VERDICT_FILE, VALIDATION_FILE, PARTS_FILE = "system.json", "verdict.json", "validation.json", "parts.json"
BENCH_FILE, RECORD_FILE = "bench.json", "build-record.json"       # kept with a registered engine, optional here
TOP_DOCS = ("release.json", "lockfiles.json", "slsa-provenance.json")     # about the payload, not in it
COMPAT_VERDICTS = ("compatible", "re-enroll required")
SLSA_PREDICATE = "https://slsa.dev/provenance/v1"
SYSTEM_PREFIX = "kiln-system-"
# Bounds on what is read from a release, applied before parsing (the archive's own: kiln_runtime/archive.py)
MAX_DOC = 8 << 20                                 # one JSON document: signature, release.json, a manifest, ...
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


# ---------------------------------------------------------------------------------------------- documents
def bounded(path: Path, what: str) -> None:
    """Refuse a document of a release that is larger than any real one, before anything parses it."""
    size = path.stat().st_size if path.is_file() else 0
    if size > MAX_DOC:
        raise GateFailed(f"{what}: {size} bytes; no document of a release is over {MAX_DOC >> 20} MiB",
                         "do not use this release")


def read_doc(path: Path, what: str) -> Any:
    """A JSON document of the release, bounded in size and nesting; None when missing or not JSON."""
    bounded(path, what)
    try:
        return json.loads(path.read_bytes())
    except RecursionError:
        raise GateFailed(f"{what}: JSON nested too deeply for a release document", "do not use this release") from None
    except (OSError, ValueError):
        return None


def manifest_of(path: Path, what: str) -> dict[str, Any]:
    """A manifest of the release (read_manifest's checks), bounded like every document; a gate failure if bad."""
    bounded(path, what)
    try:
        return read_manifest(path)
    except RecursionError:
        raise GateFailed(f"{what}: JSON nested too deeply for a manifest", "do not use this release") from None
    except KilnError as e:
        raise GateFailed(f"{what}: {e.message}", "do not use this release") from None


# ---------------------------------------------------------------------------------------------- a system version
def registered(name: str) -> str:
    """`kiln-system-<name>` for a system name, or a registered system name given as is."""
    return f"{SYSTEM_PREFIX}{slug(name.removeprefix(SYSTEM_PREFIX), 'system')}"


@dataclass(frozen=True)
class Part:
    model: str                # the graph: pnet, rnet, onet, aligner, embedder, …
    engine: str
    registered_model: str
    version: int
    xxh3_128: str             # the registered version's engine manifest identity digest (what a release ships)
    sha256: str               # its registered content digest: the bytes system@ gated
    gated_xxh3_128: str       # the identity digest of the engine manifest system@ gated: the same bytes, but another
    #                           manifest than the registered one when the engine was rebuilt by other code since
    #                           (registration is once per content, so that build is "already registered")


def parts_doc(parts) -> bytes:
    return canonical_json([asdict(p) for p in parts])


def gallery_sha256(gdir: Path) -> str:
    """One digest of an enrolled gallery: its embeddings file and its labels file, as released."""
    import hashlib

    h = hashlib.sha256()
    for f in (EMBEDDINGS, LABELS):
        data = (gdir / f).read_bytes()
        h.update(f"{f}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def system_content(system: str, manifest: dict, parts) -> str:
    """A system version's content digest: the system's files (system.json + verdict.json) and its pins."""
    import hashlib

    return hashlib.sha256(canonical_json({"system": system, "files": artifact_digest(manifest),
                                          "parts": json.loads(parts_doc(parts))})).hexdigest()


# ---------------------------------------------------------------------------------------------- verifying
def _fail(what: str, why: str) -> GateFailed:
    return GateFailed(f"{what}: {why}", "do not use this release")


def is_system_release(tree: Path) -> bool:
    d = read_doc(tree / "release.json", "release.json")
    return isinstance(d, dict) and d.get("schema") == SCHEMA


def check_system(tree: Path, signed_name: str) -> list[str]:
    """Check a signed system release tree offline (after its signature holds); returns what was checked, raises
    GateFailed at the first failure. (The build adds the config slice's schema: pipeline/release/system.py.)"""
    doc = read_doc(tree / "release.json", "release.json")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise _fail("release.json", f"missing or not schema {SCHEMA}")
    system = slug(doc.get("system"), "released system")
    name = registered(system)
    expected = f"{name}-v{doc.get('version')}"
    if doc.get("registered_model") != name or not (tree.name == signed_name == expected):
        raise _fail("release.json", f"this is {expected}, but the archive's directory is {tree.name!r} and the "
                    f"signature's subject {signed_name!r}")
    # the system version: its files, content digest, pins, gate
    sdir = tree / SYSTEM_DIR
    mrel = f"{SYSTEM_DIR}/{manifest_path(Path(''), system).as_posix()}"
    manifest = manifest_of(tree / mrel, mrel)
    if (manifest.get("kind"), manifest.get("name")) != ("system", system):
        raise _fail(mrel, f"describes {str(manifest.get('kind'))[:40]} {str(manifest.get('name'))[:100]!r}")
    if problems := check_files(tree / mrel, manifest):
        raise _fail(mrel, "; ".join(p.replace(str(tree) + os.sep, "") for p in problems[:3]))
    if identity_digest(manifest) != doc.get("system_manifest_xxh3_128"):
        raise _fail(mrel, f"identity {identity_digest(manifest)}, release.json says "
                    f"{doc.get('system_manifest_xxh3_128')}")
    prel = f"{SYSTEM_DIR}/kiln/{PARTS_FILE}"
    try:
        parts = tuple(Part(**{**p, "version": int(p["version"])}) for p in read_doc(tree / prel, prel))
    except (TypeError, KeyError, ValueError):
        raise _fail(prel, "not a list of parts") from None
    if system_content(system, manifest, parts) != doc.get("system_sha256"):
        raise _fail(prel, "the system's files and pins are not the registered content (release.json system_sha256)")
    described = read_doc(sdir / SYSTEM_FILE, f"{SYSTEM_DIR}/{SYSTEM_FILE}")
    verdict = read_doc(sdir / VERDICT_FILE, f"{SYSTEM_DIR}/{VERDICT_FILE}")
    gated = {m: (e.get("engine"), e.get("xxh3_128")) for m, e in (described.get("engines") or {}).items()}
    if gated != {p.model: (p.engine, p.gated_xxh3_128) for p in parts}:
        raise _fail(prel, "the pins are not the engines its system.json was gated with")
    if verdict.get("system") != system or verdict.get("verdict") != "pass":
        raise _fail(f"{SYSTEM_DIR}/{VERDICT_FILE}", f"system {str(verdict.get('system'))[:100]!r}, verdict "
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
        edir = tree / ENGINES_DIR / slug(p.engine, "engine")
        if entry.get("dir") != f"{ENGINES_DIR}/{p.engine}":
            raise _fail("release.json", f"part {p.model}: dir {str(entry.get('dir'))[:100]!r}")
        erel = f"{ENGINES_DIR}/{p.engine}/{p.engine}.manifest.json"
        em = manifest_of(tree / erel, erel)
        if em.get("kind") != "engine" or em.get("model") != p.model:
            raise _fail(erel, f"not a {p.model} engine")
        if problems := check_files(tree / erel, em):
            raise _fail(erel, "; ".join(x.replace(str(tree) + os.sep, "") for x in problems[:3]))
        if identity_digest(em) != p.xxh3_128:
            raise _fail(erel, f"identity {identity_digest(em)}, but the system version pins {p.engine} at "
                        f"{p.xxh3_128}")
        if artifact_digest(em) != p.sha256:
            raise _fail(erel, "content digest differs from the registered one the system version pins")
        if "runtime" in entry and entry["runtime"] != requirements.of_engine(em):
            raise _fail("release.json", f"part {p.model}: its runtime requirement is not what its engine manifest "
                        "records")
        vrel = f"{ENGINES_DIR}/{p.engine}/kiln/{p.engine}.manifest.json"
        vm = manifest_of(tree / vrel, vrel)
        if check_files(tree / vrel, vm) or identity_digest(vm) != entry.get("validation_manifest_xxh3_128"):
            raise _fail(vrel, "validation manifest or its files differ from the registered ones")
        vdoc = read_doc(edir / "kiln" / VALIDATION_FILE, f"{ENGINES_DIR}/{p.engine}/kiln/{VALIDATION_FILE}")
        if not isinstance(vdoc, dict) or vdoc.get("engine_manifest_xxh3_128") != p.xxh3_128 or \
                vdoc.get("verdict") != "pass":
            raise _fail(f"{ENGINES_DIR}/{p.engine}/kiln/{VALIDATION_FILE}",
                        "not a pass about this exact build")
    done.append(f"engines: {len(parts)}, each one's files match its manifest and its identity digest is the system "
                "version's pin (" + ", ".join(f"{p.engine} {p.xxh3_128[:8]}" for p in parts) + "); each "
                "validation pass about its exact build")
    # the config slice
    values = read_doc(tree / CONFIG_FILE, CONFIG_FILE)
    if values != (manifest.get("params") or {}).get("values") or \
            params_digest(values) != (manifest.get("params") or {}).get("sha256"):
        raise _fail(CONFIG_FILE, "not the params slice the system was gated with (its manifest's params)")
    done.append(f"config: {CONFIG_FILE} is the params slice system@ gated with ({len(values)} keys, sha256 "
                f"{params_digest(values)[:12]})")
    # the gallery
    g = doc.get("gallery") or {}
    grel = f"{GALLERY_DIR}/{manifest_path(Path(''), system).as_posix()}"
    gm = manifest_of(tree / grel, grel)
    if (gm.get("kind"), gm.get("name")) != ("gallery", system) or g.get("manifest") != grel:
        raise _fail(grel, f"not the gallery of system {system}")
    if problems := check_files(tree / grel, gm):
        raise _fail(grel, "; ".join(x.replace(str(tree) + os.sep, "") for x in problems[:3]))
    embedder = next((p for p in parts if p.model == described.get("embedder")), None)
    if embedder is None:
        raise _fail(f"{SYSTEM_DIR}/{SYSTEM_FILE}", "names no pinned embedder")
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
    st = read_doc(tree / "slsa-provenance.json", "slsa-provenance.json")
    if not isinstance(st, dict) or st.get("predicateType") != SLSA_PREDICATE:
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
        shipped = gallery_sha256(tree / GALLERY_DIR)
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
    lrel, erel = f"{GALLERY_DIR}/{LABELS}", f"{GALLERY_DIR}/{EMBEDDINGS}"
    labels = read_doc(gdir / LABELS, lrel)
    if not isinstance(labels, list) or len(labels) != rows:
        raise _fail(lrel, f"not a list of {rows} identity names (one per gallery row)")
    bad = next((i for i, x in enumerate(labels) if not is_identity(x)), None)
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
    def listed(mrel: str) -> set[str]:
        m = manifest_of(tree / mrel, mrel)
        base = str(Path(mrel).parent.as_posix())
        return {mrel, *(f"{base}/{e['path']}" for e in m["files"])}

    mname = manifest_path(Path(""), system).as_posix()
    want = {*TOP_DOCS, CONFIG_FILE, f"{SYSTEM_DIR}/kiln/{PARTS_FILE}", *listed(f"{SYSTEM_DIR}/{mname}"),
            *listed(f"{GALLERY_DIR}/{mname}")}
    optional = set()
    for p in parts:
        edir = f"{ENGINES_DIR}/{p.engine}"
        want |= listed(f"{edir}/{p.engine}.manifest.json") | listed(f"{edir}/kiln/{p.engine}.manifest.json")
        optional |= {f"{edir}/kiln/{BENCH_FILE}", f"{edir}/kiln/{RECORD_FILE}"}
    want |= golden_files(tree)
    have = {q.relative_to(tree).as_posix() for q in tree.rglob("*") if not q.is_dir()}
    if extra := sorted(have - want - optional):
        raise _fail(shown(extra[0], 200), "not a file this system release declares (its manifests, pins and "
                    "documents)" + (f"; {len(extra) - 1} more" if len(extra) > 1 else ""))
    if missing := sorted(want - have):
        raise _fail(shown(missing[0], 200), "declared but not in the release")


def golden_files(tree: Path) -> set[str]:
    """The golden samples' files release.json lists (none in a release made before they existed)."""
    doc = read_doc(tree / "release.json", "release.json") or {}
    entry = doc.get("golden") or {}
    engines = entry.get("engines") or {}
    if not isinstance(engines, dict) or not all(isinstance(e, dict) and isinstance(e.get("files"), list)
                                                for e in engines.values()):
        raise _fail("release.json", "its golden entry is not a list of files per engine")
    parts = {str(p.get("engine")) for p in doc.get("parts") or [] if isinstance(p, dict)}
    if stray := sorted(set(engines) - parts):
        raise _fail("release.json", f"golden samples of {shown(stray[0], 100)}, which is not a part")
    return {f"{golden.DIR}/{slug(name, 'engine')}/{golden.file_name(f)}" for name, e in engines.items()
            for f in e["files"]}


# ---------------------------------------------------------------------------------------------- the host's runtime
def runtime_gate(tree: Path, allow_drift: bool = False) -> list[str]:
    """Each engine's runtime requirement (release.json's, else derived from its signed manifest: a release made
    before requirements were written) against this host. Outside it: KilnError naming both sides — unless
    `allow_drift`, which re-runs that engine's golden check here first (GateFailed when it does not hold)."""
    doc = json.loads((tree / "release.json").read_bytes())
    described = json.loads((tree / SYSTEM_DIR / SYSTEM_FILE).read_bytes())
    limits = {**golden.LIMITS, **((doc.get("golden") or {}).get("limits") or {})}
    done, drifted = [], []
    for part in doc["parts"]:
        engine = str(part["engine"])
        req = part.get("runtime") or requirements.of_engine(
            json.loads((tree / part["dir"] / manifest_path(Path(""), engine)).read_bytes()))
        if found := requirements.drifts(req):
            drifted.append((part, req, found))
        elif not req.get("allowed"):
            done.append(f"runtime: {engine} — no runtime requirement recorded for target {req.get('target')}")
        else:
            done.append(f"runtime: {engine} — {req['package']} {requirements.installed(req['package'])} within "
                        f"{req['allowed']}" + (f", host class {req['host_class']}" if req.get("host_class") else ""))
    if drifted and not allow_drift:
        part, req, found = drifted[0]
        more = f" (and {len(drifted) - 1} more engine(s))" if len(drifted) > 1 else ""
        raise KilnError(shown(f"engine {part['engine']}: {'; '.join(found)}{more}", 1000),
                        f"install the release's runtime: pip install -r the kiln-runtime lockfile ({req.get('package')}"
                        f"{req.get('allowed') or ''}), or pass --allow-runtime-drift to re-run its golden check on "
                        "this host first")
    for part, req, found in drifted:
        target = str((described.get("engines") or {}).get(part["model"], {}).get("target") or req.get("target"))
        line = golden.check(tree, part, target, limits)
        done.append(shown(f"runtime drift allowed: {part['engine']} — {'; '.join(found)}; {line.split(': ', 1)[1]}",
                          1000))
    return done


@contextmanager
def writing(scratch: Path) -> Iterator[None]:
    """A full disk (or quota, or `ulimit -f`) while writing in a scratch folder (extracting here; the build stages a
    release with it too): one line naming where, not a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        where = e.filename2 or e.filename or f"in the temporary folder {scratch.parent}"
        raise KilnError(f"cannot write {where}: {e.strerror}",
                        "free space there, or point TMPDIR at a roomier filesystem, then run the command again") \
            from None


@contextmanager
def verified(archive: Path, public_key: Path, check: Callable[[Path, str], list[str]] = check_system,
             allow_drift: bool = False, runtime: bool = True) -> Iterator[tuple[Path, list[str]]]:
    """Verify a release archive offline and yield (the signed tree, extracted in a private temporary folder, what was
    checked); the folder is removed on exit. `check(tree, signed name)` checks the content once the signature holds
    (a system release's by default; the build passes one that reads engine releases too). A system release's
    engines must then be runnable by this host's runtime (`runtime_gate`; `allow_drift`: after their golden check);
    `runtime=False` skips that for a command that only places the archive (`kiln-run pull`)."""
    archive, public_key = Path(archive), Path(public_key)
    if not archive.is_file():
        raise KilnError(f"{archive}: no such release archive", "pass the .tar.gz that `kiln release` wrote")
    signature.load_public_key(public_key)
    done: list[str] = []
    with scratch("verify-release") as tmp, writing(tmp):
        safe_extract(archive, tmp, top_file_max=MAX_DOC)
        top = sorted(p.name for p in tmp.iterdir())
        sigs = sorted(tmp.glob(f"*{SIG_SUFFIX}"))
        dirs = sorted(p for p in tmp.iterdir() if p.is_dir())
        if len(sigs) != 1 or len(dirs) != 1 or sigs[0].name != dirs[0].name + SIG_SUFFIX or len(top) != 2:
            found = ", ".join(repr(n[:100]) for n in top[:5]) + (f" and {len(top) - 5} more" if len(top) > 5 else "")
            raise GateFailed(f"{archive}: expected exactly <R>/ and <R>{SIG_SUFFIX} at the top, found {found}",
                             "get the archive again")
        tree, sig = dirs[0], sigs[0]
        bounded(sig, sig.name)
        signature.verify_tree(tree, sig, public_key)
        signed_name = signature.signed_name(sig)
        done.append(f"signature: model-signing bundle verified with {public_key.name}; every file's sha256 matches "
                    f"the signed statement (subject {signed_name[:200]!r}), none unsigned")
        try:
            done += check(tree, signed_name)
        except KilnError as e:        # messages quote the release's own values: bounded, whatever they hold
            raise GateFailed(signature.one_line(e.message, 500), e.hint if isinstance(e, GateFailed) else
                             "do not use this release") from None
        except (KeyError, TypeError, AttributeError, ValueError, RecursionError) as e:   # signed, not Kiln's layout
            raise GateFailed(f"{tree.name}: release content is malformed ({type(e).__name__}: "
                             f"{signature.one_line(str(e), 200)})", "do not use this release") from None
        if runtime and is_system_release(tree):
            try:
                done += runtime_gate(tree, allow_drift)
            except (KeyError, TypeError, AttributeError, ValueError, RecursionError) as e:   # its golden samples
                raise GateFailed(f"{tree.name}: release content is malformed ({type(e).__name__}: "
                                 f"{signature.one_line(str(e), 200)})", "do not use this release") from None
        yield tree, done


# ---------------------------------------------------------------------------------------------- loading
@dataclass
class Deployed:
    system: System            # ready to run, its gallery the release's
    name: str                 # kiln-system-<name>
    version: int
    system_name: str          # <name>
    checked: list[str]        # what verification checked


@dataclass(frozen=True)
class Layout:
    """What a verified tree says it runs: the release, its system's Spec, and where each graph's engine is."""
    name: str                 # kiln-system-<name>
    version: int
    system_name: str
    spec: Spec
    parts: dict[str, dict]    # model → its release.json part (engine, dir)
    targets: dict[str, str]   # model → its engine's target (system.json)


def layout(tree: Path) -> Layout:
    """Read a verified tree's release.json and system.json (no engine loaded): GateFailed if this runtime would not
    run the system exactly as described, or a graph has no part."""
    rel = json.loads((tree / "release.json").read_bytes())
    described = json.loads((tree / SYSTEM_DIR / SYSTEM_FILE).read_bytes())
    spec = Spec.described(described, f"{SYSTEM_DIR}/{SYSTEM_FILE}")
    parts = {p["model"]: p for p in rel["parts"]}
    if missing := [m for m in spec.graphs if m not in parts]:
        raise _fail("release.json", f"no part for {', '.join(missing)}")
    return Layout(rel["registered_model"], int(rel["version"]), str(rel["system"]), spec, parts,
                  {m: str(e.get("target")) for m, e in described["engines"].items()})


def load(tree: Path, checked: list[str] | None = None, threads: int | None = None) -> Deployed:
    """The System of a verified, extracted system release tree, from its files alone: engines (each verified again
    as it loads), how it runs (its system.json), the gallery. `threads`: each engine's intra-op threads."""
    lay = layout(tree)
    label = f"{lay.name} v{lay.version}"
    loaded = {m: runners.load(lay.targets.get(m, ""), tree / lay.parts[m]["dir"], lay.parts[m]["engine"], threads)
              for m in lay.spec.graphs}
    emb = np.array(np.load(tree / GALLERY_DIR / EMBEDDINGS, allow_pickle=False, mmap_mode="r"))   # checked above
    labels = json.loads((tree / GALLERY_DIR / LABELS).read_bytes())
    made = System.of_runners(f"{lay.name}-v{lay.version}", lay.spec, loaded, (emb, labels),
                             {m: f"{lay.parts[m]['engine']} ({label})" for m in lay.spec.graphs})
    return Deployed(made, lay.name, lay.version, lay.system_name, list(checked or []))


def release_system(threads: int, tree: str) -> System:
    """A load-test worker's system (kiln_runtime/loadtest.py `sweep` maker): the verified tree's, loaded again (each
    engine verified as it loads) with `threads` intra-op threads per engine."""
    return load(Path(tree), threads=threads).system
