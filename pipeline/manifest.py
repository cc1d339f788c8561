"""The artifact manifest: the one schema that flows through Kiln.

Every artifact directory holds `<name>.manifest.json` beside its files. A manifest has two halves:

* identity fields (`kind, model, target, precision, files, inputs, toolchain, build, source`, plus stage-specific
  results that are a pure function of the inputs, e.g. export parity) — they make the artifact, and rebuilding
  the same inputs with the same code gives byte-identical identity fields;
* `record` — what one run observed (wall times, host name). It is excluded from `identity_digest`.

Inputs are referenced by the identity digest of their manifest, so a chain of manifests is a hash chain from any
engine back to the weights, the data, the parameters, the code and the toolchain that made it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import xxhash

from pipeline.errors import KilnError

SCHEMA = "kiln.manifest/1"
SUFFIX = ".manifest.json"
_CHUNK = 1 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------- hashing
def file_digests(path: Path) -> dict[str, Any]:
    """bytes, xxh3-128 (fast content id) and sha256 (tamper evidence) of one file, in one read."""
    xx, sha, size = xxhash.xxh3_128(), hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            xx.update(chunk)
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "xxh3_128": xx.hexdigest(), "sha256": sha.hexdigest()}


def sha256_file(path: Path) -> str:
    return file_digests(path)["sha256"]


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace variance, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def xxh3_128_hex(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def params_digest(params: Any) -> str:
    return hashlib.sha256(canonical_json(params)).hexdigest()


# ---------------------------------------------------------------------------------------------- atomic writes
@contextmanager
def atomic_path(dest: Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success fsync and rename it over `dest`; on error remove it.

    A killed stage therefore never leaves a file that looks finished.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
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


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling directory; on success it replaces `dest` whole, on error it is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700
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


def write_json_atomic(dest: Path, obj: Any) -> None:
    write_bytes_atomic(dest, json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False).encode() + b"\n")


# ---------------------------------------------------------------------------------------------- source
def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def source_info(repo: Path, params: Any) -> dict[str, Any]:
    """git commit + dirty flag of the code that built an artifact, and the hash of the parameters it used.

    `dvc.lock` and DVC outputs change while a pipeline runs, so they do not count as dirty.
    """
    try:
        commit = _git("rev-parse", "HEAD", cwd=repo)
        status = _git("status", "--porcelain", "--untracked-files=no", cwd=repo)
        dirty = any(not line[3:].startswith(("dvc.lock", "artifacts/")) for line in status.splitlines())
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit, dirty = "unknown", True
    return {"git_commit": commit, "dirty": dirty, "params_sha256": params_digest(params)}


# ---------------------------------------------------------------------------------------------- manifest
IDENTITY_KEYS = ("schema", "kind", "name", "model", "target", "precision", "files", "inputs", "toolchain",
                 "build", "source", "results")


def manifest_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}{SUFFIX}"


def input_ref(role: str, manifest_file: Path, root: Path) -> dict[str, str]:
    """Reference an upstream artifact by its manifest's identity digest."""
    m = read_manifest(manifest_file)
    return {"role": role, "manifest": Path(os.path.relpath(manifest_file, root)).as_posix(),
            "xxh3_128": identity_digest(m)}


def identity_digest(manifest: dict[str, Any]) -> str:
    return xxh3_128_hex(canonical_json({k: manifest.get(k) for k in IDENTITY_KEYS}))


def build_manifest(*, kind: str, name: str, directory: Path, files: list[Path], inputs: list[dict[str, str]],
                   toolchain: dict[str, Any], build: dict[str, Any], source: dict[str, Any],
                   results: dict[str, Any] | None = None, model: str | None = None, target: str | None = None,
                   precision: str | None = None, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble a manifest; file paths are stored relative to the manifest's directory, sorted."""
    entries = []
    for f in sorted(files, key=lambda p: Path(p).as_posix()):
        rel = Path(os.path.relpath(f, directory)).as_posix()
        entries.append({"path": rel, **file_digests(Path(f))})
    return {"schema": SCHEMA, "kind": kind, "name": name, "model": model, "target": target,
            "precision": precision, "files": entries, "inputs": inputs, "toolchain": toolchain, "build": build,
            "source": source, "results": results or {}, "record": record or {}}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    path = manifest_path(directory, manifest["name"])
    write_json_atomic(path, manifest)
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path}: manifest not found", "build the artifact first (dvc repro)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not a valid manifest ({e})", "rebuild the artifact (dvc repro -f <stage>)") from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        raise KilnError(f"{path}: not a Kiln manifest (schema {m.get('schema') if isinstance(m, dict) else None!r})",
                        f"expected schema {SCHEMA!r}")
    return m


def verify_manifest(path: Path, root: Path | None = None) -> list[str]:
    """Recompute every file's size and hashes and every input's digest; return the mismatches (empty = OK)."""
    path = Path(path)
    m = read_manifest(path)
    problems: list[str] = []
    for entry in m["files"]:
        f = path.parent / entry["path"]
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        actual = file_digests(f)
        for key in ("bytes", "xxh3_128", "sha256"):
            if actual[key] != entry[key]:
                problems.append(f"{f}: {key} is {actual[key]}, manifest says {entry[key]}")
    if root is not None:
        for ref in m["inputs"]:
            if "manifest" not in ref:
                continue
            upstream = Path(root) / ref["manifest"]
            if not upstream.is_file():
                problems.append(f"{upstream}: input manifest missing")
            elif (d := identity_digest(read_manifest(upstream))) != ref["xxh3_128"]:
                problems.append(f"{upstream}: input changed since {m['name']} was built "
                                f"(digest {d}, recorded {ref['xxh3_128']})")
    return problems


def find_manifests(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(path.rglob(f"*{SUFFIX}"))
