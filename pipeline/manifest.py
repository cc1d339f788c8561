"""The artifact manifest: the one schema that flows through Kiln.

Every artifact directory holds `<name>.manifest.json` beside its files. A manifest is the artifact's *identity* and
nothing else: its files (bytes, xxh3-128, sha256), its inputs (by their manifests' identity digests), the digests of
the code that ran (the stage's module closure, the same files dvc.yaml lists as its deps), the parameter slice it
read, the toolchain versions that are its rebuild keys, build options and results that are pure functions of all of
that. Rebuilding the same inputs with the same code gives byte-identical manifests, wherever the checkout is.

What one run observed — git commit and dirty state, host, CPU model, times — is a *record*, written beside the
DVC outputs under artifacts/records/ (never cached, never inside an output; pipeline/edge.py writes it), and
carried into MLflow at registration. Inputs referenced by digest make every manifest chain a hash chain from any
engine back to the weights, the data, the parameters, the code and the toolchain that made it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kiln_runtime.digests import (SCHEMA, SUFFIX, artifact_digest, canonical_json, check_files,  # noqa: F401
                                 file_digests, identity_digest, manifest_path, params_digest, read_manifest,
                                 sha256_file, xxh3_128_hex)
from pipeline.errors import KilnError
from pipeline.paths import ARTIFACTS


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------- atomic writes
@contextmanager
def atomic_path(dest: Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success fsync and rename it over `dest`; on error remove it.

    A killed stage therefore never leaves a file that looks finished.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _clear_dead_temps(dest)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp_path, dest)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clear_dead_temps(dest: Path) -> None:
    """Remove temporary siblings of `dest` left by a writer that was killed (its pid is in the name)."""
    for old in dest.parent.glob(f".{dest.name}.*.tmp"):
        parts = old.name[len(dest.name) + 2:].split(".")
        if parts and parts[0].isdigit() and not _alive(int(parts[0])):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling directory; on success it replaces `dest` whole, on error it is removed.
    A sibling left by a killed writer (its pid is dead) is removed first."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _clear_dead_temps(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_bytes_atomic(dest: Path, data: bytes) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False).encode() + b"\n"


def write_json_atomic(dest: Path, obj: Any) -> None:
    write_bytes_atomic(dest, json_bytes(obj))


# ---------------------------------------------------------------------------------------------- manifest
def input_ref(role: str, manifest_file: Path, root: Path) -> dict[str, str]:
    """Reference an upstream artifact by its manifest's identity digest (after checking its files)."""
    m = read_verified(manifest_file, fast=True)
    return {"role": role, "manifest": Path(os.path.relpath(manifest_file, root)).as_posix(),
            "xxh3_128": identity_digest(m)}


def file_input(role: str, path: Path, root: Path) -> dict[str, Any]:
    """Reference a plain input file (weights, photos) by its path under the root and its digests."""
    return {"role": role, "path": Path(os.path.relpath(path, root)).as_posix(), **file_digests(Path(path))}


def build_manifest(*, kind: str, name: str, directory: Path, files: list[Path], inputs: list[dict[str, Any]],
                   toolchain: dict[str, Any], build: dict[str, Any], code: dict[str, str], params: dict[str, Any],
                   results: dict[str, Any] | None = None, model: str | None = None, target: str | None = None,
                   precision: str | None = None) -> dict[str, Any]:
    """Assemble a manifest; file paths are stored relative to the manifest's directory, sorted.

    `code` maps each module of the stage's closure to its xxh3-128 (pipeline/dagtools/dag.py); `params` is the slice of
    params.yaml the stage tracks, by dotted key.
    """
    entries = []
    for f in sorted(files, key=lambda p: Path(p).as_posix()):
        rel = Path(os.path.relpath(f, directory)).as_posix()
        entries.append({"path": rel, **file_digests(Path(f))})
    return {"schema": SCHEMA, "kind": kind, "name": name, "model": model, "target": target,
            "precision": precision, "files": entries, "inputs": inputs, "code": dict(sorted(code.items())),
            "params": {"sha256": params_digest(params), "values": params}, "toolchain": toolchain,
            "build": build, "results": results or {}}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    path = manifest_path(directory, manifest["name"])
    write_json_atomic(path, manifest)
    return path


def verify_manifest(path: Path, root: Path | None = None, fast: bool = False) -> list[str]:
    """Recompute every file's size and hashes and every input's digest; return the mismatches (empty = OK)."""
    path = Path(path)
    m = read_manifest(path)
    problems = check_files(path, m, fast)
    if root is not None:
        for ref in m["inputs"]:
            if "manifest" in ref:
                upstream = Path(root) / ref["manifest"]
                if not upstream.is_file():
                    problems.append(f"{upstream}: input manifest missing")
                elif (d := identity_digest(read_manifest(upstream))) != ref["xxh3_128"]:
                    problems.append(f"{upstream}: input changed since {m['name']} was built "
                                    f"(digest {d}, recorded {ref['xxh3_128']})")
            elif "path" in ref:
                f = Path(root) / ref["path"]
                if not f.is_file():
                    problems.append(f"{f}: input file missing")
                elif file_digests(f, sha256=False)["xxh3_128"] != ref.get("xxh3_128"):
                    problems.append(f"{f}: input file changed since {m['name']} was built")
    return problems


def read_verified(path: Path, fast: bool = False, hint: str = "") -> dict[str, Any]:
    """Read a manifest and check its files before anything uses them: a changed input is an error, not an input."""
    m = read_manifest(path)
    if problems := check_files(path, m, fast):
        raise KilnError(f"{path}: files do not match their manifest: " + "; ".join(problems[:3]),
                        hint or "the artifact was modified after it was built; rebuild it (dvc repro -f <stage>) "
                                "or restore it (dvc checkout)")
    return m


def find_manifests(path: Path) -> list[Path]:
    """The manifests under `path`, following symlinked folders (an artifact folder may be a link: what is behind
    it is what stages use), each real folder once (a link loop ends there). Hidden folders are a live stage's
    temporary output, skipped."""
    path = Path(path)
    if path.is_file():
        return [path]
    found, seen = [], set()
    for top, dirs, files in os.walk(path, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            dirs.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(top) / f for f in files if f.endswith(SUFFIX) and not f.startswith(".")]
    return sorted(found)


def project_root(manifest: Path) -> Path | None:
    """The project a manifest belongs to, whose root its inputs are recorded relative to: the folder holding the
    nearest `artifacts/` above it (as named: links not resolved). None outside any artifacts folder."""
    for parent in Path(os.path.abspath(manifest)).parents:
        if parent.name == ARTIFACTS.name:
            return parent.parent
    return None
