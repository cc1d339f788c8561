"""Compiler targets. Adding one is a new module here, one entry in TARGETS and one in params.yaml `targets:`."""

from __future__ import annotations

from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Runner, Target, Toolchain
from pipeline.targets.ort_cpu import OrtCpu

TARGETS: dict[str, type] = {"ort-cpu": OrtCpu}


def get(name: str) -> Target:
    if name not in TARGETS:
        raise KilnError(f"unknown target {name!r}", f"known targets: {', '.join(sorted(TARGETS))}")
    return TARGETS[name]()


__all__ = ["TARGETS", "get", "CompileOptions", "OpSupport", "Runner", "Target", "Toolchain"]
