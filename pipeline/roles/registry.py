"""The role registry: params.yaml `samples` value → the module and object implementing the role protocol
(pipeline/roles/base.py). Adding a role is a new module in pipeline/roles/ and one entry here.

Like the target registry, it names each role's module without importing it: config.py reads the names from here,
so the params schema never loads feed or metric code, and a stage's code closure holds only the role modules it
lists (`modules`, for its `dynamic`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pipeline.errors import KilnError


@dataclass(frozen=True)
class Entry:
    module: str           # pipeline.roles.<module>
    attr: str             # the role object in it


# In the order params errors list them.
ROLES: dict[str, Entry] = {
    "chips": Entry("pipeline.roles.embedder", "EMBEDDER"),
    "pnet": Entry("pipeline.roles.mtcnn", "PNET"),
    "rnet": Entry("pipeline.roles.mtcnn", "RNET"),
    "onet": Entry("pipeline.roles.mtcnn", "ONET"),
    "aligner": Entry("pipeline.roles.aligner", "ALIGNER"),
    "retinaface": Entry("pipeline.roles.retinaface", "RETINAFACE"),
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
    return [n for n in ROLES if get(n).task == task]


def modules(name: str, gate: bool = False) -> list[str]:
    """The code a stage runs for a role, for its `dynamic`: the role's module, and with `gate` the metric code it
    calls by name (pipeline/gates/)."""
    return [entry(name).module, *(get(name).gate_code() if gate else ())]


def synthetic_feed(kind: str, input_shape: tuple[int, ...], batch: int, seed: int = 0) -> dict:
    """A synthetic feed of `batch` samples with realistic value ranges, for latency (not accuracy) measurement."""
    return get(kind).random_feed(tuple(input_shape), batch, seed)
