"""`xla`: a StableHLO artifact for XLA, from the `torch.export` program (`artifacts/program/<model>`), run through
jax's XLA CPU backend. Opt-in: profiles/xla.yaml, lockfiles/xla.txt (jax[cpu], torchax).

Build: torchax interprets the program's aten graph as jax functions; `jax.export` lowers it, weights closed over as
constants, into one serialized `jax.export.Exported` (`model.jax_export`): the StableHLO module (portable,
versioned bytecode) with its input/output shapes and calling convention. It is lowered for every platform in
`targets.xla.platforms` (default cpu, cuda, tpu): cross-platform lowering needs no such device, so the same file is
what a GPU or TPU XLA host takes; this host runs the cpu lowering. Dynamic dimensions stay symbolic (one symbolic
scope for all inputs); XLA compiles at load, once per concrete shape (≈ 1 s each, cached in the runner). A dimension
jax's shape polymorphism cannot decide (P-Net's pooled H×W, the aligner's grid) is refused in one line, with jax's
reason.

MLIR locations: jax records the Python traceback of every op (absolute paths of the checkout, the venv and this
file) in the module. The frame limit is 0 while lowering, so locations carry only jax's name stack
(`jit(forward)/conv_general_dilated`) and the artifact does not depend on where it was built.

Compatibility shim (torchax 0.0.13 on torch 2.13, local to this module, tested): torchax's tables name named-tensor
(Dimname) overloads that torch 2.13 removed, so `import torchax` fails with `AttributeError: … has no overload name
'dim_Dimname'`. While torchax is imported, a missing overload whose name is a named-tensor one resolves to an inert
placeholder (a dict key or list entry nobody dispatches to); torch is unchanged afterwards. torchax also compares
`torch.__version__ >= "2.2"` as strings (False for 2.13) and so skips its decompositions: compile runs them itself.

Audit: the StableHLO ops of the artifact. Convolutions and dot_generals are the compute ops XLA compiles on every
platform (native); a `custom_call` other than jax's own `shape_assertion` is code outside StableHLO — a host
callback or a platform library call another XLA host may not have: the fallback. A multi-platform module holds one
branch per platform for ops that lower differently (convolution), so counts include every branch.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options

EXPORT_FILE, OPTIONS_FILE = "model.jax_export", "options.json"
PRECISIONS = ("fp32",)
COMPUTE = ("stablehlo.convolution", "stablehlo.dot_general")
OWN_CUSTOM_CALLS = ("shape_assertion",)          # jax's runtime check of the symbolic shapes, part of StableHLO use
NAMED_TENSOR_OVERLOAD = re.compile(r"(?i)dimname|names")
_PLACEHOLDERS: list[str] = []                    # what the shim stood in for when this process imported torchax


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # what the artifact is lowered for; this host runs `cpu`
    platforms: Annotated[tuple[Literal["cpu", "cuda", "rocm", "tpu"], ...],
                         Field(min_length=1)] = ("cpu", "cuda", "tpu")

    @field_validator("platforms")
    @classmethod
    def _unique(cls, v):
        if len(set(v)) != len(v):
            raise ValueError("platforms repeat")
        return v


def import_torchax():
    """torchax and its decompositions, with the named-tensor overloads torch 2.13 removed resolving to placeholders
    while it is imported (module doc). Returns (torchax.export, torchax.decompositions, placeholders used)."""
    import sys

    from torch._ops import OpOverloadPacket

    if "torchax.export" in sys.modules:
        return sys.modules["torchax.export"], sys.modules["torchax.decompositions"], list(_PLACEHOLDERS)
    original, used = OpOverloadPacket.__getattr__, _PLACEHOLDERS

    def lenient(packet, key):
        try:
            return original(packet, key)
        except AttributeError:
            if not NAMED_TENSOR_OVERLOAD.search(key):
                raise
            used.append(f"{packet._qualified_op_name}.{key}")
            return ("removed overload", packet._qualified_op_name, key)

    OpOverloadPacket.__getattr__ = lenient
    try:
        import torchax.decompositions
        import torchax.export
    finally:
        OpOverloadPacket.__getattr__ = original
    return torchax.export, torchax.decompositions, list(used)


def _avals(ep):
    """jax abstract values of the program's user inputs; all dynamic dims in one symbolic scope (torchax's own
    `extract_avals` gives each dim its own scope, which jax refuses for a graph with two). Torch's lower bound 2 on
    a dim is its 0/1 specialization, not the graph's: jax's default (≥ 1) stands for it."""
    import jax
    from torch.utils._sympy.numbers import int_oo

    names, constraints = [], []
    for sym, vr in ep.range_constraints.items():
        if not sym.is_symbol:
            raise KilnError(f"xla: the program constrains the expression {sym}, not a dimension",
                            "re-export the program with plain dynamic dimensions")
        names.append(str(sym))
        if int(vr.lower) > 2:
            constraints.append(f"{sym} >= {int(vr.lower)}")
        if vr.upper != int_oo:
            constraints.append(f"{sym} <= {int(vr.upper)}")
    dims = dict(zip(names, jax.export.symbolic_shape(", ".join(names), constraints=tuple(constraints))
                    if names else ()))
    inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    return [jax.ShapeDtypeStruct(tuple(d if isinstance(d, int) else dims[str(d)] for d in n.meta["val"].shape),
                                 str(n.meta["val"].dtype).removeprefix("torch.")) for n in inputs]


def read_export(engine_dir: Path):
    import jax

    return jax.export.deserialize(bytearray((engine_dir / EXPORT_FILE).read_bytes()))


class Xla:
    name = "xla"
    runtime = ("jax",)                          # the runner needs jax (jaxlib's XLA), not torch or torchax
    reproducibility = Reproducibility(
        "bit-identical", checked_at_compile=True, bound=1e-6,
        basis="lowering is deterministic from the program; MLIR locations carry no paths (module doc)")

    def parse_options(self, raw: dict) -> Options:
        return validate_options(Options, raw, self.name)

    def probe(self) -> Toolchain:
        versions = {p: toolchain.version(p) for p in ("jax", "jaxlib", "torchax", "torch")}
        if "absent" in versions.values():
            missing = [p for p, v in versions.items() if v == "absent"]
            return Toolchain(self.name, False, f"{', '.join(missing)} not installed "
                                               "(bash scripts/setup.sh --profile xla installs it)")
        import os

        host = toolchain.cpu()
        # XLA compiles the artifact at load for this CPU: its results are this host's, so the ISA is a key too
        return Toolchain(self.name, True, rebuild_on={**versions, "isa": host["isa"], "machine": host["machine"]},
                         info={"cpu": host["cpu"], "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")})

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        if options.precision not in PRECISIONS:
            raise KilnError(f"{self.name}: precision {options.precision!r} is not built by this target",
                            f"use one of {', '.join(PRECISIONS)}")
        import jax
        import torch

        tx_export, decompositions, placeholders = import_torchax()
        opts: Options = options.options
        ep = torch.export.load(str(source))
        ep = ep.run_decompositions().run_decompositions(decompositions.DECOMPOSITIONS)
        weights, func = tx_export.exported_program_to_jax(ep)

        def forward(*xs):
            return func(weights, xs)

        limit = jax.config.jax_traceback_in_locations_limit
        jax.config.update("jax_traceback_in_locations_limit", 0)       # no source paths in the artifact
        try:
            exported = jax.export.export(jax.jit(forward), platforms=opts.platforms)(*_avals(ep))
        except Exception as e:       # jax's shape polymorphism (or torchax) cannot lower this graph
            reason = str(e).strip().splitlines()[0][:300]
            raise KilnError(f"{self.name}: {source}: cannot be lowered to StableHLO: {type(e).__name__}: {reason}",
                            "build this graph for an ONNX target instead") from e
        finally:
            jax.config.update("jax_traceback_in_locations_limit", limit)
        (out / EXPORT_FILE).write_bytes(exported.serialize())
        meta = {"precision": options.precision, "platforms": list(exported.platforms),
                "calling_convention_version": exported.calling_convention_version,
                "inputs": [str(a) for a in exported.in_avals], "outputs": [str(a) for a in exported.out_avals],
                "torchax_placeholders": sorted(set(placeholders)), "export": EXPORT_FILE}
        (out / OPTIONS_FILE).write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [out / EXPORT_FILE, out / OPTIONS_FILE]

    @staticmethod
    def ops(engine_dir: Path) -> tuple[Counter, list[str]]:
        """The StableHLO module's op counts and the targets of its custom calls, in order."""
        text = read_export(engine_dir).mlir_module()
        ops = Counter(re.findall(r"\b((?:stablehlo|chlo|mhlo)\.[a-z_]+)\b", text))
        return ops, re.findall(r"stablehlo\.custom_call @([\w.$-]+)", text)

    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        ops, calls = self.ops(engine_dir)
        native = {op: n for op, n in sorted(ops.items()) if op in COMPUTE}
        fallback = [{"node": f"custom_call {i}", "op": f"custom_call @{t}", "runs_as": "code outside StableHLO"}
                    for i, t in enumerate(calls) if t not in OWN_CUSTOM_CALLS]
        other = {op: n for op, n in sorted(ops.items()) if op not in COMPUTE and op != "stablehlo.custom_call"}
        other.update({f"custom_call.{t}": n for t, n in sorted(Counter(calls).items()) if t in OWN_CUSTOM_CALLS})
        return OpSupport(precision, native, fallback, other)

    def manifest_extras(self, engine_dir: Path) -> dict:
        meta = json.loads((engine_dir / OPTIONS_FILE).read_text(encoding="utf-8"))
        return {"build": {k: meta[k] for k in ("platforms", "calling_convention_version", "inputs", "outputs",
                                               "torchax_placeholders")}}

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        if engine_dir is None:
            return True, ""
        platforms = json.loads((engine_dir / OPTIONS_FILE).read_text(encoding="utf-8"))["platforms"]
        if "cpu" not in platforms:
            return False, f"lowered for {', '.join(platforms)} only; this host's XLA backend is cpu"
        return True, ""

    def check_package(self, engine_dir: Path) -> None:
        """Before every load: the file deserializes as a `jax.export.Exported` (a flatbuffer; nothing runs) with a
        cpu lowering. Loading then compiles its StableHLO with XLA for this CPU: native code, from a verified file."""
        try:
            exported = read_export(engine_dir)
        except Exception as e:
            raise KilnError(f"{engine_dir / EXPORT_FILE}: not a jax.export artifact ({type(e).__name__})",
                            "do not load it: rebuild the engine (kiln compile <engine>)") from None
        if "cpu" not in exported.platforms:
            raise KilnError(f"{engine_dir / EXPORT_FILE}: lowered for {', '.join(exported.platforms)}, not cpu",
                            "add cpu to targets.xla.platforms and rebuild")

    def load(self, engine_dir: Path) -> "XlaRunner":
        return XlaRunner(engine_dir)


class XlaRunner:
    """The artifact's cpu lowering, compiled by XLA once per input shape (jit's cache)."""

    def __init__(self, engine_dir: Path) -> None:
        import jax

        exported = read_export(engine_dir)
        self.dtypes = [np.dtype(a.dtype) for a in exported.in_avals]
        self._call = jax.jit(exported.call)

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        args = [np.ascontiguousarray(v, dt) for v, dt in zip(feed.values(), self.dtypes, strict=True)]
        return [np.asarray(y) for y in self._call(*args)]

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({"input": batch})[0]
