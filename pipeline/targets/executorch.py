"""`executorch-xnnpack`: ExecuTorch with its XNNPACK delegate. The engine is a `.pte` program built from the
`torch.export` program (`artifacts/program/<model>`), not from ONNX. Opt-in: profiles/edge.yaml, lockfiles/edge.txt.

Precisions:

* fp32 — the program lowered with `to_edge_transform_and_lower(…, partitioner=[XnnpackPartitioner()])`.
* int8 — PT2E post-training quantization with the XNNPACK quantizer (symmetric, per-channel weights), observed on
  the stored calibration chips (`dataset@calibration`, the same set calibrate@ reads: compile@ passes the stream in
  `CompileOptions.calibration`), converted, re-exported and lowered the same way.

Batch: memory planning sizes every tensor for the batch's upper bound, and the program's batch is unbounded, so
the program is re-exported with the batch bounded by `max_batch`, traced at that bound. Traced at a small batch (2),
torch's fake convolution, re-run by XNNPACK's channels-last pass, picks its conv backend from the example's batch
and adds the guard `batch < 16`: the plan shrank to batch 15. Compile checks the planned batch is `max_batch`; the
runner cuts a larger batch into pieces. Other dynamic dimensions (P-Net's H×W) are refused in one line.

Audit: the `.pte` itself, deserialized — the execution plan's instructions are delegate calls (XNNPACK subgraphs)
and kernel calls (ops left outside the delegate, run by ExecuTorch's portable CPU kernels: the fallback). A compute
op (convolution, linear, matmul) outside the delegate is a fallback; any other op outside it is listed under
`other` as `outside_delegate.<op>` (the embedder's final mean).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options

PTE_FILE, OPTIONS_FILE = "model.pte", "options.json"
PRECISIONS = ("fp32", "int8")
COMPUTE = ("convolution", "linear", "mm", "addmm", "bmm", "matmul")


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    threads: Annotated[StrictInt, Field(ge=0, le=256)] = 0          # ExecuTorch's threadpool at load; 0 = cores
    max_batch: Annotated[StrictInt, Field(ge=2, le=1024)] = 32      # memory planning's batch bound (1: specialized)
    per_channel: StrictBool = True                                  # int8: per-channel weight scales


def _export_bounded(ep, max_batch: int):
    """Re-export the program with every dynamic axis 0 bounded by `max_batch`, traced at that bound (a smaller
    example lets a fake-tensor guard narrow the bound: see the module doc); refuse other dynamic axes."""
    import torch

    inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    shapes, example = [], []
    for node in inputs:
        shape = node.meta["val"].shape
        dyn = [i for i, s in enumerate(shape) if not isinstance(s, int)]
        if any(i != 0 for i in dyn):
            raise KilnError(f"executorch-xnnpack: input {node.name} has dynamic non-batch dimensions "
                            f"{tuple(i for i in dyn if i != 0)}", "build this graph for an ONNX target instead")
        shapes.append({0: torch.export.Dim(f"batch_{node.name}", min=1, max=max_batch)} if dyn else None)
        example.append(torch.zeros([max_batch if not isinstance(s, int) else s for s in shape]))
    return torch.export.export(ep.module(), tuple(example), dynamic_shapes=tuple(shapes)), tuple(example), tuple(shapes)


class ExecuTorchXnnpack:
    name = "executorch-xnnpack"
    runtime = ("torch", "executorch")          # the runtime bindings take torch tensors (and import torch)
    reproducibility = Reproducibility(
        "bit-identical", checked_at_compile=False, bound=1e-5,
        basis="lowering is deterministic from the program (and the calibration chips for int8); tens of seconds "
              "per build, so `kiln rebuild-check compile@<engine>` proves it in a fresh process on demand")

    def parse_options(self, raw: dict) -> Options:
        return validate_options(Options, raw, self.name)

    def probe(self) -> Toolchain:
        versions = {p: toolchain.version(p) for p in ("executorch", "torch", "torchao")}
        if "absent" in versions.values():
            missing = [p for p, v in versions.items() if v == "absent"]
            return Toolchain(self.name, False, f"{', '.join(missing)} not installed "
                                               "(bash scripts/setup.sh --profile edge installs it)")
        host = toolchain.cpu()
        return Toolchain(self.name, True, rebuild_on={**versions, "isa": host["isa"], "machine": host["machine"]},
                         info={"cpu": host["cpu"]})

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        import torch
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        if options.precision not in PRECISIONS:
            raise KilnError(f"{self.name}: precision {options.precision!r} is not built by this target",
                            f"use one of {', '.join(PRECISIONS)}")
        opts: Options = options.options
        if options.precision == "int8" and options.calibration is None:
            raise KilnError(f"{self.name}: an int8 engine needs the calibration chips",
                            "compile it through compile@ (it passes dataset@calibration)")
        ep, example, shapes = _export_bounded(torch.export.load(str(source)), opts.max_batch)
        calibrated = 0
        if options.precision == "int8":
            from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
                XNNPACKQuantizer, get_symmetric_quantization_config)
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

            config = get_symmetric_quantization_config(is_per_channel=opts.per_channel)
            quantizer = XNNPACKQuantizer().set_global(config)
            observed = prepare_pt2e(ep.module(), quantizer)
            with torch.no_grad():
                for feed in options.calibration:
                    observed(*(torch.from_numpy(np.ascontiguousarray(v, np.float32)) for v in feed.values()))
                    calibrated += int(next(iter(feed.values())).shape[0])
            if not calibrated:
                raise KilnError(f"{self.name}: the calibration set is empty", "rebuild dataset@calibration")
            ep = torch.export.export(convert_pt2e(observed), example, dynamic_shapes=shapes)
        program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        (out / PTE_FILE).write_bytes(program.buffer)
        planned = self.plan(out)["planned_batch"]
        if any(shapes) and planned != opts.max_batch:
            raise KilnError(f"{self.name}: memory planning sized the input for batch {planned}, not max_batch "
                            f"{opts.max_batch} (an export guard narrowed the bound)",
                            "report it with the ExecuTorch version; a smaller max_batch may avoid the guard")
        meta = {"precision": options.precision, "threads": opts.threads, "max_batch": opts.max_batch,
                "per_channel": opts.per_channel, "calibration_samples": calibrated, "pte": PTE_FILE}
        (out / OPTIONS_FILE).write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [out / PTE_FILE, out / OPTIONS_FILE]

    @staticmethod
    def plan(engine_dir: Path) -> dict:
        """The .pte's execution plan: delegate calls (backend ids) and kernel calls (op names) in order."""
        from executorch.exir._serialize._program import deserialize_pte_binary

        program = deserialize_pte_binary((engine_dir / PTE_FILE).read_bytes()).program
        plan = program.execution_plan[0]
        ops = [f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators]
        calls = []
        for chain in plan.chains:
            for ins in chain.instructions:
                args = ins.instr_args
                kind = type(args).__name__
                if kind == "DelegateCall":
                    calls.append({"delegate": plan.delegates[args.delegate_index].id})
                elif kind == "KernelCall":
                    calls.append({"kernel": ops[args.op_index]})
        first = plan.values[plan.inputs[0]].val          # the first input as memory planning sized it
        return {"method": plan.name, "calls": calls, "planned_batch": int(first.sizes[0])}

    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        native, fallback, other = Counter(), [], Counter()
        for i, call in enumerate(self.plan(engine_dir)["calls"]):
            if "delegate" in call:
                native[f"delegate.{call['delegate']}"] += 1
                continue
            op = call["kernel"].split("::")[-1].split(".")[0]
            if op in COMPUTE:
                fallback.append({"node": f"instruction {i}", "op": call["kernel"], "runs_as": "portable kernel"})
            else:
                other[f"outside_delegate.{call['kernel']}"] += 1
        return OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))

    def manifest_extras(self, engine_dir: Path) -> dict:
        meta = json.loads((engine_dir / OPTIONS_FILE).read_text(encoding="utf-8"))
        plan = self.plan(engine_dir)
        return {"build": {"max_batch": meta["max_batch"], "planned_batch": plan.pop("planned_batch"),
                          "calibration_samples": meta["calibration_samples"]},
                "results": {"execution_plan": plan}}

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        return True, ""

    def check_package(self, engine_dir: Path) -> None:
        """Before every load, cheaply (the full deserializer in `plan` imports ExecuTorch's compiler, ≈ 2 s): the file
        is an ExecuTorch flatbuffer (identifier `ET..` at byte 4). The runtime then loads it with its
        InternalConsistency verification and no data file (`data_path` unset), so the engine can open no other file."""
        head = (engine_dir / PTE_FILE).read_bytes()[:8]
        if len(head) < 8 or not re.fullmatch(rb"ET[0-9]{2}", head[4:8]):
            raise KilnError(f"{engine_dir / PTE_FILE}: not an ExecuTorch program (no ET flatbuffer identifier)",
                            "do not load it: rebuild the engine (kiln compile <engine>)")

    def load(self, engine_dir: Path) -> "EtRunner":
        return EtRunner(engine_dir)


