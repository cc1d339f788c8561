"""`tensorrt-rtx`: a TensorRT-RTX engine, compiled ahead of time **on the CPU** for RTX GPUs. A build-only target.

TensorRT-RTX builds a portable plan without a GPU (its kernels are specialised just in time on the end user's RTX
GPU), for the compute capabilities listed in params (`targets.tensorrt-rtx.compute_capabilities`: SM75, SM80,
SM86, SM89, SM120, SM121 — no Hopper, no datacenter Blackwell). The wheels (`tensorrt-rtx-cu13-libs` +
`-bindings`, module `tensorrt_rtx_bindings`) install from PyPI: `bash scripts/setup.sh --profile rtx`.

* Build: the shared TensorRT path (pipeline/targets/tensorrt.py: prepared ONNX → parser → strongly typed network
  → optimization profiles), plus the compute-capability list; no timing cache (an ahead-of-time build times no
  tactics). The profiles are static batch buckets (`batch_buckets`), one each: a single dynamic min..max profile
  makes the plan's bytes differ on every build (see `plan_for`).
* Audit from the builder itself: the build log at VERBOSE level ends with the engine's layers (one line each, the
  inspector's format, which needs no GPU), so the audit is what the builder made — which layers take int8 / half /
  float inputs — and every disagreement with the static parser rules (pipeline/targets/trt_rules.py) is reported.
* Reproducible: a build is a fraction of a second, so compile@ builds twice (fresh process) and compares bytes.
  A single-output network (the embedder) rebuilds bit-identical. A network with several outputs (R-Net, O-Net) does
  not: the builder orders the output bindings differently from build to build (O-Net, 3 outputs: 6 variants of
  `engine.plan` in 60 builds; one builder thread, ASLR off and one malloc arena each left it varying). Such a rebuild
  passes only as a rearrangement (`accept_rebuild`): the same layer list and build record, and a plan of the same
  length made of the same bytes in another order; the manifest records which of the two it was.
* Build-only: running a plan needs an RTX GPU, a CUDA driver and the same TensorRT-RTX release. Where those are
  missing `runnable()` says why (`Runtime.get_engine_validity`, a header-only check, where a driver exists), and
  validate@ records `not run` instead of a verdict; such a version registers with alias `built`, and promotion
  waits for a passing validation from a host with the runtime (`kiln validate-release`).
"""

from __future__ import annotations

import ctypes.util
import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options
from pipeline.targets.tensorrt import BuildPlan, ParserRejected, TrtRunner, apply_plan, host_platform, parse_network
from pipeline.targets.trt_inspector import inspector_audit, norm_dtype
from pipeline.targets.trt_onnx import PRECISIONS, compute_nodes, onnx_bytes, prepare_onnx

MODULE = "tensorrt_rtx_bindings"
LIBS = "tensorrt-rtx-cu13-libs"
ENGINE_FILE = "engine.plan"
BUILD_FILE = "build.json"
LAYERS_FILE = "layers.json"
CAPABILITIES = ("SM75", "SM80", "SM86", "SM89", "SM120", "SM121")
NOT_PARSED = "the real ONNX parser rejected it"


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    batch_buckets: tuple[Annotated[StrictInt, Field(ge=1)], ...] = (1, 8, 32)
    compute_capabilities: tuple[Literal[CAPABILITIES], ...] = ("SM80", "SM86", "SM89", "SM120")
    builder_optimization_level: Annotated[StrictInt, Field(ge=0, le=5)] = 3
    workspace_mib: Annotated[StrictInt, Field(ge=1)] = 2048

    @field_validator("batch_buckets", "compute_capabilities")
    @classmethod
    def _distinct(cls, v: tuple) -> tuple:
        if not v:
            raise ValueError("must list at least one")
        if len(set(v)) != len(v):
            raise ValueError("must not repeat an entry")
        return v


