"""`openvino-cpu`: OpenVINO on the CPU. The engine is the OpenVINO IR (model.xml + model.bin) and the runtime
properties it is compiled with at load (config.json).

Precisions, all from artifacts the DAG already holds (one calibration for every target):

* fp32 — the FP32 export with `INFERENCE_PRECISION_HINT` pinned to f32. The CPU plugin's default on a CPU with
  AVX512-BF16/AMX is bf16, which silently changes the numbers (golden cosine 0.99998 instead of 1.0).
* bf16 — the same IR run with the hint bf16; built only where the CPU reports `BF16` in OPTIMIZATION_CAPABILITIES.
* int8 — the recipe's QDQ model (`quantize@<model>-<recipe>`). OpenVINO turns each QuantizeLinear/DequantizeLinear
  pair into a FakeQuantize and its low-precision transformations run the convolutions in u8/i8. NNCF's own
  post-training quantization on the same calibration chips was measured as an alternative (README: it was no faster
  and lost accuracy), so the calibration stays the one `calibrate@` stored.

The IR is the shipped artifact: it is the same file on every host. A compiled blob (`export_model`) loads faster but
is tied to the OpenVINO build and this CPU, and OpenVINO recompiles it on import across versions — it is not shipped,
and the manifest says so (`build.compiled_blob`). `save_model` runs with `compress_to_fp16=False` (its default
halves the weights) and in a process that never ran `query_model` (which changes blob bytes), so a rebuild in a
fresh process gives the same bytes; compile checks that every time (it takes well under a second).

The audit compiles the IR for this CPU and reads the runtime graph: each compute layer (Convolution, FullyConnected,
MatMul, …) with the precision it really runs in. A layer below the requested precision is a fallback. OpenVINO's own
op-support query (`query_model`) runs per device: CPU, and NPU — whose compiler is a separate install, so on a host
without it the audit records the exact reason instead of a support list.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from functools import cache
from typing import Annotated, Any, Literal


from kiln_runtime.runners.openvino import BIN, CONFIG, XML, OvRunner
from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options

XML_FILE, BIN_FILE, CONFIG_FILE = XML, BIN, CONFIG          # kiln_runtime.runners.openvino loads these
PRECISIONS = ("fp32", "bf16", "int8")
HINT = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}     # int8: the layers left in float run in f32
RUNS_AS = {"fp32": {"f32"}, "bf16": {"bf16"}, "int8": {"u8", "i8"}}
COMPUTE = {"Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul", "Gemm"}
AUDIT_DEVICES = ("CPU", "NPU")
AUTO_NAME = re.compile(r"[A-Za-z]+_\d+")


@cache
def options_model() -> type:
    """The params model (`targets.openvino-cpu`), built on first use: pydantic costs ≈ 100 ms to import and build,
    and a runner's cold start (pipeline/coldstart.py) never needs it."""
    from pydantic import BaseModel, ConfigDict, Field, StrictInt

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        threads: Annotated[StrictInt, Field(ge=0, le=256)] = 0          # INFERENCE_NUM_THREADS; 0 = plugin default
        performance_hint: Literal["LATENCY", "THROUGHPUT"] = "LATENCY"

    return Options


def _ov():
    import openvino

    return openvino