def runtime_bindings():
    """ExecuTorch's C++ runtime bindings (`portable_lib`) without its compiler. portable_lib imports
    `executorch.exir._warnings` for one warning class, and that import first runs `executorch/exir/__init__.py`: the
    whole compiler stack, torch._dynamo, torch._inductor and torchao (2.2 s of a 2.8 s cold start here). Where exir is
    not loaded yet, `_warnings` (standalone: typing_extensions only) is loaded from its file under a placeholder
    parent that is removed again, so a later `import executorch.exir` in the same process (compile) is the real one."""
    import sys

    if "executorch.exir" not in sys.modules and "executorch.extension.pybindings.portable_lib" not in sys.modules:
        import importlib.util
        import types

        import executorch

        spec = importlib.util.spec_from_file_location(
            "executorch.exir._warnings", Path(executorch.__path__[0]) / "exir" / "_warnings.py")
        warnings_module = importlib.util.module_from_spec(spec)
        parent = types.ModuleType("executorch.exir")
        parent.__path__, parent._warnings = [], warnings_module
        sys.modules.update({"executorch.exir": parent, "executorch.exir._warnings": warnings_module})
        try:
            spec.loader.exec_module(warnings_module)
            from executorch.extension.pybindings import portable_lib
        finally:
            del sys.modules["executorch.exir"], sys.modules["executorch.exir._warnings"]
        return portable_lib
    from executorch.extension.pybindings import portable_lib

    return portable_lib


