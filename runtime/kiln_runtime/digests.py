"""Manifests as a deployment host reads them: file digests (xxh3-128 as the content id, sha256 as tamper evidence),
a manifest's identity and content digests, reading one, checking its files. The build (pipeline/manifest.py) writes
manifests with these same functions, so both sides compute one digest the same way."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import xxhash

from kiln_runtime.errors import KilnError

SCHEMA = "kiln.manifest/2"
SUFFIX = ".manifest.json"
_CHUNK = 1 << 20


def file_digests(path: Path, sha256: bool = True) -> dict[str, Any]:
    """bytes, xxh3-128 (fast content id) and sha256 (tamper evidence) of one file, in one read."""
    xx, sha, size = xxhash.xxh3_128(), hashlib.sha256() if sha256 else None, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            xx.update(chunk)
            if sha is not None:
                sha.update(chunk)
            size += len(chunk)
    out: dict[str, Any] = {"bytes": size, "xxh3_128": xx.hexdigest()}
    if sha is not None:
        out["sha256"] = sha.hexdigest()
    return out


def sha256_file(path: Path) -> str:
    return file_digests(path)["sha256"]


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace variance, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def xxh3_128_hex(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def params_digest(params: Any) -> str:
    return hashlib.sha256(canonical_json(params)).hexdigest()


def manifest_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}{SUFFIX}"


def identity_digest(manifest: dict[str, Any]) -> str:
    return xxh3_128_hex(canonical_json(manifest))


def artifact_digest(manifest: dict[str, Any]) -> str:
    """sha256 over the sorted (path, sha256) pairs of the manifest's files: the artifact's content identity."""
    pairs = sorted([f["path"], f["sha256"]] for f in manifest["files"])
    return hashlib.sha256(canonical_json(pairs)).hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KilnError(f"{path}: manifest not found", "build the artifact first (dvc repro)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not a valid manifest ({e})", "rebuild the artifact (dvc repro -f <stage>)") from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        raise KilnError(f"{path}: not a Kiln manifest (schema {m.get('schema') if isinstance(m, dict) else None!r})",
                        f"expected schema {SCHEMA!r}; rebuild the artifact (dvc repro -f <stage>)")
    if not isinstance(m.get("files"), list) or not isinstance(m.get("inputs"), list):
        raise KilnError(f"{path}: manifest has no files/inputs lists", "rebuild the artifact (dvc repro -f <stage>)")
    return m


def check_files(path: Path, manifest: dict[str, Any], fast: bool = False) -> list[str]:
    """Each file's size and hashes against the manifest (fast: size + xxh3-128 only); mismatches, empty = OK."""
    problems: list[str] = []
    base = Path(path).parent.resolve()
    for entry in manifest["files"]:
        rel = entry.get("path", "")
        f = (base / rel).resolve()
        if Path(rel).is_absolute() or base not in f.parents:
            problems.append(f"{rel}: file path leaves the manifest's directory")
            continue
        if not f.is_file():
            problems.append(f"{Path(path).parent / rel}: missing")
            continue
        actual = file_digests(f, sha256=not fast)
        for key in ("bytes", "xxh3_128") if fast else ("bytes", "xxh3_128", "sha256"):
            if actual[key] != entry.get(key):
                problems.append(f"{Path(path).parent / rel}: {key} is {actual[key]}, manifest says {entry.get(key)}")
    return problems
