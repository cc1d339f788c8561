"""This checkout: the directory whose `pipeline/` code runs, and the environment a child process needs to run it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]      # the checkout whose code runs (pipeline/ lives here)
PACKAGE = "pipeline"


def cli_env() -> dict[str, str]:
    """Environment for a `python -m pipeline...` child that must run this checkout's code from another cwd."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
