"""The host a result belongs to: the CPU's model, its kernel-selecting ISA flags, and its host class. The build
(pipeline/toolchain.py: bench@, sysbench@, the leaderboard) and `kiln-run bench` on a deployment host class a CPU
with these same functions, so their rows compare."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

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
