"""`tvm`: Apache TVM (Relax, LLVM CPU codegen) from the FP32 ONNX export. Opt-in: profiles/tvm.yaml,
lockfiles/tvm.txt (apache-tvm, apache-tvm-ffi, and what MetaSchedule imports without declaring it).

Build: ONNX Runtime's BASIC offline pass folds the ONNX first — the exporter writes Pad's pads as a computed
subgraph, which TVM's importer refuses (`Dynamic pads are not supported yet`); the folded graph's outputs are the
same. Relax imports it once per batch bucket (`targets.tvm.buckets`) with that batch static: MetaSchedule tunes
static shapes only (a symbolic batch leaves every conv out of its tasks), and TVM's fusion fails on a batch bound
after import. Each bucket is one shared library, `model.b<N>.so` (`relax.build` for the LLVM target
`{"kind": "llvm", "mcpu": …, "num-cores": threads}`, linked by `export_library` with $CXX or g++); the runner runs
a batch in bucket-sized chunks, largest first (buckets include 1, so every batch size runs). A graph with another
dynamic dimension (P-Net's H×W) or more than one input (the aligner) is refused in one line.

Tuning: `tune@<engine>` (pipeline/stages/tune.py) runs MetaSchedule over every bucket's fused kernels within
`tuning.trials` and stores its JSON database (the best record per kernel) as a DVC artifact, keyed by this target's
fingerprint and the tuning params; compile applies it (kernels without a record keep TVM's default schedule) and
records how many kernels it covered. **A tuned kernel is not trusted**: each best schedule is built and run beside
the kernel's default schedule on the same random arguments, and one that differs (relative max |Δ| > 1e-3) is left
out of the database and listed in the manifest — MetaSchedule found a miscompiling schedule for one of the
embedder's 25 kernels here (a conv fused with a pad: max |Δ| ≈ 1), which would otherwise have shipped. `trials: 0`
is the untuned build: TVM's default CPU schedules are plain loop nests (no conv schedule, and the wheel has no DNNL
backend), ~60× slower than ONNX Runtime here — a measured result, reported, not hidden.

Audit: the imported Relax graph's compute ops (conv2d, matmul, …), each lowered to a kernel TVM generates, are
native; a call TVM hands to a packed or external function (`call_dps_packed`, a BYOC library) is code outside its
codegen: the fallback. Both are read from the lowered module at compile and kept in `tvm.json`, because reading
them back from the `.so` would mean loading it (native code) during an audit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options

META_FILE = "tvm.json"
PRECISIONS = ("fp32",)
COMPUTE = ("relax.nn.conv2d", "relax.nn.conv2d_transpose", "relax.nn.conv1d", "relax.matmul", "relax.nn.linear")
DB_FILES = ("database_workload.json", "database_tuning_record.json")   # MetaSchedule's JSON database
ELF_MAGIC = b"\x7fELF"
TOLERANCE = 1e-3        # a tuned kernel further than this (relative max |Δ|) from its default schedule is dropped


class Tuning(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    trials: Annotated[int, Field(ge=0)] = 0                 # MetaSchedule trials over all kernels; 0 = untuned
    per_iteration: Annotated[int, Field(ge=1)] = 16         # candidates per round (each round starts a build worker)
    cost_model: Literal["xgb", "random"] = "xgb"
    seed: int = 0


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    mcpu: Annotated[str, Field(pattern=r"^[a-z0-9_.-]+$")] = "host"   # LLVM CPU name; host = this machine's
    threads: Annotated[int, Field(ge=1, le=256)] = 2                 # num-cores in the target and at load
    buckets: Annotated[tuple[int, ...], Field(min_length=1)] = (1, 8)
    tuning: Tuning = Tuning()

    @field_validator("buckets")
    @classmethod
    def _buckets(cls, v):
        if len(set(v)) != len(v) or 1 not in v or min(v) < 1:
            raise ValueError("buckets must be distinct positive batch sizes including 1")
        return tuple(sorted(v))


def _cxx() -> str:
    return os.environ.get("CXX") or "g++"


def _llvm_facts() -> dict:
    """LLVM's view of this host (import tvm takes seconds: cached per tvm version and CPU flags)."""
    import tvm

    cg = tvm.target.codegen
    return {"llvm": str(cg.llvm_version_major()), "triple": str(cg.llvm_get_system_triple()),
            "host_cpu": str(cg.llvm_get_system_cpu())}


