"""This checkout: the directory whose `pipeline/` code runs, its own packages, and the environment a child process
needs to run it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]      # the checkout whose code runs (pipeline/ lives here)
PACKAGE = "pipeline"
RUNTIME = REPO / "runtime"                      # the deployment package kiln-runtime (runtime/pyproject.toml)
# The checkout's own top-level packages, each with the directory it is imported from: the build (pipeline/) and the
# deployment runtime (runtime/kiln_runtime/), which the build imports so that what its gates judge is the code a
# deployment host runs. Their modules are code (closures, code digests, dvc.yaml deps), never third-party packages.
PACKAGES = {PACKAGE: REPO, "kiln_runtime": RUNTIME}


def package_of(name: str) -> str | None:
    """The checkout's package a dotted module name belongs to (`kiln_runtime.mtcnn` → kiln_runtime), else None."""
    top = name.split(".")[0]
    return top if top in PACKAGES else None


def cli_env() -> dict[str, str]:
    """Environment for a `python -m pipeline...` child that must run this checkout's code from another cwd."""
    paths = [str(REPO), str(RUNTIME), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