class EtRunner:
    """Runner over a .pte: its `forward` through ExecuTorch's runtime bindings; batches above the plan run in pieces."""

    def __init__(self, engine_dir: Path) -> None:
        import torch

        lib = runtime_bindings()
        self._torch = torch
        threads = int(json.loads((engine_dir / OPTIONS_FILE).read_text(encoding="utf-8")).get("threads", 0))
        if threads:     # process-wide, like torch.set_num_threads for aoti-cpu
            lib._unsafe_reset_threadpool(threads)
        self.module = lib._load_for_executorch(str(engine_dir / PTE_FILE), data_path=None,
                                               program_verification=lib.Verification.InternalConsistency)
        # the batch memory planning sized the inputs for (compile checked it is max_batch)
        self.max_batch = int(self.module.method_meta("forward").input_tensor_meta(0).sizes()[0])

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        values = [np.ascontiguousarray(v, np.float32) for v in feed.values()]
        n = values[0].shape[0]
        pieces = []
        for start in range(0, n, self.max_batch):
            part = [self._torch.from_numpy(v[start:start + self.max_batch] if v.shape[0] == n else v) for v in values]
            pieces.append([t.numpy().copy() for t in self.module.forward(tuple(part))])
        return [np.concatenate([p[i] for p in pieces]) for i in range(len(pieces[0]))]

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({"input": batch})[0]
