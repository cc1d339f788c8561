"""Compiler targets. Adding one is a new module here, one entry in TARGETS and one in params.yaml `targets:`.

The registry names each target's module without importing it, so reading params (which checks what a target
compiles) never loads a toolchain, and a stage's code closure holds only the target modules it really uses.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pipeline.errors import KilnError


@dataclass(frozen=True)
class Entry:
    module: str           # pipeline.targets.<module>
    cls: str              # the class implementing the protocol (pipeline/targets/base.py)
    source_kind: str      # "onnx": compiles artifacts/export|quantized; "program": artifacts/program


TARGETS: dict[str, Entry] = {
    "ort-cpu": Entry("pipeline.targets.ort_cpu", "OrtCpu", "onnx"),
    "aoti-cpu": Entry("pipeline.targets.aoti", "AotiCpu", "program"),
    "tensorrt": Entry("pipeline.targets.tensorrt", "TensorRT", "onnx"),
}


def entry(name: str) -> Entry:
    if name not in TARGETS:
        raise KilnError(f"unknown target {name!r}", f"known targets: {', '.join(sorted(TARGETS))}")
    return TARGETS[name]


def module(name: str) -> str:
    return entry(name).module


def source_kind(name: str) -> str:
    return entry(name).source_kind


def get(name: str):
    """An instance of the target's class (its module imported now; its toolchain only when it needs it)."""
    e = entry(name)
    return getattr(importlib.import_module(e.module), e.cls)()


def options(cfg, name: str):
    """The target's validated options from params (`targets.<name>`); errors name the params file and key."""
    try:
        return get(name).parse_options(cfg.targets[name].options)
    except KilnError as err:
        raise KilnError(f"{cfg.source}: {err.message}", err.hint) from None