def _import(source: Path, batch: int):
    """The folded ONNX as Relax with a static batch, ready for the build pipeline."""
    import onnx
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    model = onnx.load(str(source))
    inputs = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    if len(inputs) != 1:
        raise KilnError(f"tvm: {source}: {len(inputs)} graph inputs; this target builds single-input graphs "
                        "(batch buckets split one batch)", "build this graph for another target")
    dims = inputs[0].type.tensor_type.shape.dim
    if any(not d.HasField("dim_value") for d in dims[1:]):
        raise KilnError(f"tvm: {source}: input {inputs[0].name!r} has dynamic dimensions beside the batch "
                        f"({[d.dim_param or d.dim_value for d in dims]}); batch buckets cannot cover them",
                        "build this graph for an ONNX Runtime or OpenVINO target instead")
    shape = [batch, *(d.dim_value for d in dims[1:])]
    mod = from_onnx(model, shape_dict={inputs[0].name: shape}, keep_params_in_input=False)
    return relax.transform.DecomposeOpsForInference()(mod), inputs[0].name, shape


def fold(source: Path, out: Path) -> Path:
    """ORT's BASIC offline optimizer (constant folding, no layout or hardware choices): the computed pads become
    constants TVM's importer accepts."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(out)
    so.intra_op_num_threads = 1
    ort.InferenceSession(str(source), so, providers=["CPUExecutionProvider"])
    return out


def llvm_target(opts: Options):
    import tvm

    mcpu = tvm.target.codegen.llvm_get_system_cpu() if opts.mcpu == "host" else opts.mcpu
    if opts.mcpu != "host" and not tvm.target.codegen.llvm_is_valid_cpu(mcpu, "x86_64"):
        raise KilnError(f"targets.tvm.mcpu: LLVM does not know the CPU {opts.mcpu!r}",
                        "use `host` or a name from `llc -mcpu=help`")
    return tvm.target.Target({"kind": "llvm", "mcpu": str(mcpu), "num-cores": opts.threads})


def target_json(target) -> dict:
    """The LLVM target as plain JSON (what the engine was built for)."""
    out = {}
    for k, v in dict(target.export()).items():
        out[str(k)] = v if isinstance(v, (int, float)) else str(v) if isinstance(v, str) else [str(x) for x in v]
    return dict(sorted(out.items()))


def fused(mod, target):
    """The kernel-level module MetaSchedule tunes and applies its database to (the pipeline compile_relax uses)."""
    import tvm
    from tvm import relax

    with target:
        return tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                         relax.transform.FoldConstant(), relax.transform.FuseOps(),
                                         relax.transform.FuseTIR()])(mod)


def tasks(source: Path, opts: Options, target, workdir: Path) -> list:
    """MetaSchedule's tasks of every bucket's fused module: what a tuning run searches."""
    from tvm.s_tir import meta_schedule as ms

    folded = fold(source, workdir / "folded.onnx")
    found = []
    for b in opts.buckets:
        found += ms.relax_integration.extract_tasks(fused(_import(folded, b)[0], target), target)
    return found


def tune(source: Path, opts: Options, out: Path, workdir: Path) -> tuple[list[Path], dict]:
    """Search schedules for every bucket's kernels within `tuning.trials`; write MetaSchedule's JSON database into
    `out`. Returns its files and what was tuned, for the artifact's manifest."""
    from tvm.s_tir import meta_schedule as ms

    if opts.tuning.trials == 0:
        raise KilnError("tvm: tuning.trials is 0 (untuned): nothing to tune", "set targets.tvm.tuning.trials > 0")
    target = llvm_target(opts)
    found = tasks(source, opts, target, workdir)
    work = workdir / "tuning"
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
        found, str(work), num_threads=opts.threads, seed=opts.tuning.seed)
    # A build worker imports TVM's tensor intrinsics (~17 s on this host), so the default 30 s build timeout
    # fails every candidate: one worker, a generous timeout.
    ms.tune.tune_tasks(
        tasks=contexts, task_weights=weights, work_dir=str(work), max_trials_global=opts.tuning.trials,
        num_trials_per_iter=opts.tuning.per_iteration, cost_model=opts.tuning.cost_model,
        builder=ms.builder.LocalBuilder(max_workers=1, timeout_sec=600),
        runner=ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(number=3, repeat=1)))
    records, rejected = keep_verified(found, work, out, target)
    return [out / n for n in DB_FILES], {"tasks": len(found), "trials": opts.tuning.trials, "records": records,
                                         "rejected": rejected, "target": target_json(target)}


