"""Loading an engine, the only way: verified, from a private copy.

An engine is code. ONNX Runtime runs the kernels a graph names; an AOTInductor package holds a shared library whose
constructors run when it is loaded. So before any target's `load` sees an engine, its files are copied into a fresh
private directory (mode 0700) and the copies are checked against the engine's manifest (size + xxh3-128: a flipped
byte anywhere refuses the load; kiln_runtime.runners.private_copy, what a deployment host does too), and a target
with a package format checks the package's entries
(`check_package`: no absolute paths, no `..`, no links). Nothing else in the engine directory is copied, so files
the manifest does not list never reach a loader. The copy lives as long as the runner.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from kiln_runtime import runners
from kiln_runtime.digests import manifest_path
from pipeline import targets
from pipeline.errors import KilnError


def load(target_name: str, engine_dir: Path, name: str | None = None, threads: int | None = None):
    """A Runner over the engine in `engine_dir` (manifest `<name>.manifest.json`, default: the directory's name).

    `threads`: the engine's intra-op threads instead of those it was compiled with, where its target's `load` takes
    `threads=` (ort-cpu, openvino-cpu); the runner's `threads` says what it runs with (None: as compiled)."""
    engine_dir = Path(engine_dir)
    name = name or engine_dir.name

    def hint() -> str:                          # only on a failure: a cold start does not import the stage tools
        from pipeline.dvcfiles import address

        return f"rebuild it (dvc repro -f {address(f'compile@{name}')}) or restore it (dvc checkout)"

    tmp, manifest = runners.private_copy(engine_dir, name, hint)     # the runtime's: one trust boundary
    private = Path(tmp.name)
    if manifest.get("kind") != "engine" or manifest.get("target") != target_name:
        tmp.cleanup()
        raise KilnError(f"{manifest_path(engine_dir, name)}: describes a {manifest.get('target')} "
                        f"{manifest.get('kind')}, not a {target_name} engine", "load it with its own target")
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
