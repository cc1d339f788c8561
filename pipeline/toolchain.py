"""What built an artifact: package versions, Python, CPU model and ISA flags that change kernels."""

from __future__ import annotations

import platform
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

# ISA extensions that select different INT8 / FP32 kernels in ONNX Runtime, oneDNN and Inductor.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_int8", "amx_bf16")


@lru_cache(maxsize=None)
def cpu() -> dict[str, object]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "", platform.processor()):
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "machine": platform.machine()}


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def versions(*packages: str) -> dict[str, str]:
    return {"python": ".".join(map(str, sys.version_info[:3])), **{p: version(p) for p in packages}}


def describe(*packages: str) -> dict[str, object]:
    """The toolchain section of a manifest: versions of the named packages plus the CPU."""
    return {**versions(*packages), **cpu()}