def plan_for(opts: Options, input_name: str, input_shape: tuple[int, ...]) -> BuildPlan:
    """One static-shape optimization profile per batch bucket. Not one min..max range: with a dynamic range,
    TensorRT-RTX 1.7.1.116 numbers its internal symbols differently on every build (the plan bytes change; measured
    2026-11-30 on R-Net and the embedder), while static buckets build bit-identically. At run time a batch between
    buckets is padded up to the next one (TrtRunner)."""
    shape = tuple(int(d) for d in input_shape)
    profiles = [{input_name: {k: [b, *shape] for k in ("min", "opt", "max")}} for b in sorted(opts.batch_buckets)]
    return BuildPlan(("STRONGLY_TYPED",), (), opts.builder_optimization_level, opts.workspace_mib << 20,
                     "DETAILED", "NONE", profiles, "off")


# ---------------------------------------------------------------------------------------------- the builder's layers


def parse_layer_lines(log: str) -> dict[str, Any]:
    """The engine's layers as the builder logs them (`Layers:` then one `Name: …, LayerType: …` line each) → the
    same summary `inspector_audit` reads: name, type, input / output data types, the ONNX nodes it covers."""
    layers = []
    for line in log.splitlines():
        if not line.startswith("Name: "):
            continue
        name = line[len("Name: "):].split(", LayerType: ", 1)[0]
        kind = re.search(r", LayerType: ([^,]*)", line)
        inputs = re.search(r", Inputs: \[(.*?)\], (?:Constants|Outputs): ", line)
        outputs = re.search(r", Outputs: \[(.*?)\], TacticName: ", line)
        dtypes = (lambda m: [norm_dtype(d) for d in re.findall(r"Datatype: (\w+)", m.group(1))] if m else [])
        layers.append({"name": name, "type": kind.group(1) if kind else "unknown", "inputs": dtypes(inputs),
                       "outputs": dtypes(outputs), "onnx": re.findall(r"\[ONNX Layer: ([^\]]+)\]", line)})
    signature = [[x["name"], x["type"], x["inputs"], x["outputs"]] for x in layers]
    return {"schema": "builder log (one line per layer)", "num_layers": len(layers),
            "layer_types": _count(x["type"] for x in layers),
            "layer_output_precisions": _count(x["outputs"][0] if x["outputs"] else "none" for x in layers),
            "layers": layers,
            "layer_signature": hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()}


def rearranged(a: bytes, b: bytes) -> bool:
    """The same length and the same bytes, counted by value: a reordering, nothing added, dropped or changed."""
    return len(a) == len(b) and bool(np.array_equal(np.bincount(np.frombuffer(a, np.uint8), minlength=256),
                                                    np.bincount(np.frombuffer(b, np.uint8), minlength=256)))


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return dict(sorted(out.items()))


def disagreements(static: dict[str, Any], parsed: bool, builder_audit: OpSupport | None) -> list[str]:
    """Every point where the static parser rules (trt_rules) and the real parser / builder disagree: the parse
    verdict, and each compute node one of them has running outside the requested precision and the other not."""
    out = []
    if static["parses"] and not parsed:
        out.append(f"static rules say it parses; {NOT_PARSED}")
    if not static["parses"] and parsed:
        rules = ", ".join(f"{k} ×{v}" for k, v in static["problem_rules"].items())
        out.append(f"static rules would reject it ({rules}); the real parser took it")
    if builder_audit is not None and parsed:
        s_fb = {f["node"]: f["runs_as"] for f in static["audit"]["fallback"]}
        b_fb = {f["node"]: f["runs_as"] for f in builder_audit.fallback}
        for node in sorted(set(s_fb) - set(b_fb)):
            out.append(f"{node}: static audit expects it in {s_fb[node]}; the builder runs it in "
                       f"{builder_audit.precision}")
        for node in sorted(set(b_fb) - set(s_fb)):
            out.append(f"{node}: static audit expects {builder_audit.precision}; the builder runs it as {b_fb[node]}")
    return out


