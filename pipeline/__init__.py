"""Kiln: reproducible build pipeline for face-recognition deployment artifacts."""

import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"

# The build imports the deployment runtime (kiln_runtime) of this same checkout, runtime/kiln_runtime/: the files its
# closures list and its manifests digest (pipeline/closure.py), whichever copy the environment has installed (an
# editable install of another checkout, a CI clone's, a test's copy of the tree).
_RUNTIME = str(_Path(__file__).resolve().parents[1] / "runtime")
if _Path(_RUNTIME, "kiln_runtime").is_dir() and _RUNTIME not in _sys.path:
    _sys.path.insert(1 if _sys.path else 0, _RUNTIME)

# A portable stage (pipeline/portable.py) run as `python -m pipeline.stages.<stage>` starts again on the portable
# float kernels here, before its module's imports.
from pipeline import portable as _portable  # noqa: E402

_portable.relaunch_early()
