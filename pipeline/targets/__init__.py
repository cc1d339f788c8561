"""Compiler targets. Adding one is a new module here, one entry in TARGETS and one in params.yaml `targets:`.

The registry names each target's module without importing it, so reading params (which checks what a target
compiles) never loads a toolchain, and a stage's code closure holds only the target modules it really uses.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.errors import KilnError

if TYPE_CHECKING:
    from pipeline.config import Config, EngineSpec


@dataclass(frozen=True)
class Entry:
    module: str           # pipeline.targets.<module>
    cls: str              # the class implementing the protocol (pipeline/targets/base.py)
    source_kind: str      # "onnx": compiles artifacts/export|quantized; "program": artifacts/program
    precisions: tuple[str, ...]   # what it builds; int8 compiles a recipe's QDQ model, the others the FP32 source
    tunes: bool = False           # has a tune@<engine> stage (module-level `tune`, options.tuning.trials > 0)


TARGETS: dict[str, Entry] = {
    "ort-cpu": Entry("pipeline.targets.ort_cpu", "OrtCpu", "onnx", ("fp32", "int8")),
    "aoti-cpu": Entry("pipeline.targets.aoti", "AotiCpu", "program", ("fp32",)),
    "openvino-cpu": Entry("pipeline.targets.openvino", "OpenVinoCpu", "onnx", ("fp32", "bf16", "int8")),
    "executorch-xnnpack": Entry("pipeline.targets.executorch", "ExecuTorchXnnpack", "program", ("fp32", "int8")),
    "litert": Entry("pipeline.targets.litert", "LiteRT", "program", ("fp32", "int8")),
    "xla": Entry("pipeline.targets.xla", "Xla", "program", ("fp32",)),
    "tvm": Entry("pipeline.targets.tvm", "Tvm", "onnx", ("fp32",), tunes=True),
    "tensorrt": Entry("pipeline.targets.tensorrt", "TensorRT", "onnx", ("fp32", "fp16", "int8")),
    "tensorrt-rtx": Entry("pipeline.targets.tensorrt_rtx", "TensorRTRTX", "onnx", ("fp32", "fp16", "int8")),
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


def options(cfg: Config, name: str):
    """The target's validated options from params (`targets.<name>`); errors name the params file and key."""
    try:
        return get(name).parse_options(cfg.targets[name].options)
    except KilnError as err:
        raise KilnError(f"{cfg.source}: {err.message}", err.hint) from None


def tuned(cfg: Config, engine_name: str) -> bool:
    """Does this engine compile with a tuning database (its target tunes and `tuning.trials` > 0)?"""
    e = cfg.engine(engine_name)
    return entry(e.target).tunes and cfg.targets[e.target].enabled and options(cfg, e.target).tuning.trials > 0


def expected_source(engine: EngineSpec) -> str:
    """The artifact an engine compiles: its model's torch.export program (program targets), else the FP32 export or
    the recipe's INT8 QDQ model."""
    if source_kind(engine.target) == "program":
        return f"artifacts/program/{engine.model}"
    if engine.precision == "int8":
        return f"artifacts/quantized/{engine.model}-{engine.recipe}"
    return f"artifacts/export/{engine.model}"


def check(cfg: Config, engines: list[str] | None = None) -> None:
    """What params need the registry for: every configured target exists and its options are valid, and each
    engine (all, or `engines`) names the source its target compiles. Errors name the params file and key.
    Given `engines`, only their targets' modules are imported: a stage's code closure stays what its DAG lists."""
    for name in cfg.targets:
        if name not in TARGETS:
            raise KilnError(f"{cfg.source}: targets.{name}: unknown target",
                            f"known targets: {', '.join(sorted(TARGETS))}")
    used = cfg.targets if engines is None else {cfg.engine(n).target for n in engines}
    for name in used:
        options(cfg, name)
    for name in engines if engines is not None else list(cfg.engines):
        e = cfg.engine(name)
        where = f"{cfg.source}: engines.{name}"
        if e.precision not in (built := entry(e.target).precisions):
            raise KilnError(f"{where}.precision: {e.target} does not build {e.precision}",
                            f"use one of {', '.join(built)} for this target")
        if source_kind(e.target) == "program":
            if e.model not in cfg.program.models:
                raise KilnError(f"{where}.model: {e.model!r} has no torch.export program (program.models)",
                                f"add {e.model} to program.models")
            if e.recipe is not None:     # its int8 is quantized at compile (PT2E) on the calibration chips
                raise KilnError(f"{where}.recipe: a program target's int8 engine is quantized at compile on the "
                                "calibration chips, not by an ONNX recipe", "drop `recipe:`")
        if e.source.rstrip("/") != (want := expected_source(e)):
            raise KilnError(f"{where}.source: {e.source!r} is not the artifact a {e.precision} {e.target} engine of "
                            f"{e.model!r} compiles", f"set it to {want}")
