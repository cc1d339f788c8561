"""The target protocol: one module per compiler target, one class, everything a stage may ask of it.

    name                    the params.yaml / registry key
    runtime                 the Python modules its runner imports (a cold start pays for them; bench@ times it)
    parse_options(raw)      validate the target's own params (`targets.<name>` less enabled/fallback_policy)
    probe()       → Toolchain   versions + device as `rebuild_on`, or unavailable with a one-line reason; cheap
    compile(src, options, out, workdir) → list[Path]   engine files written into `out`
    audit(engine_dir, precision) → OpSupport   which compute nodes run natively, which fell back
    load(engine_dir) → Runner   Runner.run(batch) → first output; Runner.run_all(feed) → every output
    manifest_extras(engine_dir) → {"build": …, "results": …}   what the engine carries beside its files
    check_package(engine_dir)   refuse a package whose contents could escape extraction (before `load`)
    runnable(engine_dir) → (ok, why)   can this host run the engine? A build-only target (tensorrt-rtx builds
                                        RTX-GPU engines on a CPU) says why not; validate@ then records `not run`
    reproducibility → Reproducibility   the class of equivalence the target promises between two builds, and
                                        whether compile proves it by rebuilding in a fresh process
    accept_rebuild(mine, other, differing) → str | None   a rebuild whose files differ that still meets the claim,
                                        described (tensorrt-rtx: bindings reordered); None (every other target)
                                        fails the gate
    tune(src, options, out, workdir) → (files, summary)   only a target the registry marks `tunes` (tvm): the
                                        schedule database tune@<engine> stores; compile gets it as `tuning`

What a target compiles (its `source_kind`) and which precisions it builds are in the registry
(pipeline/targets/__init__.py), so params can be checked without importing a toolchain. Optional toolchains are
imported lazily inside a target, so a missing one never breaks `import pipeline`. Loading an engine runs native code
(ONNX Runtime kernels on a graph we wrote; an AOTInductor package is a shared library): `pipeline/engines.py`
verifies the files against their manifest, in a private copy, before any target's `load` sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeline.errors import KilnError

# Equivalence classes between two builds of one engine, strongest first (kiln rebuild-check classifies into these).
CLASSES = ("bit-identical", "numerically-equivalent", "task-equivalent", "different")


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
class Reproducibility:
    """What a target promises about two builds from the same inputs, and how compile checks it.

    claim: one of CLASSES[:3]. checked_at_compile: compile rebuilds in a fresh process and fails below the claim
    (cheap targets); otherwise `kiln rebuild-check compile@<engine>` proves it on demand (CI runs it).
    bound: largest |Δ| on the golden feeds that still counts as numerically equivalent."""

    claim: str
    checked_at_compile: bool
    bound: float = 0.0
    basis: str = ""

    def __post_init__(self) -> None:
        if self.claim not in CLASSES[:3]:
            raise ValueError(f"unknown reproducibility claim {self.claim!r}")


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
    options: Any                    # the target's validated options (its `options()` result)
    calibration: Any = None         # program targets' int8: an iterable of feeds (the stored calibration chips)
    tuning: Path | None = None      # a tunable target's schedule database (its tune@<engine> artifact), if tuned


class Runner(Protocol):
    def run(self, batch: np.ndarray) -> np.ndarray: ...             # single-input graphs: first output

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]: ...  # named inputs → every output


class Target(Protocol):
    name: str
    reproducibility: Reproducibility
    runtime: tuple[str, ...]                                    # modules its runner imports (cold start counts them)

    def parse_options(self, raw: dict[str, Any]) -> Any: ...    # KilnError naming `targets.<name>.<key>`

    def probe(self) -> Toolchain: ...

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]: ...

    def audit(self, engine_dir: Path, precision: str) -> OpSupport: ...

    def load(self, engine_dir: Path) -> Runner: ...     # a target may take `threads=` (engines.load passes it on)

    def manifest_extras(self, engine_dir: Path) -> dict[str, Any]: ...

    def check_package(self, engine_dir: Path) -> None: ...   # refuse an unsafe package before `load` extracts it

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]: ...

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None: ...


def validate_options(model: type, raw: dict[str, Any], target: str) -> Any:
    """A target's pydantic options model applied to its params; errors name `targets.<target>.<key>`."""
    from pydantic import ValidationError

    try:
        return model(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union[")))
        if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            raise KilnError(f"targets.{target}.{key}: unknown option",
                            "check the spelling against the repository's params.yaml") from None
        raise KilnError(f"targets.{target}.{key}: {err['msg'].rstrip('.')} (got {err.get('input')!r})",
                        "fix the value in params.yaml") from None