# ---------------------------------------------------------------------------------------------- the target
class _Capture:
    """A TensorRT-RTX logger keeping every message (the layer list comes at VERBOSE) and the errors."""

    def __init__(self, trt) -> None:
        outer = self

        class Logger(trt.ILogger):
            def __init__(self) -> None:
                trt.ILogger.__init__(self)

            def log(self, severity, msg) -> None:            # a Python ILogger receives every severity
                outer.lines.append(str(msg))
                if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                    outer.errors.append(str(msg))

        self.lines: list[str] = []
        self.errors: list[str] = []
        self.logger = Logger()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _module():
    try:
        import tensorrt_rtx_bindings as trt  # noqa: PLC0415 — optional toolchain, imported only when used
    except ImportError as e:
        raise KilnError(f"tensorrt-rtx: unavailable ({e})",
                        "install the profile: bash scripts/setup.sh --profile rtx") from None
    return trt


class TensorRTRTX:
    name = "tensorrt-rtx"
    runtime = ("tensorrt_rtx_bindings", "torch")
    reproducibility = Reproducibility(
        "numerically-equivalent", checked_at_compile=True, bound=1e-2,
        basis="ahead-of-time CPU build, no timing cache: a single-output network rebuilds bit-identical; a "
              "multi-output one rebuilds with the same layers, its output bindings in another order")

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        """A second build whose files differ: what it still shares with the first, or None (the gate fails)."""
        if differing != [ENGINE_FILE]:
            return None                                  # the layer list or build record differs: not the same build
        if not rearranged((mine / ENGINE_FILE).read_bytes(), (other / ENGINE_FILE).read_bytes()):
            return None
        return (f"same layers and build record; {ENGINE_FILE} holds the same bytes in another order (the builder "
                "orders a multi-output network's bindings differently between builds)")

    def parse_options(self, raw: dict[str, Any]) -> Options:
        return validate_options(Options, raw, self.name)

    def probe(self) -> Toolchain:
        """Versions from package metadata: building needs no GPU, so an installed wheel means available."""
        if importlib.util.find_spec(MODULE) is None:
            return Toolchain(self.name, False, f"no module named '{MODULE}' (bash scripts/setup.sh --profile rtx)")
        version = toolchain.version(LIBS)
        return Toolchain(self.name, True,
                         rebuild_on={"tensorrt_rtx": version, "package": f"{LIBS} {version}",
                                     "bindings": toolchain.version("tensorrt-rtx-cu13-bindings"),
                                     # the ONNX the parser reads is prepared with these (FP16: ORT's converter)
                                     "onnx": toolchain.version("onnx"), "onnxruntime": toolchain.version("onnxruntime"),
                                     "platform": host_platform()},
                         info={"runs_engines_here": self.runnable(None)[1] or "yes"})

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        from pipeline.targets import trt_rules

        opts: Options = options.options
        if options.precision not in PRECISIONS:
            raise KilnError(f"tensorrt-rtx: unknown precision {options.precision!r}", f"use one of {PRECISIONS}")
        model = prepare_onnx(Path(source), options.precision)
        static = trt_rules.audit_model(model, options.precision).summary()
        data = onnx_bytes(model)
        trt = _module()
        log = _Capture(trt)
        try:
            builder, network = parse_network(trt, log.logger, data, str(source), self.name)
        except ParserRejected as e:
            found = disagreements(static, False, None)
            raise ParserRejected(e.message + (f" — and {found[0]}" if found else
                                                   " (the static rules predicted it)"), e.hint) from None
        inp = network.get_input(0)
        plan = plan_for(opts, inp.name, tuple(inp.shape)[1:])
        config = builder.create_builder_config()
        apply_plan(trt, builder, network, config, plan)
        config.num_compute_capabilities = len(opts.compute_capabilities)
        for i, cc in enumerate(opts.compute_capabilities):
            config.set_compute_capability(getattr(trt.ComputeCapability, cc), i)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise KilnError(f"tensorrt-rtx: the build failed: {'; '.join(log.errors[-3:]) or 'no error logged'}",
                            "see the TensorRT-RTX messages above")
        engine_path = out / ENGINE_FILE
        engine_path.write_bytes(bytes(serialized))
        layers = {**parse_layer_lines(log.text), "onnx_compute_nodes": compute_nodes(model)}
        if not layers["num_layers"]:
            raise KilnError("tensorrt-rtx: the builder logged no layer list (it is the audit)",
                            "check the TensorRT-RTX version: the VERBOSE build log must end with `Layers:`")
        audit = inspector_audit(layers, options.precision)
        (out / LAYERS_FILE).write_text(json.dumps(layers, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        build = {"plan": plan.record(), "compute_capabilities": list(opts.compute_capabilities),
                 "tensorrt_rtx": trt.__version__, "onnx_parsed_sha256": hashlib.sha256(data).hexdigest(),
                 "precision_source": {"fp32": "fp32 export", "fp16": "float16 conversion, fp32 I/O",
                                      "int8": "QDQ (explicit quantization)"}[options.precision],
                 "static_audit": {"parses": static["parses"], "problem_rules": static["problem_rules"],
                                  "fallback_nodes": static["audit"]["fallback_nodes"]},
                 "disagreements_with_static_rules": disagreements(static, True, audit)}
        (out / BUILD_FILE).write_text(json.dumps(build, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [engine_path, out / BUILD_FILE, out / LAYERS_FILE]

    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        """The builder's own layer list: which layers take inputs in `precision`, which fell back."""
        return inspector_audit(json.loads((Path(engine_dir) / LAYERS_FILE).read_text(encoding="utf-8")), precision)

    def manifest_extras(self, engine_dir: Path) -> dict[str, Any]:
        build = json.loads((Path(engine_dir) / BUILD_FILE).read_text(encoding="utf-8"))
        layers = json.loads((Path(engine_dir) / LAYERS_FILE).read_text(encoding="utf-8"))
        return {"build": {"plan": build["plan"], "compute_capabilities": build["compute_capabilities"],
                          "onnx_parsed_sha256": build["onnx_parsed_sha256"],
                          "precision_source": build["precision_source"], "build_only": True},
                "results": {"builder_layers": {k: layers[k] for k in ("num_layers", "layer_types",
                                                                      "layer_output_precisions", "layer_signature")},
                            "static_audit": build["static_audit"],
                            "disagreements_with_static_rules": build["disagreements_with_static_rules"]}}

    def check_package(self, engine_dir: Path) -> None:
        """A plan is deserialized by TensorRT-RTX itself after its header check; nothing is extracted."""

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        """Can this host run the engine? Needs the runtime, a CUDA driver and a GPU the plan was built for; with a
        driver present the plan's header is checked (`get_engine_validity`). Returns (ok, why not)."""
        if importlib.util.find_spec(MODULE) is None:
            return False, f"no runtime for {self.name} on this host (no module {MODULE})"
        if ctypes.util.find_library("cuda") is None:
            return False, f"no runtime for {self.name} on this host (no CUDA driver: RTX engines run on RTX GPUs)"
        if engine_dir is None:
            return True, ""
        trt = _module()
        log = _Capture(trt)
        validity, diagnostics = trt.Runtime(log.logger).get_engine_validity((Path(engine_dir) / ENGINE_FILE)
                                                                             .read_bytes())
        if validity == trt.EngineValidity.INVALID:
            return False, f"the plan is not valid on this host (get_engine_validity: diagnostics {diagnostics})"
        return True, ""

    def load(self, engine_dir: Path) -> "TrtRunner":  # pragma: no cover - needs an RTX GPU
        ok, why = self.runnable(engine_dir)
        if not ok:
            raise KilnError(f"{engine_dir}: {why}", "validate it on a host with an RTX GPU: kiln validate-release")
        trt = _module()
        return TrtRunner(Path(engine_dir) / ENGINE_FILE, trt)
