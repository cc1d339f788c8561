"""Loading an engine on a deployment host, the only way: verified, from a private copy, by the runner of its target.

An engine is code: ONNX Runtime and OpenVINO run the kernels a graph names. So before a runner sees an engine, its
files are copied into a fresh private directory (mode 0700) and the copies are checked against the engine's manifest
(size + xxh3-128: a flipped byte anywhere refuses the load); nothing else in the engine directory is copied, so files
the manifest does not list never reach a loader. The copy lives as long as the runner; one whose process was killed
is removed by the next kiln-run command, or at once by the service that replaces the worker (files.sweep_stale).

A runner maps numpy to numpy: `run(batch)` → the first output of a single-input graph, `run_all(feed)` → every
output. The build's targets (pipeline/targets/ort_cpu.py, openvino.py) load their engines with these same classes, so
what validate@ and system@ measured is what runs here. Each target's runtime is imported only when its engine loads:
OpenVINO is an extra (`pip install kiln-runtime[openvino]`).
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from kiln_runtime.digests import check_files, manifest_path, read_manifest
from kiln_runtime.errors import KilnError
from kiln_runtime.files import owner_tag

# target → "module:class" of its runner, imported only when one of its engines loads (a missing extra is one line)
RUNNERS: dict[str, str] = {"ort-cpu": "kiln_runtime.runners.ort:OrtRunner",
                           "openvino-cpu": "kiln_runtime.runners.openvino:OvRunner"}


def private_copy(engine_dir: Path, name: str, hint: str | Callable[[], str]
                 ) -> tuple[tempfile.TemporaryDirectory, dict[str, Any]]:
    """The engine's manifest-listed files copied into a fresh 0700 directory and checked there (size + xxh3-128);
    (the directory — removed when dropped — and the manifest). `hint` (or what it returns) says how to get a good
    engine back."""
    engine_dir = Path(engine_dir)
    mpath = manifest_path(engine_dir, name)
    manifest = read_manifest(mpath)
    tmp = tempfile.TemporaryDirectory(prefix=f"kiln-engine-{owner_tag()}-")     # a killed owner's: swept
    private = Path(tmp.name)
    os.chmod(private, 0o700)
    try:
        hint_of = hint if callable(hint) else (lambda: hint)
        for entry in manifest["files"]:
            rel = Path(str(entry.get("path", "")))
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise KilnError(f"{mpath}: file entry {str(entry.get('path'))[:200]!r} leaves the engine directory",
                                hint_of())
            (private / rel).parent.mkdir(parents=True, exist_ok=True)
            src = engine_dir / rel
            if src.is_symlink() or not src.is_file():
                raise KilnError(f"{src}: missing or not a regular file", hint_of())
            shutil.copyfile(src, private / rel)
        shutil.copyfile(mpath, private / mpath.name)
        if problems := check_files(private / mpath.name, manifest, fast=True):
            raise KilnError(f"{engine_dir}: engine files do not match their manifest: " + "; ".join(
                p.replace(str(private), str(engine_dir)) for p in problems[:3]),
                f"refusing to load it (loading an engine runs native code); {hint_of()}")
    except BaseException:
        tmp.cleanup()
        raise
    return tmp, manifest


def load(target: str, engine_dir: Path, name: str | None = None, threads: int | None = None):
    """A runner over the engine in `engine_dir` (manifest `<name>.manifest.json`, default: the directory's name),
    verified first; `threads`: intra-op threads instead of those it was compiled with (`runner.threads` says)."""
    engine_dir = Path(engine_dir)
    name = name or engine_dir.name
    if target not in RUNNERS:
        raise KilnError(f"engine {name}: kiln-runtime runs {' and '.join(RUNNERS)} engines, not {target}",
                        "release the system with engines of those targets")
    tmp, manifest = private_copy(engine_dir, name, "do not use this engine; get the release again")
    if manifest.get("kind") != "engine" or manifest.get("target") != target:
        tmp.cleanup()
        raise KilnError(f"{manifest_path(engine_dir, name)}: describes a {str(manifest.get('target'))[:40]} "
                        f"{str(manifest.get('kind'))[:40]}, not a {target} engine", "load it with its own target")
    try:
        module, cls = RUNNERS[target].split(":")
        runner = getattr(importlib.import_module(module), cls)(Path(tmp.name), threads)
    except BaseException:
        tmp.cleanup()
        raise
    runner._kiln_private_copy = tmp          # removed when the runner is
    return runner