def keep_verified(found: list, searched_dir: Path, out: Path, target) -> tuple[int, list[dict]]:
    """Copy the best record of each kernel from the search's database into `out`, except a schedule whose kernel
    computes differently from its default schedule: (records kept, the rejected kernels)."""
    from tvm.s_tir import meta_schedule as ms

    searched = ms.database.JSONDatabase(*(str(searched_dir / n) for n in DB_FILES), allow_missing=False)
    kept = ms.database.JSONDatabase(*(str(out / n) for n in DB_FILES), allow_missing=True)
    rejected, records = [], 0
    for task in found:
        mod = task.dispatched[0]
        best = searched.get_top_k(searched.commit_workload(mod), 1) if searched.has_workload(mod) else []
        if not best:
            continue                              # not reached within the budget: keeps TVM's default schedule
        sch = searched.query_schedule(mod, target, task.task_name)
        worst = _differs(mod, sch.mod, target)
        if worst > TOLERANCE:
            rejected.append({"kernel": task.task_name, "max_abs_diff": float(f"{worst:.3g}")})
            continue
        r = best[0]
        kept.commit_tuning_record(ms.database.TuningRecord(r.trace, kept.commit_workload(mod), r.run_secs,
                                                           r.target, r.args_info))
        records += 1
    for n in DB_FILES:
        (out / n).touch()                        # an empty database still is one (every record rejected)
    return records, rejected


