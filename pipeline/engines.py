"""Loading an engine, the only way: verified, from a private copy.

An engine is code. ONNX Runtime runs the kernels a graph names; an AOTInductor package holds a shared library whose
constructors run when it is loaded. So before any target's `load` sees an engine, its files are copied into a fresh
private directory (mode 0700) and the copies are checked against the engine's manifest (size + xxh3-128: a flipped
byte anywhere refuses the load), and a target with a package format checks the package's entries
(`check_package`: no absolute paths, no `..`, no links). Nothing else in the engine directory is copied, so files
the manifest does not list never reach a loader. The copy lives as long as the runner.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from pathlib import Path

from pipeline import targets
from pipeline.errors import KilnError
from pipeline.manifest import check_files, manifest_path, read_manifest


def load(target_name: str, engine_dir: Path, name: str | None = None, threads: int | None = None):
    """A Runner over the engine in `engine_dir` (manifest `<name>.manifest.json`, default: the directory's name).

    `threads`: the engine's intra-op threads instead of those it was compiled with, where its target's `load` takes
    `threads=` (ort-cpu, openvino-cpu); the runner's `threads` says what it runs with (None: as compiled)."""
    engine_dir = Path(engine_dir)
    name = name or engine_dir.name
    mpath = manifest_path(engine_dir, name)
    manifest = read_manifest(mpath)
    if manifest.get("kind") != "engine" or manifest.get("target") != target_name:
        raise KilnError(f"{mpath}: describes a {manifest.get('target')} {manifest.get('kind')}, not a {target_name} "
                        "engine", "load it with its own target")
    tmp = tempfile.TemporaryDirectory(prefix="kiln-engine-")
    private = Path(tmp.name)
    os.chmod(private, 0o700)
    for entry in manifest["files"]:
        rel = Path(entry["path"])
        if rel.is_absolute() or ".." in rel.parts:
            tmp.cleanup()
            raise KilnError(f"{mpath}: file entry {entry['path']!r} leaves the engine directory", "rebuild the engine")
        (private / rel).parent.mkdir(parents=True, exist_ok=True)
        src = engine_dir / rel
        if src.is_symlink() or not src.is_file():
            tmp.cleanup()
            from pipeline.dvcfiles import address   # only for the hint: a cold start does not import the stage tools
            raise KilnError(f"{src}: missing or not a regular file",
                            f"rebuild the engine (dvc repro -f {address(f'compile@{name}')})")
        shutil.copyfile(src, private / rel)
    shutil.copyfile(mpath, private / mpath.name)
    if problems := check_files(private / mpath.name, manifest, fast=True):
        tmp.cleanup()
        from pipeline.dvcfiles import address
        raise KilnError(f"{engine_dir}: engine files do not match their manifest: " + "; ".join(
            p.replace(str(private), str(engine_dir)) for p in problems[:3]),
            "refusing to load it (loading an engine runs native code); rebuild it "
            f"(dvc repro -f {address(f'compile@{name}')}) or restore it (dvc checkout)")
    target = targets.get(target_name)
    try:
        target.check_package(private)
        takes = threads is not None and "threads" in inspect.signature(target.load).parameters
        runner = target.load(private, threads=threads) if takes else target.load(private)
    except BaseException:
        tmp.cleanup()
        raise
    runner._kiln_private_copy = tmp          # removed when the runner is
    return runner