def _reason(err: Exception) -> str:
    """The last meaningful line of an OpenVINO error, without host paths (it goes into a cached manifest)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.startswith("Exception from")]
    text = " ".join(lines[-2:]) if lines else type(err).__name__
    return re.sub(r"""(?<=[\s"'])(/[^\s"':]+/)+""", "", text)[:300]


def canonical_names(model):
    """Name the ops OpenVINO created while reading the ONNX by their position, not by its process-wide counter.

    The ONNX frontend names the constants and converts it inserts `<Type>_<n>`, n counting every op the process ever
    made: the same model read after another (or after a query) gets other names, so other IR bytes. Ops named by
    the ONNX keep their names."""
    for i, op in enumerate(model.get_ordered_ops()):
        if AUTO_NAME.fullmatch(op.get_friendly_name()) and op.get_friendly_name().startswith(op.get_type_name() + "_"):
            op.set_friendly_name(f"{op.get_type_name()}_k{i}")
    return model


class OpenVinoCpu:
    name = "openvino-cpu"
    runtime = ("openvino",)
    reproducibility = Reproducibility("bit-identical", checked_at_compile=True, bound=1e-6,
                                      basis="IR from save_model(compress_to_fp16=False) in a process without "
                                            "query_model; runtime properties in config.json")

    def parse_options(self, raw: dict) -> Any:
        return validate_options(options_model(), raw, self.name)

    def probe(self) -> Toolchain:
        try:
            ov = _ov()
        except ImportError as e:
            return Toolchain(self.name, False, f"openvino not importable: {e} (bash scripts/setup.sh installs it)")
        core = ov.Core()
        if "CPU" not in core.available_devices:
            return Toolchain(self.name, False, f"OpenVINO sees no CPU device (devices: {core.available_devices})")
        host = toolchain.cpu()
        plugin = core.get_versions("CPU")["CPU"]
        return Toolchain(self.name, True,
                         rebuild_on={"openvino": ov.get_version(), "cpu_plugin": plugin.build_number,
                                     "capabilities": sorted(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
                                     "devices": sorted(core.available_devices),   # NPU appears with its driver
                                     "isa": host["isa"], "machine": host["machine"]},
                         info={"cpu": host["cpu"]})

    # ------------------------------------------------------------------------------------------ compile
    @staticmethod
    def runtime_config(precision: str, options: Any) -> dict:
        """The properties the IR is compiled with at load: the precision pinned, never the plugin's default."""
        cfg = {"INFERENCE_PRECISION_HINT": HINT[precision], "PERFORMANCE_HINT": options.performance_hint,
               "NUM_STREAMS": 1}
        if options.threads:
            cfg["INFERENCE_NUM_THREADS"] = options.threads
        return cfg

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        ov = _ov()
        if options.precision not in PRECISIONS:
            raise KilnError(f"{self.name}: precision {options.precision!r} is not built by this target",
                            f"use one of {', '.join(PRECISIONS)}")
        core = ov.Core()
        if options.precision == "bf16" and "BF16" not in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
            raise KilnError(f"{self.name}: this CPU has no bf16 support (OPTIMIZATION_CAPABILITIES lacks BF16); "
                            "not built", "drop the bf16 engine from `engines:` on this host")
        model = canonical_names(core.read_model(str(source)))
        ov.save_model(model, str(out / XML_FILE), compress_to_fp16=False)
        config = {"device": "CPU", "precision": options.precision, "source_format": "onnx",
                  "properties": self.runtime_config(options.precision, options.options)}
        (out / CONFIG_FILE).write_text(json.dumps(config, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [out / XML_FILE, out / BIN_FILE, out / CONFIG_FILE]

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None

    def manifest_extras(self, engine_dir: Path) -> dict:
        query = self.device_query(engine_dir)
        return {"build": {"compiled_blob": "not shipped: an export_model blob is tied to this OpenVINO build and CPU "
                                           "(recompiled on import elsewhere); the IR is the portable artifact",
                          "ir": {"compress_to_fp16": False}},
                "results": {"device_query": query}}

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        return True, ""

    def check_package(self, engine_dir: Path) -> None:
        """The IR's .xml must name no external file but its own .bin (read_model follows the .xml)."""
        text = (engine_dir / XML_FILE).read_text(encoding="utf-8", errors="replace")
        if re.search(r"<!DOCTYPE|<!ENTITY|SYSTEM\s+[\"']", text):
            raise KilnError(f"{engine_dir / XML_FILE}: the IR declares external entities",
                            "do not load it: rebuild the engine (kiln compile <engine>)")

    # ------------------------------------------------------------------------------------------ audit
    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        """Compile the IR for this CPU as `load` does and read the precision each compute layer runs in."""
        ov = _ov()
        core = ov.Core()
        config = json.loads((engine_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        compiled = core.compile_model(core.read_model(str(engine_dir / XML_FILE)), "CPU", config["properties"])
        native, fallback, other = Counter(), [], Counter()
        want = RUNS_AS[precision]
        for op in compiled.get_runtime_model().get_ordered_ops():
            rt = op.get_rt_info()
            layer, runs = rt["layerType"].astype(str), rt["runtimePrecision"].astype(str)
            if layer in COMPUTE and runs in want:
                native[layer] += 1
            elif layer in COMPUTE:
                fallback.append({"node": op.get_friendly_name(), "op": layer, "runs_as": runs})
            else:
                other[layer] += 1
        return OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))

    def device_query(self, engine_dir: Path, devices: tuple[str, ...] = AUDIT_DEVICES) -> dict:
        """OpenVINO's op-support query per device: how many of the IR's ops each device takes, and which it does
        not (those a build for that device would place on the CPU). A device whose plugin or compiler is missing
        here records the reason. Run in its own process by callers that also save IR (it changes blob bytes)."""
        ov = _ov()
        core = ov.Core()
        model = core.read_model(str(engine_dir / XML_FILE))
        ops = {op.get_friendly_name(): op.get_type_name() for op in model.get_ordered_ops()
               if op.get_type_name() not in ("Parameter", "Result", "Constant")}
        out = {}
        for device in devices:
            try:
                placed = core.query_model(model, device)
            except RuntimeError as e:
                out[device] = {"queried": False, "reason": _reason(e)}
                continue
            missing = sorted({ops[n] for n in ops if placed.get(n) != device})
            out[device] = {"queried": True, "ops": len(ops), "supported": sum(placed.get(n) == device for n in ops),
                           "unsupported_op_types": missing}
        return out

    def load(self, engine_dir: Path, threads: int | None = None) -> "OvRunner":
        return OvRunner(engine_dir, threads)


