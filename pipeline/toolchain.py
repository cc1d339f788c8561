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
from functools import lru_cache
from pathlib import Path
from typing import Any

PYTHON_TOOLCHAIN = "artifacts/toolchain/python.yaml"          # the toolchain stage's package versions

# ISA extensions that select different INT8 / FP32 kernels in ONNX Runtime, oneDNN and Inductor.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_int8", "amx_bf16")
# The flags a host class reads beyond ISA_FLAGS (x86 `flags`, aarch64 `Features` in /proc/cpuinfo). Not rebuild keys:
# `isa` stays ISA_FLAGS only, so classifying hosts changes no fingerprint.
CLASS_FLAGS = ("sse4_2", "avx2", "avx512f", "avx512_vnni", "amx_tile", "asimd", "sve")


@lru_cache(maxsize=None)
def cpu() -> dict[str, object]:
    """The CPU model (record), its kernel-selecting ISA flags and the machine type (rebuild keys)."""
    model, flags, features = platform.processor() or "unknown", set(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "", platform.processor()):
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
            elif key.strip() == "Features":          # aarch64 names them so; they are not `isa` (rebuild keys)
                features = set(value.split())
                break
    except OSError:
        pass
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "machine": platform.machine(),
            "class_flags": [f for f in CLASS_FLAGS if f in flags | features]}


_X86 = ("x86_64", "amd64", "x86-64")
_ARM = ("aarch64", "arm64")


def host_class(facts: dict[str, object] | None = None) -> str:
    """The host class a bench result belongs to: the CPU's kernel-selecting ISA tier, from the probe's facts
    (`cpu()`: machine + flags; a pure function of them, so any ISA list can be classified). x86-64: `amx`
    (amx_tile) > `avx512-vnni` > `avx512` (avx512f) > `avx2` > `sse4` (sse4_2); aarch64: `sve` > `neon` (asimd);
    anything else, or a CPU whose flags could not be read, `<machine>-generic`. GPU hosts are not classed here."""
    facts = cpu() if facts is None else facts
    machine = str(facts.get("machine") or "unknown").lower()
    flags = set(facts.get("isa") or ()) | set(facts.get("class_flags") or ())
    if machine in _X86:
        for flag, name in (("amx_tile", "amx"), ("avx512_vnni", "avx512-vnni"), ("avx512f", "avx512"),
                           ("avx2", "avx2"), ("sse4_2", "sse4")):
            if flag in flags:
                return f"x86-64-{name}"
        return "x86-64-generic"
    if machine in _ARM:
        for flag, name in (("sve", "sve"), ("asimd", "neon")):
            if flag in flags:
                return f"aarch64-{name}"
        return "aarch64-generic"
    import re

    return (re.sub(r"[^a-z0-9]+", "-", machine).strip("-") or "unknown") + "-generic"


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
