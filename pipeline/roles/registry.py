"""The role registry: params.yaml `samples` value → the module and object implementing the role protocol
(pipeline/roles/base.py). Adding a role is a new module in pipeline/roles/ and one entry here.

Like the target registry, it names each role's module without importing it, with the two facts params checks need
(its task, whether it comes only from an ONNX file): config.py reads those from here, so validating params.yaml
never loads a role module, and a stage's code closure — and what it imports at run time — holds only the role
modules it lists (`modules`, for its `dynamic`). tests/roles/test_roles.py checks each entry agrees with its role.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pipeline.errors import KilnError


@dataclass(frozen=True)
class Entry:
    module: str           # pipeline.roles.<module>
    attr: str             # the role object in it
    task: str             # its `task` (embed | detect | cascade | align), for params checks
    onnx_only: bool = False   # its `onnx_only`: the model must come from an ONNX file
    declared_decode: bool = False   # a single-shot detector whose head params.yaml declares (models.<m>.decode)


# In the order params errors list them.
ROLES: dict[str, Entry] = {
    "chips": Entry("pipeline.roles.embedder", "EMBEDDER", "embed"),
    "pnet": Entry("pipeline.roles.mtcnn", "PNET", "cascade"),
    "rnet": Entry("pipeline.roles.mtcnn", "RNET", "cascade"),
    "onet": Entry("pipeline.roles.mtcnn", "ONET", "cascade"),
    "aligner": Entry("pipeline.roles.aligner", "ALIGNER", "align"),
    "retinaface": Entry("pipeline.roles.retinaface", "RETINAFACE", "detect", onnx_only=True),
    "singleshot": Entry("pipeline.roles.singleshot", "SINGLESHOT", "detect", onnx_only=True, declared_decode=True),
}


def names() -> tuple[str, ...]:
    return tuple(ROLES)


def entry(name: str) -> Entry:
    if name not in ROLES:
        raise KilnError(f"unknown role (samples) {name!r}", f"known roles: {', '.join(ROLES)}")
    return ROLES[name]


def get(name: str):
    """The role object (its module imported now: numpy and the protocol only, feed and metric code when used)."""
    e = entry(name)
    return getattr(importlib.import_module(e.module), e.attr)


def every() -> dict[str, object]:
    return {n: get(n) for n in ROLES}


def with_task(task: str) -> list[str]:
    """The roles whose graphs do `task` in a face system (embed, detect, cascade, align)."""
    return [n for n, e in ROLES.items() if e.task == task]


def modules(name: str, gate: bool = False) -> list[str]:
    """The code a stage runs for a role, for its `dynamic`: the role's module, and with `gate` the metric code it
    calls by name (pipeline/gates/)."""
    return [entry(name).module, *(get(name).gate_code() if gate else ())]


def synthetic_feed(kind: str, input_shape: tuple[int, ...], batch: int, seed: int = 0) -> dict:
    """A synthetic feed of `batch` samples with realistic value ranges, for latency (not accuracy) measurement."""
    return get(kind).random_feed(tuple(input_shape), batch, seed)