def _differs(reference, scheduled, target, seed: int = 0) -> float:
    """Largest |Δ| between a kernel's default-schedule build and its tuned build on the same random arguments
    (every buffer compared after the call: DPS kernels write their outputs into the last ones)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    rng = np.random.default_rng(seed)
    infos = ms.arg_info.TensorInfo.from_prim_func(reference["main"])
    args = [rng.uniform(-1, 1, [int(d) for d in i.shape]).astype(str(i.dtype)) for i in infos]
    results = []
    for mod in (reference, scheduled):
        tensors = [tvm.runtime.tensor(a.copy()) for a in args]
        tvm.compile(mod, target=target)["main"](*tensors)
        results.append([t.numpy() for t in tensors])
    return max(float(np.abs(a.astype(np.float64) - b).max() / max(1.0, float(np.abs(a).max())))
               for a, b in zip(*results))


def _ops(mod) -> Counter:
    from tvm import ir, relax

    ops: Counter = Counter()

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, ir.Op):
            ops[e.op.name] += 1
    relax.analysis.post_order_visit(mod["main"], visit)
    return ops


def read_meta(engine_dir: Path) -> dict:
    try:
        return json.loads((engine_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise KilnError(f"{engine_dir / META_FILE}: missing or not JSON", "rebuild the engine (kiln compile <engine>)")


class Tvm:
    name = "tvm"
    runtime = ("tvm",)
    reproducibility = Reproducibility(
        "bit-identical", checked_at_compile=True, bound=1e-6,
        basis="LLVM codegen and the link are deterministic from the ONNX, the target JSON and the tuning database")

    def parse_options(self, raw: dict) -> Options:
        return validate_options(Options, raw, self.name)

    def probe(self) -> Toolchain:
        versions = {p: toolchain.version(p) for p in ("apache-tvm", "apache-tvm-ffi")}
        if "absent" in versions.values():
            missing = [p for p, v in versions.items() if v == "absent"]
            return Toolchain(self.name, False, f"{', '.join(missing)} not installed "
                                               "(bash scripts/setup.sh --profile tvm installs it)")
        cxx = shutil.which(_cxx())
        if cxx is None:
            return Toolchain(self.name, False, f"linker {_cxx()!r} not found (install g++ or set CXX)")
        cxx_version = subprocess.run([cxx, "--version"], capture_output=True, text=True, encoding="utf-8",
                                     errors="replace").stdout.splitlines()[0]
        host = toolchain.cpu()
        llvm = toolchain.cached(["tvm-llvm", *versions.values(), host["machine"], host["isa"]], _llvm_facts)
        # `mcpu: host` compiles for this CPU: LLVM's name for it is a key, as is the ISA the kernels use
        return Toolchain(self.name, True,
                         rebuild_on={**versions, **llvm, "cxx_version": cxx_version, "isa": host["isa"],
                                     "machine": host["machine"]},
                         info={"cpu": host["cpu"], "cxx": cxx})

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        if options.precision not in PRECISIONS:
            raise KilnError(f"{self.name}: precision {options.precision!r} is not built by this target",
                            f"use one of {', '.join(PRECISIONS)}")
        from tvm import relax
        from tvm.s_tir import meta_schedule as ms

        opts: Options = options.options
        target = llvm_target(opts)
        folded = fold(source, workdir / "folded.onnx")
        db = None
        if options.tuning is not None:
            missing = [n for n in DB_FILES if not (options.tuning / n).is_file()]
            if missing:
                raise KilnError(f"{options.tuning}: tuning database incomplete (missing {', '.join(missing)})",
                                "rerun its tune stage (dvc repro)")
            db = ms.database.JSONDatabase(*(str(options.tuning / n) for n in DB_FILES), allow_missing=False)
        files, buckets, kernels, ops, packed = [], {}, {}, Counter(), []
        for b in opts.buckets:
            try:
                mod, input_name, shape = _import(folded, b)
                ops = _ops(mod)
                found = ms.relax_integration.extract_tasks(fused(mod, target), target)
                if db is not None:
                    exe = ms.relax_integration.compile_relax(db, mod, target, params=None)
                    tuned = sum(db.query_tuning_record(t.dispatched[0], target, t.task_name) is not None
                                for t in found)
                else:
                    exe, tuned = relax.build(mod, target=target), 0
            except KilnError:
                raise
            except Exception as e:          # TVM's importer or build refused the graph
                reason = str(e).strip().splitlines()[-1][:300]
                raise KilnError(f"{self.name}: {source}: TVM cannot build batch {b}: {type(e).__name__}: {reason}",
                                "build this graph for another target") from e
            packed += [n for n in ("relax.call_dps_packed", "relax.call_pure_packed") if ops.get(n)]
            path = out / f"model.b{b}.so"
            exe.export_library(str(path), cc=_cxx())
            files.append(path)
            buckets[str(b)] = path.name
            kernels[str(b)] = {"kernels": len(found), "tuned": int(tuned)}
        meta = {"precision": options.precision, "target": target_json(target), "threads": opts.threads,
                "input": input_name, "sample_shape": shape[1:], "buckets": buckets, "kernels": kernels,
                "ops": dict(sorted(ops.items())), "packed_calls": sorted(set(packed)),
                "tuned": options.tuning is not None}
        (out / META_FILE).write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [*files, out / META_FILE]

    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        meta = read_meta(engine_dir)
        ops = meta["ops"]
        native = {op: n for op, n in ops.items() if op in COMPUTE}
        fallback = [{"node": f"{op} {i}", "op": op, "runs_as": "a packed function outside TVM's codegen"}
                    for op in meta["packed_calls"] for i in range(ops.get(op, 0))]
        other = {op: n for op, n in ops.items() if op not in COMPUTE and op not in meta["packed_calls"]}
        return OpSupport(precision, native, fallback, other)

    def manifest_extras(self, engine_dir: Path) -> dict:
        meta = read_meta(engine_dir)
        return {"build": {k: meta[k] for k in ("target", "threads", "buckets", "tuned")},
                "results": {"kernels": meta["kernels"]}}

    def tune(self, source: Path, opts: Options, out: Path, workdir: Path) -> tuple[list[Path], dict]:
        """tune@<engine> (registry `tunes`): the schedule database for `compile` (module-level `tune`)."""
        return tune(source, opts, out, workdir)

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        return True, ""

    def check_package(self, engine_dir: Path) -> None:
        """Before every load: the engine is exactly its metadata's libraries, each an ELF shared object for this
        machine. Loading one runs its native code (constructors, then TVM's kernels): only verified files."""
        meta = read_meta(engine_dir)
        want = {META_FILE, *meta["buckets"].values()}
        for name in meta["buckets"].values():
            if "/" in name or "\\" in name or name.startswith("."):
                raise KilnError(f"{engine_dir / META_FILE}: library name {name!r} escapes the engine directory",
                                "do not load it: rebuild the engine (kiln compile <engine>)")
            head = (engine_dir / name).read_bytes()[:20]
            if head[:4] != ELF_MAGIC or head[16] != 3:                  # ET_DYN
                raise KilnError(f"{engine_dir / name}: not an ELF shared object",
                                "do not load it: rebuild the engine (kiln compile <engine>)")
        extra = {p.name for p in engine_dir.iterdir() if p.suffix == ".so"} - want
        if extra:
            raise KilnError(f"{engine_dir}: libraries not in {META_FILE}: {', '.join(sorted(extra))}",
                            "do not load it: rebuild the engine (kiln compile <engine>)")

    def load(self, engine_dir: Path) -> "TvmRunner":
        return TvmRunner(engine_dir)


def import_runtime():
    """tvm and its Relax VM, without torch: tvm_ffi imports torch eagerly when it is installed (≈ 1 s of a cold
    start) only to convert torch tensors, which the runner never passes. Unless torch is already loaded, it is
    hidden while tvm imports (tvm_ffi catches the ImportError) and visible again afterwards."""
    import sys

    # TVM's pool pins its threads to cores and spins between calls: beside another engine on 2 cores (bench
    # interleaves them; the e2e system runs five) that starved both (ORT FP32 2.3 → 9.7 ms, TVM 15 → 31 ms)
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None          # `import torch` raises ImportError while this is set
    try:
        import tvm
        from tvm import relax
    finally:
        if hide:
            del sys.modules["torch"]
    return tvm, relax


class TvmRunner:
    """One Relax VM per batch bucket; a batch runs in bucket-sized chunks, largest first."""

    def __init__(self, engine_dir: Path) -> None:
        tvm, relax = import_runtime()

        meta = read_meta(engine_dir)
        tvm.get_global_func("runtime.config_threadpool")(1, meta["threads"])
        self.dev = tvm.cpu()
        self.vms = {int(b): relax.VirtualMachine(tvm.runtime.load_module(str(engine_dir / f)), self.dev)
                    for b, f in meta["buckets"].items()}
        self.sizes = sorted(self.vms, reverse=True)
        self.tensor = tvm.runtime.tensor

    def _chunk(self, x: np.ndarray) -> list[np.ndarray]:
        y = self.vms[len(x)]["main"](self.tensor(np.ascontiguousarray(x, np.float32), self.dev))
        outputs = [y] if hasattr(y, "numpy") else list(y)       # one tensor, or a tuple of them (MTCNN nets)
        return [t.numpy() for t in outputs]

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        (x,) = feed.values()
        parts, i = [], 0
        while i < len(x):
            b = next(s for s in self.sizes if s <= len(x) - i)
            parts.append(self._chunk(x[i:i + b]))
            i += b
        return [np.concatenate(outs) for outs in zip(*parts)]

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({"input": batch})[0]
