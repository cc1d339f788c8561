"""`tensorrt`: a TensorRT engine (plan) built from the ONNX parser into a strongly typed network. GPU only.

One build path for TensorRT 10.12+ and 11.x: `STRONGLY_TYPED` when the flag exists (required
on 10.x, a no-op on 11.x), never `EXPLICIT_BATCH` and never a precision flag (`FP16`/`INT8` are gone in 11). The
precision is what the ONNX carries:

* fp32 — the FP32 export as is;
* fp16 — the FP32 export converted here by `onnxruntime.transformers.float16` with **FP32 inputs and outputs kept**
  (`keep_io_types=True`, what ModelOpt AutoCast's `keep_io_types=True` does): the runner, validate and bench feed
  and read float32 like every other engine, and TensorRT fuses the boundary casts into the first/last layer;
* int8 — the `symmetric` QDQ recipe (zero points 0, S8 activations, float biases), which TensorRT requires.

Dynamic batch: one optimization profile (min/opt/max from params.yaml `targets.tensorrt.profile`) on the input's
batch dimension, which `prepare_onnx` makes symbolic if the export fixed it.

Timing cache: one file per (TensorRT version, compute capability, GPU) under `timing_cache.dir` (default
`artifacts/cache/tensorrt/`), loaded before and saved after every build. It is a *build accelerator, not an
identity input*, so it is deliberately not a DVC out or dep: compile@<engine> is a foreach stage and every engine
would have to own the same file (DVC forbids overlapping outs), and as a dep it would change after each build and
make the stage always stale. It is git-ignored (under artifacts/), never mixed across TRT versions or GPUs (the key
is in its name), and each engine manifest records its sha256 before and after the build. `mode: strict` builds with
`ERROR_ON_TIMING_CACHE_MISS` for "same tactics as last time"; `off` disables it.

Engines are not byte-reproducible (tactic timing, `nvrtc_prog_<address>` names). Equivalence is the
inspector's layer list (name, type, precisions) plus the validate stage's golden gate; the manifest says so.

An engine is bound to the exact TensorRT version, compute capability, GPU, driver, CUDA and platform:
all of them are `probe().rebuild_on` (so DVC rebuilds on any change) and `check_loadable` refuses to deserialize an
engine whose manifest differs from this host — rebuild, never load.

Everything that imports `tensorrt`, `torch.cuda` or `cuda.bindings` is inside a function; the pure logic (options →
build plan, fingerprint, load decision, ONNX preparation, inspector parsing) is tested without TensorRT. The ONNX
preparation and static audit live in trt_onnx, the inspector parsing in trt_inspector (neither imports TensorRT).
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain
from pipeline.targets.trt_inspector import inspector_audit, norm_dtype, parse_inspector
from pipeline.targets.trt_onnx import PRECISIONS, onnx_bytes, prepare_onnx, static_audit
from pipeline.targets.trt_options import HW_LEVELS, TrtOptions

ENGINE_FILE = "engine.plan"
BUILD_FILE = "build.json"
INSPECTOR_FILE = "inspector.json"
EQUIVALENCE = ("engines are not byte-reproducible (TensorRT tactic timing and generated kernel names); two builds "
               "are equivalent when their inspector layer lists (name, type, input/output precisions; "
               "results.inspector.layer_signature) are equal and both pass the validate stage's golden gate")
FINGERPRINT_KEYS = ("tensorrt", "tensorrt_package", "compute_capability", "gpu_name", "driver", "cuda", "platform")


@dataclass(frozen=True)
class BuildPlan:
    """Everything the builder is told, as names — applied to the real API by `apply_plan`, recorded in build.json."""
    network_flags: tuple[str, ...]
    builder_flags: tuple[str, ...]
    builder_optimization_level: int
    workspace_bytes: int
    profiling_verbosity: str
    hardware_compatibility_level: str
    profiles: list[dict[str, dict[str, list[int]]]]   # one per optimization profile: input → {min, opt, max} shapes
    timing_cache_mode: str

    def record(self) -> dict[str, Any]:
        return asdict(self)


def build_plan(opts: TrtOptions, input_name: str, input_shape: tuple[int, ...]) -> BuildPlan:
    """Options + the model's per-sample input shape (C, H, W) → builder settings. No precision flag, ever."""
    flags = []
    if opts.version_compatible:
        flags.append("VERSION_COMPATIBLE")
    if opts.timing_cache_mode == "strict":
        flags.append("ERROR_ON_TIMING_CACHE_MISS")
    elif opts.timing_cache_mode == "off":
        flags.append("DISABLE_TIMING_CACHE")
    shape = tuple(int(d) for d in input_shape)
    profiles = [{input_name: {"min": [opts.min_batch, *shape], "opt": [opts.opt_batch, *shape],
                              "max": [opts.max_batch, *shape]}}]
    return BuildPlan(("STRONGLY_TYPED",), tuple(flags), opts.builder_optimization_level, opts.workspace_mib << 20,
                     "DETAILED", HW_LEVELS[opts.hardware_compatibility], profiles, opts.timing_cache_mode)


