"""`ort-cpu`: ONNX Runtime on the CPU. The engine is the offline-optimized graph plus the session options used.

Offline optimization at level `all` may insert layouts for this CPU (NCHWc), so the target's rebuild keys include
the CPU's ISA flags as well as the ONNX Runtime version: an engine is rebuilt, never reused, when either changes.

One rewrite runs before ONNX Runtime's optimizer, a compile choice in params (`targets.ort-cpu.prelu`): ONNX
Runtime's CPU PRelu is an unfused, unvectorized broadcast (55–65 % of SFace's time on a 2-core EPYC, where its Convs
are 25–40 %), and it keeps NCHWc layouts from spanning the PRelu. `decompose` writes each PRelu with a constant slope
as Relu(x) + slope · Min(x, 0): exactly the same values (one of the two terms is exactly 0), and kernels ONNX Runtime
vectorizes and threads. `keep` leaves the graph as exported; validate@ gates either.
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
        prelu: Literal["decompose", "keep"] = "decompose"                 # PRelu → Relu + slope·Min(x, 0)?

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
        if o.prelu == "decompose":
            model = onnx_lib.load(str(source))
            if decompose_prelu(model):
                source = workdir / "prelu-decomposed.onnx"
                onnx_lib.save(model, str(source))
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


def decompose_prelu(model) -> int:
    """Rewrite, in place, each PRelu whose slope is a float initializer as Relu(x) + slope · Min(x, 0) — the same
    values bit for bit, in kernels ONNX Runtime vectorizes — keeping the PRelu's output name. Returns how many."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 8:      # Min broadcasts from opset 8
        return 0
    slopes = {i.name: i.data_type for i in graph.initializer}
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE}
    nodes, zeros, count = [], {}, 0
    for node in graph.node:
        if node.op_type != "PRelu" or node.domain not in ("", "ai.onnx") or slopes.get(node.input[1]) not in floats:
            nodes.append(node)
            continue
        x, slope = node.input
        y, dtype = node.output[0], slopes[slope]
        if dtype not in zeros:
            zeros[dtype] = f"kiln_prelu_zero_{dtype}"
            zero = np.zeros((), dtype=helper.tensor_dtype_to_np_dtype(dtype))
            graph.initializer.append(numpy_helper.from_array(zero, zeros[dtype]))
        stem = f"kiln_prelu_{count}"
        nodes += [helper.make_node("Relu", [x], [f"{stem}_pos"], name=f"{stem}_relu"),
                  helper.make_node("Min", [x, zeros[dtype]], [f"{stem}_neg"], name=f"{stem}_min"),
                  helper.make_node("Mul", [f"{stem}_neg", slope], [f"{stem}_scaled"], name=f"{stem}_mul"),
                  helper.make_node("Add", [f"{stem}_pos", f"{stem}_scaled"], [y], name=f"{stem}_add")]
        count += 1
    if count:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return count
