"""Compiler targets. Adding one is a new module here, one entry in TARGETS and one in params.yaml `targets:`."""

from __future__ import annotations

from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Runner, Target, Toolchain
from pipeline.targets.aoti import AotiCpu
from pipeline.targets.ort_cpu import OrtCpu
from pipeline.targets.tensorrt import TensorRT  # imports no TensorRT: its toolchain loads lazily inside

TARGETS: dict[str, type] = {"ort-cpu": OrtCpu, "aoti-cpu": AotiCpu}
TARGETS["tensorrt"] = TensorRT


def get(name: str) -> Target:
    if name not in TARGETS:
        raise KilnError(f"unknown target {name!r}", f"known targets: {', '.join(sorted(TARGETS))}")
    return TARGETS[name]()


__all__ = ["TARGETS", "get", "CompileOptions", "OpSupport", "Runner", "Target", "Toolchain"]