def apply_plan(trt, builder, network, config, plan: BuildPlan) -> None:  # pragma: no cover - needs TensorRT + GPU
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    config.builder_optimization_level = plan.builder_optimization_level
    config.profiling_verbosity = getattr(trt.ProfilingVerbosity, plan.profiling_verbosity)
    config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel, plan.hardware_compatibility_level)
    for f in plan.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, f))
    for profile in plan.profiles:
        prof = builder.create_optimization_profile()
        for name, s in profile.items():
            prof.set_shape(name, tuple(s["min"]), tuple(s["opt"]), tuple(s["max"]))
        config.add_optimization_profile(prof)


def network_flags(trt) -> int:
    """STRONGLY_TYPED where the enum has it (10.x required, 11.x ignored); never EXPLICIT_BATCH (gone in 11)."""
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return flags


class ParserRejected(KilnError):
    """The real TensorRT(-RTX) ONNX parser rejected the graph."""


def parse_network(trt, logger, data: bytes, label: str, target: str):
    """The ONNX parser into a strongly typed network: (builder, network), or a KilnError naming the nodes it
    rejected. Shared by every TensorRT-family target (the APIs agree here)."""
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(data, label):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        raise ParserRejected(f"{target}: the ONNX parser rejected {label}: " + "; ".join(
            f"node {e.node()} {e.node_name()} ({e.node_operator()}): {e.desc()}" for e in errors[:5]),
            "see pipeline/targets/trt_rules.py for the rules the static audit checks")
    if network.num_inputs != 1:
        raise KilnError(f"{target}: {label} has {network.num_inputs} inputs; this target builds one profile over "
                        "the batch of a single input", "compile multi-input graphs (the aligner) with ort-cpu")
    dims = tuple(network.get_input(0).shape)[1:]
    if any(d < 0 for d in dims):
        raise KilnError(f"{target}: {label} has dynamic non-batch dimensions {dims}; this target's profile spans "
                        "the batch only", "compile graphs with dynamic H×W (P-Net) with ort-cpu or aoti-cpu")
    return builder, network


# ---------------------------------------------------------------------------------------------- fingerprint
def make_fingerprint(trt_version: str, trt_package: str, compute_capability: str, gpu_name: str, driver: str,
                     cuda: str, plat: str | None = None) -> dict[str, str]:
    """The portability fingerprint: an engine is only loadable where every field is equal."""
    return {"tensorrt": trt_version, "tensorrt_package": trt_package, "compute_capability": compute_capability,
            "gpu_name": gpu_name, "driver": driver, "cuda": cuda, "platform": plat or host_platform()}


def host_platform() -> str:
    libc = "-".join(platform.libc_ver()) if sys.platform.startswith("linux") else ""
    return f"{sys.platform}-{platform.machine()}" + (f"-{libc}" if libc.strip("-") else "")


@dataclass(frozen=True)
class LoadDecision:
    loadable: bool
    reasons: list[str] = field(default_factory=list)   # why it must be rebuilt (empty when loadable)

    def __bool__(self) -> bool:
        return self.loadable


def _major(v: str) -> str:
    return str(v).split(".")[0]


