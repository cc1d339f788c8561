"""The target protocol: one module per compiler target behind four calls.

    probe()   → Toolchain        versions + device, or unavailable with a one-line reason
    compile() → list[Path]       engine files written into a directory
    audit()   → OpSupport        which compute nodes run natively in the requested precision, which fell back
    load()    → Runner           Runner.run(batch) -> first output; Runner.run_all(feed) -> every output

Optional toolchains are imported lazily inside a target, so a missing one never breaks `import pipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Toolchain:
    target: str
    available: bool
    reason: str = ""                                        # why not, when unavailable
    rebuild_on: dict[str, Any] = field(default_factory=dict)  # versions/ISA whose change must rebuild engines
    info: dict[str, Any] = field(default_factory=dict)        # recorded for audit, never triggers a rebuild

    def line(self) -> str:
        if not self.available:
            return f"{self.target}: unavailable ({self.reason})"
        return f"{self.target}: available (" + ", ".join(f"{k} {v}" for k, v in self.rebuild_on.items()
                                                     if not isinstance(v, list)) + ")"


@dataclass(frozen=True)
class OpSupport:
    precision: str
    native: dict[str, int]          # op type → count of compute nodes running in the requested precision
    fallback: list[dict[str, str]]  # [{"node", "op", "runs_as"}] compute nodes that did not
    other: dict[str, int]           # non-compute ops (reshapes, casts, Q/DQ) for completeness

    @property
    def ok(self) -> bool:
        return not self.fallback

    def summary(self) -> dict[str, Any]:
        return {"precision": self.precision, "native_nodes": sum(self.native.values()),
                "fallback_nodes": len(self.fallback), "native": self.native, "fallback": self.fallback,
                "other": self.other}


@dataclass(frozen=True)
class CompileOptions:
    precision: str                  # fp32 | fp16 | int8
    options: dict[str, Any]         # target options from params.yaml


class Runner(Protocol):
    def run(self, batch: np.ndarray) -> np.ndarray: ...             # single-input graphs: first output

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]: ...  # named inputs → every output


class Target(Protocol):
    name: str

    def probe(self) -> Toolchain: ...

    def compile(self, onnx: Path, options: CompileOptions, out: Path) -> list[Path]: ...

    def audit(self, engine_dir: Path, precision: str) -> OpSupport: ...

    def load(self, engine_dir: Path) -> Runner: ...


def synthetic_feed(kind: str, input_shape: tuple[int, ...], batch: int, seed: int = 0) -> Feed:
    """A synthetic feed of `batch` samples with realistic value ranges, for latency (not accuracy) measurement."""
    rng = np.random.default_rng(seed)
    if kind == "aligner":  # one image of input_shape, `batch` faces to cut out of it
        theta = np.tile(np.array([[[1.0, 0.0, 20.0], [0.0, 1.0, 20.0]]], np.float32), (batch, 1, 1))
        return {"image": rng.uniform(0, 255, (1, *input_shape)).astype(np.float32), "theta": theta}
    low, high = (0.0, 255.0) if kind == "chips" else (-1.0, 1.0)  # MTCNN nets take normalised pixels
    return {"input": rng.uniform(low, high, (batch, *input_shape)).astype(np.float32)}
