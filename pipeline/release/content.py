"""What `verify-release` checks in a release tree once its signature holds, offline and bounded: release.json, the
engine against its manifest, the verdict, every manifest link of the chain, the SLSA subjects; no document over
MAX_DOC bytes is parsed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kiln_runtime.release import MAX_DOC, bounded, manifest_of, read_doc  # noqa: F401
from pipeline import paths
from pipeline.release.attestation import SLSA_PREDICATE
from pipeline.errors import GateFailed
from pipeline.manifest import check_files, identity_digest, manifest_path

SCHEMA = "kiln.release/1"
# Bounds on what Kiln reads from a release, applied before parsing, and the bounded readers: the runtime's
# (kiln_runtime/release.py), one implementation for the build and a deployment host.
_doc, _manifest = read_doc, manifest_of


def _safe_rel(tree: Path, rel: Any, what: str) -> Path:
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise GateFailed(f"release.json: {what} {rel!r} is not a path inside the release", "do not use this release")
    return tree / rel


def check_content(tree: Path, signed_name: str) -> list[str]:
    """Check the signed tree `tree` (whose signature names `signed_name`); returns what was checked, raises
    GateFailed at the first failure."""
    def fail(what: str, why: str) -> GateFailed:
        return GateFailed(f"{what}: {why}", "do not use this release")

    doc = _doc(tree / "release.json", "release.json")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise fail("release.json", f"missing or not schema {SCHEMA}")
    expected_name = f"{doc.get('registered_model')}-v{doc.get('version')}"
    if not (tree.name == signed_name == expected_name):     # a genuine release of something else, renamed
        raise fail("release.json", f"this is {expected_name}, but the archive's directory is {tree.name!r} and the "
                   f"signature's subject {signed_name!r}")
    paths.slug(doc.get("artifact"), "released artifact")
    mfile = _safe_rel(tree, doc.get("manifest"), "manifest")
    manifest = _manifest(mfile, doc["manifest"])
    if problems := check_files(mfile, manifest):
        raise fail(doc["manifest"], "; ".join(p.replace(str(tree) + os.sep, "") for p in problems[:3]))
    ident = identity_digest(manifest)
    if ident != doc.get("manifest_xxh3_128"):
        raise fail(doc["manifest"], f"identity {ident}, release.json says {doc.get('manifest_xxh3_128')}")
    from pipeline.manifest import artifact_digest

    if artifact_digest(manifest) != doc.get("artifact_sha256"):
        raise fail(doc["manifest"], "content digest differs from the registered one in release.json")
    done = [f"{doc.get('kind', 'engine')}: {doc['registered_model']} v{doc['version']}, {len(manifest['files'])} "
            f"file(s) match {doc['manifest']} (bytes, xxh3-128, sha256)"]
    vdir = mfile.parent / "kiln"
    vfile = manifest_path(vdir, doc["artifact"])
    vm = _manifest(vfile, f"engine/kiln/{vfile.name}")
    if check_files(vfile, vm) or identity_digest(vm) != doc.get("validation_manifest_xxh3_128"):
        raise fail(f"engine/kiln/{vfile.name}", "validation manifest or its files differ from the registered ones")
    verdict = _doc(vdir / paths.VALIDATION_FILE, f"engine/kiln/{paths.VALIDATION_FILE}")
    if not isinstance(verdict, dict) or verdict.get("engine_manifest_xxh3_128") != ident:
        raise fail(f"engine/kiln/{paths.VALIDATION_FILE}", "the validation is about another build")
    attached = verdict.get("verdict") == "not-run" and doc.get("gate") == "attached"
    if verdict.get("verdict") != "pass" and not attached:     # built-only: a pass by a host with the runtime
        raise fail(f"engine/kiln/{paths.VALIDATION_FILE}", f"verdict is {verdict.get('verdict')!r}, not 'pass'")
    done.append(f"validation: verdict {verdict.get('verdict')} about this exact build"
                + (" — the pass was attached by a host with the runtime and checked at release time; it is not in "
                   "the archive, so it cannot be re-checked offline" if attached else ""))
    chain_root = tree / "chain"
    start = _safe_rel(chain_root, doc.get("chain_root"), "chain_root")
    if not start.is_file() or identity_digest(_manifest(start, f"chain/{doc['chain_root']}")) != ident:
        raise fail("release.json", "chain_root is not this artifact's manifest")
    todo, seen, pinned, local = [(mfile, manifest)], set(), set(), set()
    while todo:
        path, m = todo.pop()
        where = path.relative_to(tree).as_posix()
        for ref in m["inputs"]:
            if "manifest" in ref:
                up = _safe_rel(chain_root, ref["manifest"], f"{where}: input")
                if not up.is_file():
                    raise fail(where, f"input {ref['manifest']} is not in the release's chain")
                um = _manifest(up, f"chain/{ref['manifest']}")
                if identity_digest(um) != ref.get("xxh3_128"):
                    raise fail(f"chain/{ref['manifest']}", f"identity {identity_digest(um)}, {m['name']} was built "
                               f"from {ref.get('xxh3_128')}")
                if ref["manifest"] not in seen:
                    seen.add(ref["manifest"])
                    todo.append((up, um))
            elif "path" in ref:
                owner = _check_file_input(chain_root, ref, where, fail)
                (pinned if owner else local).add(ref["path"])
                if owner:
                    seen.add(owner)
    listed = set(doc.get("chain", []))
    if missing := sorted(listed - seen - {doc["chain_root"]}):
        raise fail("release.json", f"chain lists {missing[0]}, which no manifest links to")
    if unlisted := sorted(seen - listed):
        raise fail("release.json", f"{unlisted[0]} is linked but not listed in the chain")
    done.append(f"chain: {len(seen)} upstream manifests, every link's identity digest matches; {len(pinned)} "
                "weight/photo file(s) are files (same sha256) of a shipped manifest with PyPI pins"
                + (f"; {len(local)} local input file(s) are known by digest only (no package pin)" if local else ""))
    st = _doc(tree / "slsa-provenance.json", "slsa-provenance.json")
    if not isinstance(st, dict) or st.get("predicateType") != SLSA_PREDICATE:
        raise fail("slsa-provenance.json", "missing or not a SLSA Provenance v1 statement")
    subjects = {s.get("name"): (s.get("digest") or {}).get("sha256") for s in st.get("subject", [])}
    expected = {f"engine/{e['path']}": e["sha256"] for e in manifest["files"]}
    if subjects != expected:
        raise fail("slsa-provenance.json", "its subjects are not exactly the released files and digests")
    done.append(f"slsa: {len(subjects)} subject(s) = the released files; "
                f"{len(st['predicate']['buildDefinition']['resolvedDependencies'])} resolved dependencies")
    return done


def _check_file_input(chain_root: Path, ref: dict, where: str, fail) -> str | None:
    """A plain input (weights, photo) must be a file, with the same sha256, of a manifest shipped in chain/ (the
    assets', which carries the pins); returns that manifest's chain path, or None for a local file outside the
    project (a user's photo folder), which only its digest identifies."""
    rel = Path(ref["path"])
    if rel.is_absolute() or ".." in rel.parts:
        return None
    for d in rel.parents:
        folder = chain_root / d
        for m in sorted(p for p in folder.glob("*.manifest.json") if p.is_file()) if folder.is_dir() else []:
            doc = _manifest(m, f"chain/{m.relative_to(chain_root).as_posix()}")
            member = rel.relative_to(d).as_posix()
            entry = next((e for e in doc["files"] if isinstance(e, dict) and e.get("path") == member), None)
            if entry is not None:
                if entry.get("sha256") != ref.get("sha256"):
                    raise fail(where, f"input {ref['path']} has sha256 {ref.get('sha256')}, the shipped "
                               f"{m.relative_to(chain_root).as_posix()} says {entry.get('sha256')}")
                return m.relative_to(chain_root).as_posix()
    raise fail(where, f"input file {ref['path']} is not a file of any manifest in the chain")