def _ver(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", str(v))[:4])


def check_loadable(engine_manifest: dict[str, Any], current: dict[str, Any]) -> LoadDecision:
    """Rebuild decision: may this host deserialize the engine, or must it rebuild it from the ONNX?

    `engine_manifest` is the engine's manifest (its `toolchain` holds the build host's fingerprint, `build.options`
    the compatibility options); `current` is this host's fingerprint (probe().rebuild_on, or the toolchain YAML).
    Strict by default: any differing field means rebuild (NVIDIA/TensorRT#564 compute capability, InsightFace-REST#84
    version, #3911 driver). Only the two documented relaxations apply, and only if the engine was built for them:
    `version_compatible` (runtime TensorRT ≥ build, same major — or 10 → 11) and `hardware_compatibility`
    (`ampere_plus`: both CC ≥ 8.0; the GPU name may then differ too).
    """
    if current.get("available") is False:
        return LoadDecision(False, [f"tensorrt unavailable here ({current.get('reason', 'unknown')})"])
    now = current.get("rebuild_on", current)
    chain = engine_manifest.get("toolchain", {})
    built = chain.get("target.tensorrt", chain)        # stage manifests keep a target's keys under target.<name>
    options = (engine_manifest.get("build") or {}).get("options") or {}
    vc = bool(options.get("version_compatible", False))
    hw = options.get("hardware_compatibility", "none")
    reasons = []
    for key in FINGERPRINT_KEYS:
        a, b = built.get(key), now.get(key)
        if a is None:
            reasons.append(f"{key}: not recorded in the engine manifest")
            continue
        if a == b:
            continue
        if key == "tensorrt" and vc and b is not None and _ver(b) >= _ver(a) and (
                _major(a) == _major(b) or (_major(a), _major(b)) == ("10", "11")):
            continue
        if key == "tensorrt_package" and vc:
            continue
        if key == "compute_capability" and hw == "ampere_plus" and b is not None and \
                _ver(a) >= (8, 0) and _ver(b) >= (8, 0):
            continue
        if key == "gpu_name" and hw in ("ampere_plus", "same_compute_capability"):
            continue
        reasons.append(f"{key}: built with {a!r}, this host has {b!r}")
    return LoadDecision(not reasons, reasons)


# ---------------------------------------------------------------------------------------------- the target
def _status() -> tuple[Any, str]:
    """(tensorrt module, "") when TensorRT imports and CUDA initialises, else (None, one-line reason)."""
    try:
        import tensorrt as trt
    except Exception as e:  # noqa: BLE001 — ModuleNotFoundError, or ImportError: libnvinfer.so.N missing
        return None, str(e).splitlines()[0].lower() if isinstance(e, ModuleNotFoundError) else \
            f"tensorrt not importable: {str(e).splitlines()[0]}"
    try:
        trt.Builder(trt.Logger(trt.Logger.ERROR))
    except TypeError as e:  # "factory function returned nullptr": no driver / no device
        return None, f"TensorRT cannot initialise CUDA: {e}"
    return trt, ""


def _device_fingerprint(trt) -> dict[str, str]:  # pragma: no cover - needs a GPU
    """CC, GPU name, driver and CUDA via torch, else cuda-python (no PyCUDA)."""
    from importlib import metadata

    pkg = "unknown"
    for dist in ("tensorrt-cu13-libs", "tensorrt-cu12-libs", "tensorrt-libs", "tensorrt"):
        try:
            pkg = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("no CUDA device visible to torch")
        major, minor = torch.cuda.get_device_capability(0)
        name, cuda = torch.cuda.get_device_name(0), str(torch.version.cuda)
        from cuda.bindings import runtime as cudart  # driver version: torch does not expose it
        driver = str(cudart.cudaDriverGetVersion()[1])
    except ImportError:
        from cuda.bindings import runtime as cudart

        err, props = cudart.cudaGetDeviceProperties(0)
        if err != cudart.cudaError_t.cudaSuccess:
            raise KilnError(f"tensorrt: no usable CUDA device ({err})", "build TensorRT engines on a GPU host")
        major, minor = props.major, props.minor
        name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
        driver = str(cudart.cudaDriverGetVersion()[1])
        cuda = str(cudart.cudaRuntimeGetVersion()[1])
    return make_fingerprint(trt.__version__, pkg, f"{major}.{minor}", name, driver, cuda)


class TensorRT:
    name = "tensorrt"
    runtime = ("tensorrt", "torch")      # the runner's device buffers are torch CUDA tensors
    # compiles artifacts/export (fp32, fp16) or artifacts/quantized/<model>-symmetric (int8)
    reproducibility = Reproducibility("task-equivalent", checked_at_compile=False, bound=1e-2, basis=EQUIVALENCE)

    def check_package(self, engine_dir: Path) -> None:
        """A serialized plan is deserialized by TensorRT itself (check_loadable first); nothing is extracted."""

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None   # not checked at compile; `kiln rebuild-check` classifies the difference

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        tc = self.probe()
        return tc.available, "" if tc.available else f"no runtime for {self.name} on this host ({tc.reason})"

    def parse_options(self, raw: dict[str, Any]) -> "TrtOptions":
        return TrtOptions.parse(raw)

    def probe(self) -> Toolchain:
        trt, reason = _status()
        if trt is None:
            return Toolchain(self.name, False, reason)
        try:
            fp = _device_fingerprint(trt)
        except (ImportError, KilnError) as e:
            return Toolchain(self.name, False, f"no CUDA device: {getattr(e, 'message', e)}")
        from pipeline import toolchain

        return Toolchain(self.name, True, rebuild_on=fp, info=toolchain.versions("onnx", "onnxruntime"))

    # -- audit: the inspector of a built engine, else (no TensorRT here / no engine) the static rules
    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        p = Path(engine_dir)
        if p.is_dir() and (p / INSPECTOR_FILE).is_file():
            return inspector_audit(json.loads((p / INSPECTOR_FILE).read_text(encoding="utf-8")), precision)
        onnx_path = p if p.suffix == ".onnx" else p / "model.onnx"
        if not onnx_path.is_file():
            raise KilnError(f"{p}: neither a built TensorRT engine ({INSPECTOR_FILE}) nor an ONNX to audit statically",
                            "pass the engine directory or the ONNX the engine is built from")
        return static_audit(onnx_path, precision).support

    def compile(self, onnx: Path, options: CompileOptions, out: Path,
                workdir: Path) -> list[Path]:  # pragma: no cover - GPU
        opts = options.options
        model = prepare_onnx(Path(onnx), options.precision)
        from pipeline.targets import trt_rules

        static = trt_rules.audit_model(model, options.precision)
        if not static.parses:                       # fail before touching the GPU, with the node names
            raise KilnError(f"tensorrt: {onnx} would not parse: " + "; ".join(
                f"{p.node} ({p.op}): {p.detail}" for p in static.problems[:5]),
                "use the `symmetric` quantization recipe for TensorRT INT8")
        data = onnx_bytes(model)
        trt, reason = _status()
        if trt is None:
            raise KilnError(f"tensorrt: unavailable ({reason})", "build TensorRT engines on a GPU host")
        fp = _device_fingerprint(trt)
        logger = trt.Logger(trt.Logger.WARNING)
        builder, network = parse_network(trt, logger, data, str(onnx), self.name)
        inp = network.get_input(0)
        plan = build_plan(opts, inp.name, tuple(inp.shape)[1:])
        config = builder.create_builder_config()
        apply_plan(trt, builder, network, config, plan)
        cache_dir = Path(opts.timing_cache_dir)     # relative: to the project root, where stages run
        key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"trt{fp['tensorrt']}-sm{fp['compute_capability']}-{fp['gpu_name']}")
        cache_file = cache_dir / f"{key}.timing"
        old = cache_file.read_bytes() if opts.timing_cache_mode != "off" and cache_file.is_file() else b""
        cache = config.create_timing_cache(old)
        config.set_timing_cache(cache, ignore_mismatch=False)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise KilnError("tensorrt: build failed (see the TensorRT log above)",
                            "with timing_cache.mode: strict a cache miss fails the build; use reuse")
        engine_path = out / ENGINE_FILE
        engine_path.write_bytes(bytes(serialized))
        new = bytes(cache.serialize())
        if opts.timing_cache_mode != "off":
            from pipeline.manifest import write_bytes_atomic

            write_bytes_atomic(cache_file, new)
        engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(serialized))
        insp = engine.create_engine_inspector()
        summary = parse_inspector(json.loads(insp.get_engine_information(trt.LayerInformationFormat.JSON)),
                                  [insp.get_layer_information(i, trt.LayerInformationFormat.JSON)
                                   for i in range(engine.num_layers)])
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        summary["io_tensors"] = [{"name": n, "mode": str(engine.get_tensor_mode(n)).split(".")[-1].lower(),
                                  "dtype": norm_dtype(str(engine.get_tensor_dtype(n))),
                                  "shape": list(engine.get_tensor_shape(n))} for n in names]
        (out / INSPECTOR_FILE).write_text(json.dumps(summary, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        build = {"plan": plan.record(), "tensorrt": trt.__version__, "onnx_parsed_sha256": hashlib.sha256(data)
                 .hexdigest(), "precision_source": {"fp32": "fp32 export", "fp16": "float16 conversion, fp32 I/O",
                                                    "int8": "QDQ (explicit quantization)"}[options.precision],
                 "deterministic": False, "equivalence": EQUIVALENCE,
                 "timing_cache": {"file": cache_file.name, "mode": opts.timing_cache_mode,
                                  "sha256_before": hashlib.sha256(old).hexdigest() if old else None,
                                  "sha256_after": hashlib.sha256(new).hexdigest()},
                 "static_audit": static.summary()["problem_rules"]}
        (out / BUILD_FILE).write_text(json.dumps(build, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [engine_path, out / BUILD_FILE, out / INSPECTOR_FILE]

    def manifest_extras(self, engine_dir: Path) -> dict[str, Any]:
        """What compile.py merges into the engine manifest: build record + inspector summary."""
        build = json.loads((Path(engine_dir) / BUILD_FILE).read_text(encoding="utf-8"))
        insp = json.loads((Path(engine_dir) / INSPECTOR_FILE).read_text(encoding="utf-8"))
        return {"build": {"equivalence": EQUIVALENCE,
                          "builder_optimization_level": build["plan"]["builder_optimization_level"],
                          "plan": build["plan"], "onnx_parsed_sha256": build["onnx_parsed_sha256"],
                          "precision_source": build["precision_source"]},
                "results": {"inspector": {k: insp[k] for k in ("schema", "num_layers", "layer_types",
                                                                 "layer_output_precisions", "io_tensors",
                                                                 "layer_signature")},
                            "timing_cache": build["timing_cache"]}}

    def load(self, engine_dir: Path) -> "TrtRunner":  # pragma: no cover - needs TensorRT + GPU
        from pipeline.manifest import find_manifests, read_manifest

        manifests = find_manifests(Path(engine_dir))
        if not manifests:
            raise KilnError(f"{engine_dir}: no engine manifest", "rebuild it (kiln compile <engine>, or dvc repro)")
        decision = check_loadable(read_manifest(manifests[0]), self.probe().__dict__)
        if not decision:
            raise KilnError(f"{engine_dir}: engine not loadable on this host: " + "; ".join(decision.reasons),
                            "rebuild it here from the ONNX (dvc repro), never load a mismatched plan")
        return TrtRunner(Path(engine_dir) / ENGINE_FILE)


def pick_profile(ranges: list[tuple[int, int]], batch: int) -> tuple[int, int]:
    """(profile index, batch to run) for `batch` over profiles' (min, max) batch ranges: the first range holding it,
    else the smallest bucket above it (the caller pads the batch up and drops the padding's outputs)."""
    for i, (lo, hi) in enumerate(ranges):
        if lo <= batch <= hi:
            return i, batch
    above = [(lo, i) for i, (lo, hi) in enumerate(ranges) if lo >= batch]
    if not above:
        raise KilnError(f"batch {batch} is above every optimization profile of the engine "
                        f"(max {max(hi for _, hi in ranges)})", "split the batch, or rebuild with a larger bucket")
    lo, i = min(above)
    return i, lo


class TrtRunner:  # pragma: no cover - needs TensorRT + GPU
    """execute_async_v3 over a deserialized engine, with torch CUDA tensors; no PyCUDA. An engine with several
    optimization profiles (static batch buckets) runs each batch in the profile that holds it, padded up to the
    next bucket where none does."""

    def __init__(self, engine_path: Path, trt=None) -> None:
        import torch

        if trt is None:
            import tensorrt as trt

        self.trt, self.torch = trt, torch
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise KilnError(f"{engine_path}: deserialize failed (TensorRT version / GPU mismatch?)", "rebuild it")
        self.ctx = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int8: torch.int8,
                       trt.int32: torch.int32, trt.int64: torch.int64, trt.bool: torch.bool}
        self.stream = torch.cuda.Stream()
        first = self.inputs[0]
        self.ranges = [(int(mn[0]), int(mx[0])) for mn, _, mx in
                       (self.engine.get_tensor_profile_shape(first, i)
                        for i in range(self.engine.num_optimization_profiles))]
        self.profile = 0

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({self.inputs[0]: batch})[0]

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Named inputs (in the engine's input order when names differ) → every output, in binding order."""
        torch, eng, ctx = self.torch, self.engine, self.ctx
        if set(feed) != set(self.inputs):
            feed = dict(zip(self.inputs, feed.values()))
        n = len(next(iter(feed.values())))
        profile, padded = pick_profile(self.ranges, n)
        if profile != self.profile:
            ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
            self.profile = profile
        keep = []
        for name in self.inputs:
            a = np.ascontiguousarray(feed[name])
            if padded > n:
                a = np.concatenate([a, np.zeros((padded - n, *a.shape[1:]), a.dtype)])
            x = torch.from_numpy(a).to("cuda", self.dtypes[eng.get_tensor_dtype(name)])
            ctx.set_input_shape(name, tuple(x.shape))
            ctx.set_tensor_address(name, x.data_ptr())
            keep.append(x)
        outs = {}
        for n in self.outputs:
            t = torch.empty(tuple(ctx.get_tensor_shape(n)), dtype=self.dtypes[eng.get_tensor_dtype(n)], device="cuda")
            ctx.set_tensor_address(n, t.data_ptr())
            outs[n] = t
        self.stream.wait_stream(torch.cuda.current_stream())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT enqueue failed")
        self.stream.synchronize()
        return [outs[name].float().cpu().numpy()[:n] for name in self.outputs]
