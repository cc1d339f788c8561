"""`ort-cpu`: ONNX Runtime on the CPU. The engine is the offline-optimized graph plus the session options used.

Offline optimization at level `all` may insert layouts for this CPU (NCHWc), so the target's rebuild keys include
the CPU's ISA flags as well as the ONNX Runtime version: an engine is rebuilt, never reused, when either changes.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal


from kiln_runtime.runners.ort import ENGINE as ENGINE_FILE
from kiln_runtime.runners.ort import SESSION as SESSION_FILE
from kiln_runtime.runners.ort import OrtRunner, ort_session_options
from pipeline import toolchain
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options

LEVELS = {"basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
QUANT_COMPUTE = {"QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger", "QGemm", "QLinearAdd",
                 "QLinearMul", "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearConcat",
                 "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QLinearSigmoid", "QLinearLeakyRelu"}
FLOAT_COMPUTE = {"Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm", "ConvTranspose", "Add", "Mul",
                 "AveragePool", "MaxPool", "GlobalAveragePool"}
HEAVY = {"Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm", "ConvTranspose"}


@cache
def options_model() -> type:
    """The params model (`targets.ort-cpu`), built on first use: pydantic costs ≈ 100 ms to import and build, and
    only the stages that read params need it — a runner's cold start (pipeline/coldstart.py) never does."""
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        graph_optimization: Literal["basic", "extended", "all"] = "all"  # offline; `all` may use this CPU's layouts
        threads: Annotated[StrictInt, Field(ge=0, le=256)] = 0            # intra-op threads; 0 = ORT's default
        spin: StrictBool = False                                          # idle intra-op threads spin-wait?

    return Options


class OrtCpu:
    name = "ort-cpu"
    runtime = ("onnxruntime",)           # what its runner imports (a cold start pays for it)
    # compiling takes ~1 s, so the compile stage rebuilds in a fresh process and compares bytes every time
    reproducibility = Reproducibility("bit-identical", checked_at_compile=True, bound=1e-6,
                                      basis="offline-optimized graph, canonicalized (targets/canonical.py)")

    def parse_options(self, raw: dict) -> Any:
        return validate_options(options_model(), raw, self.name)

    def manifest_extras(self, engine_dir: Path) -> dict:
        return {}

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None   # a canonicalized graph: any byte difference is a real one

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        return True, ""

    def check_package(self, engine_dir: Path) -> None:
        """An ONNX file and a JSON file: nothing is extracted, so nothing to check beyond their digests."""

    def probe(self) -> Toolchain:
        try:
            import onnxruntime as ort
        except ImportError as e:
            return Toolchain(self.name, False, f"onnxruntime not importable: {e}")
        if "CPUExecutionProvider" not in ort.get_available_providers():
            return Toolchain(self.name, False, "CPUExecutionProvider missing from this onnxruntime build")
        host = toolchain.cpu()
        return Toolchain(self.name, True,
                         rebuild_on={"onnxruntime": ort.__version__, "isa": host["isa"], "machine": host["machine"]},
                         info={"cpu": host["cpu"], "providers": ort.get_available_providers()})

    @staticmethod
    def _session_options(threads: int, spin: bool, optimized_out: Path | None = None, level: str = "all"):
        """Session options: a compile (`optimized_out`: optimize at `level`, save the graph there) or a load of an
        engine already optimized offline (kiln_runtime.runners: a deployment host loads with the same)."""
        return ort_session_options(threads, spin, optimized_out, LEVELS[level])

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        import onnx as onnx_lib
        import onnxruntime as ort

        from pipeline.targets.canonical import canonicalize    # imports onnx: not on the runner's (cold-start) path

        engine, o = out / ENGINE_FILE, options.options
        ort.InferenceSession(str(source), self._session_options(o.threads, o.spin, engine, o.graph_optimization),
                             providers=["CPUExecutionProvider"])
        onnx_lib.save(canonicalize(onnx_lib.load(str(engine))), str(engine))  # same model → same bytes
        session = {"providers": ["CPUExecutionProvider"], "precision": options.precision,
                   "graph_optimization": o.graph_optimization, "threads": o.threads, "spin": o.spin,
                   "load_with_optimization": "disabled"}
        (out / SESSION_FILE).write_text(json.dumps(session, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [engine, out / SESSION_FILE]

    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        """Read the optimized graph: which compute nodes run quantized kernels, which run in float."""
        import onnx

        graph = onnx.load(str(engine_dir / ENGINE_FILE), load_external_data=False).graph
        native, fallback, other = Counter(), [], Counter()
        for node in graph.node:
            op = node.op_type
            if precision == "int8" and op in QUANT_COMPUTE:
                native[op] += 1
            elif precision == "int8" and op in HEAVY:
                fallback.append({"node": node.name, "op": f"{node.domain + '.' if node.domain else ''}{op}",
                                 "runs_as": "float32"})
            elif precision != "int8" and op in FLOAT_COMPUTE:
                native[f"{node.domain + '.' if node.domain else ''}{op}"] += 1
            else:
                other[f"{node.domain + '.' if node.domain else ''}{op}"] += 1
        return OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))

    def load(self, engine_dir: Path, threads: int | None = None) -> "OrtRunner":
        return OrtRunner(engine_dir, threads)
