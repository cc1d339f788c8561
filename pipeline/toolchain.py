"""What built an artifact: package versions and target fingerprints (identity), and the host it ran on (record).

Versions of the packages a stage imports are rebuild keys, so they go into manifests; the Python version counts as
major.minor. The CPU's ISA flags select different kernels in ONNX Runtime, oneDNN and Inductor, so targets that
compile for this CPU make them rebuild keys too. The CPU's model name and the host name are only recorded. The
toolchain stage writes each target's fingerprint (artifacts/toolchain/<target>.yaml, whose `rebuild_on` keys a
stage that compiles for the target tracks) and the Python package versions (artifacts/toolchain/python.yaml).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

# a deployment host classes itself the same way
from kiln_runtime.host import CLASS_FLAGS, ISA_FLAGS, cpu, host_class  # noqa: F401

PYTHON_TOOLCHAIN = "artifacts/toolchain/python.yaml"          # the toolchain stage's package versions

def cpuid_class() -> str:
    """The host class this process's CPUID gives, from NumPy's own detection. Under an emulator (`kiln
    rebuild-check --cpu`) it is the emulated CPU's, while /proc/cpuinfo (`host_class`) still shows the real one."""
    import platform

    from numpy._core._multiarray_umath import __cpu_features__ as found

    flags = {"AVX512VNNI": "avx512_vnni", "AVX512F": "avx512f", "AVX2": "avx2", "SSE42": "sse4_2", "SVE": "sve",
             "ASIMD": "asimd"}
    return host_class({"machine": platform.machine(), "isa": [f for k, f in flags.items() if found.get(k)]})


def version(package: str) -> str:
    """An installed distribution's version, read from its metadata (no import), or "absent"."""
    from importlib import metadata       # ~30 ms: not on an engine's cold-start path, which never asks

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def python_version() -> str:
    return "{}.{}".format(*sys.version_info[:2])


def versions(*packages: str) -> dict[str, str]:
    """The toolchain section of a manifest: Python major.minor and the named distributions' versions."""
    return {"python": python_version(), **{p: version(p) for p in sorted(packages)}}


def host() -> dict[str, object]:
    """Where a run happened: for records, never for identity."""
    return {"host": platform.node(), "cpu": cpu()["cpu"], "python": platform.python_version(),
            "platform": platform.platform()}


def kiln_cache() -> Path:
    """Kiln's cache outside the checkout: verified archives, probe results (`$KILN_CACHE`, default ~/.cache/kiln)."""
    return Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))


def cached(key: list, compute) -> dict | list:
    """`compute()`'s JSON result, kept in $KILN_CACHE/probe/ under a digest of `key` (everything it depends on), so
    a probe that would import torch or walk the code runs once per such key. A result with an "error" is not kept."""
    import hashlib
    import json

    from pipeline.manifest import write_json_atomic

    path = kiln_cache() / "probe" / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32] + ".json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        pass
    value = compute()
    if not (isinstance(value, dict) and "error" in value):
        write_json_atomic(path, value)
    return value


def read_fingerprint(target: str, root: Path = Path(".")) -> dict[str, Any]:
    """artifacts/toolchain/<target>.yaml, written by the toolchain stage."""
    import yaml

    from pipeline import paths
    from pipeline.errors import KilnError

    path = paths.toolchain_file(target, root)
    if not path.is_file():
        raise KilnError(f"{path}: toolchain fingerprint missing", "run `kiln toolchain` (the toolchain stage) first")
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("rebuild_on"), dict):
        raise KilnError(f"{path}: not a toolchain fingerprint", "rerun `kiln toolchain`")
    return doc
