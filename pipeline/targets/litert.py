"""`litert`: LiteRT (TensorFlow Lite) flatbuffers from the `torch.export` program, FP32 and **full-integer INT8** —
int8 weights, activations, input and output, no float op: the input format of Edge TPU-class compilers. NHWC I/O
for 4-D inputs, as those compilers want. Opt-in: profiles/edge.yaml.

Two environments. The converter (litert-torch, ai-edge-quantizer: lockfiles/litert-convert.txt) pins packages the
main environment cannot hold, so it has its own venv, `.venv-litert` (`bash scripts/setup.sh --profile edge`), and
compile runs pipeline/targets/litert_convert.py with that interpreter, in a fresh process. Validation and bench need
only the small runtime, `ai-edge-litert` (lockfiles/edge.txt), in the main venv.

* fp32 — `litert_torch.convert` at batch 1 with `to_channel_last_io` on the 4-D inputs.
* int8 — that model through ai-edge-quantizer's `static_wi8_ai8` recipe, calibrated on the stored calibration chips
  (`dataset@calibration`, streamed by compile@ as for every program target's int8). The runner quantizes its float
  input with the model's input scale and zero point and dequantizes the outputs, so it takes and returns what every
  other engine does (NCHW float).

Batch: the model is converted at batch 1 (an Edge TPU takes only static shapes); the runner resizes the input to
the batch it is given (`resize_tensor_input`, one interpreter per batch size). Other dynamic dimensions (P-Net's H×W)
are refused in one line.

Audit, from the .tflite's own op list: compute ops (conv, depthwise conv, fully connected, batch matmul) in the
requested precision are native; in an int8 engine every op with a float tensor is a fallback (full-integer means
none). The Edge TPU audit (`results.device_query.edgetpu`) applies the public op table of the Edge TPU compiler
(pipeline/targets/edgetpu_rules.py): the compiler is not reachable here, so these are rules, not a compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets import edgetpu_rules, litert_convert
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options

TFLITE_FILE, OPTIONS_FILE = "model.tflite", "options.json"
PRECISIONS = ("fp32", "int8")
RECIPE = "static_wi8_ai8"
COMPUTE = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL", "TRANSPOSE_CONV", "CONV_3D")
CONVERTER = ("litert-torch", "litert-converter", "ai-edge-quantizer", "ai-edge-litert", "torch", "torchao")
VENV = Path(__file__).resolve().parents[2] / ".venv-litert"


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    threads: Annotated[StrictInt, Field(ge=0, le=256)] = 0      # the interpreter's num_threads; 0 = runtime default


def converter_python() -> Path:
    return Path(os.environ.get("KILN_LITERT_PYTHON", VENV / "bin" / "python"))


def converter_versions() -> dict[str, str]:
    """The converter venv's package versions, read from its metadata without starting it; {} when it is absent."""
    python = converter_python()
    sites = sorted(python.parent.parent.glob("lib/python3*/site-packages"))
    if not python.is_file() or not sites:
        return {}
    found = {d.metadata["Name"].lower(): d.version for d in metadata.distributions(path=[str(s) for s in sites])}
    return {p: found.get(p, "absent") for p in CONVERTER}


def _program_inputs(source: Path) -> list[tuple[str, list]]:
    import torch

    ep = torch.export.load(str(source))
    nodes = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    return [(n.name, list(n.meta["val"].shape)) for n in nodes]


class LiteRT:
    name = "litert"
    runtime = ("ai_edge_litert",)                   # the runner needs the LiteRT runtime only (no torch)
    reproducibility = Reproducibility(
        "bit-identical", checked_at_compile=True, bound=1e-6,
        basis="conversion and full-integer calibration (one thread) are deterministic from the program and chips")

    def parse_options(self, raw: dict) -> Options:
        return validate_options(Options, raw, self.name)

    def probe(self) -> Toolchain:
        runtime = toolchain.version("ai-edge-litert")
        conv = converter_versions()
        if runtime == "absent" or not conv or "absent" in conv.values():
            missing = (["ai-edge-litert (runtime)"] if runtime == "absent" else []) + (
                [f"the converter venv {converter_python().parent.parent}"] if not conv else
                [f"{p} (converter)" for p, v in conv.items() if v == "absent"])
            return Toolchain(self.name, False, f"{', '.join(missing)} not installed "
                                               "(bash scripts/setup.sh --profile edge installs it)")
        host = toolchain.cpu()
        return Toolchain(self.name, True, rebuild_on={**{f"converter.{p}": v for p, v in conv.items()},
                                                      "ai-edge-litert": runtime, "isa": host["isa"],
                                                      "machine": host["machine"]},
                         info={"cpu": host["cpu"]})

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        if options.precision not in PRECISIONS:
            raise KilnError(f"{self.name}: precision {options.precision!r} is not built by this target",
                            f"use one of {', '.join(PRECISIONS)}")
        if options.precision == "int8" and options.calibration is None:
            raise KilnError(f"{self.name}: an int8 engine needs the calibration chips",
                            "compile it through compile@ (it passes dataset@calibration)")
        inputs = _program_inputs(source)
        for name, shape in inputs:
            if dyn := [i for i, s in enumerate(shape) if not isinstance(s, int) and i != 0]:
                raise KilnError(f"{self.name}: input {name} has dynamic non-batch dimensions {tuple(dyn)}",
                                "build this graph for an ONNX target instead (a .tflite has static shapes)")
        channel_last = [i for i, (_, shape) in enumerate(inputs) if len(shape) == 4]
        request = {"program": str(source.resolve()), "out": str((out / TFLITE_FILE).resolve()),
                   "precision": options.precision, "channel_last": channel_last, "recipe": RECIPE,
                   "calibration": None, "scratch": str(workdir.resolve())}
        samples = 0
        if options.precision == "int8":
            parts: list[list[np.ndarray]] = [[] for _ in inputs]
            for feed in options.calibration:
                for i, v in enumerate(feed.values()):
                    parts[i].append(np.ascontiguousarray(v, np.float32))
            arrays = {f"input{i}": np.concatenate(p) for i, p in enumerate(parts)}
            samples = int(arrays["input0"].shape[0]) if parts[0] else 0
            if not samples:
                raise KilnError(f"{self.name}: the calibration set is empty", "rebuild dataset@calibration")
            request["calibration"] = str((workdir / "calibration.npz").resolve())
            np.savez(request["calibration"], **arrays)
        (workdir / "request.json").write_text(json.dumps(request), encoding="utf-8")
        python = converter_python()
        # its own interpreter and nothing of this one's path: the converter venv's packages only
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        r = subprocess.run([str(python), litert_convert.__file__, str((workdir / "request.json").resolve())],
                           capture_output=True, text=True, cwd=workdir,
                           env={**env, "PYTHONHASHSEED": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}, encoding="utf-8",
                           errors="replace")
        if r.returncode != 0 or not (out / TFLITE_FILE).is_file():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise KilnError(f"{self.name}: the converter ({python}) failed on {source}: {last}",
                            "run the request by hand: " + f"{python} {litert_convert.__file__} {workdir}/request.json")
        meta = {"precision": options.precision, "threads": options.options.threads, "channel_last": channel_last,
                "recipe": RECIPE if options.precision == "int8" else None, "calibration_samples": samples,
                "tflite": TFLITE_FILE}
        (out / OPTIONS_FILE).write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [out / TFLITE_FILE, out / OPTIONS_FILE]

    @staticmethod
    def graph(engine_dir: Path):
        """The .tflite's ops (in execution order), its tensors by index, and the signature runner, as the runtime
        reads them (`_get_ops_details` is the runtime's own op listing; there is no public one)."""
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=str(engine_dir / TFLITE_FILE))
        return (interpreter._get_ops_details(), {t["index"]: t for t in interpreter.get_tensor_details()},
                interpreter.get_signature_runner())

    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        ops, tensors, _ = self.graph(engine_dir)
        native, fallback, other = Counter(), [], Counter()
        for op in ops:
            dtypes = {np.dtype(tensors[i]["dtype"]).name for i in [*op["inputs"], *op["outputs"]] if i >= 0}
            in_float = "float32" in dtypes or "float16" in dtypes
            if precision == "int8" and in_float:
                fallback.append({"node": f"op {op['index']}", "op": op["op_name"], "runs_as": "float32"})
            elif op["op_name"] in COMPUTE:
                native[op["op_name"]] += 1
            else:
                other[op["op_name"]] += 1
        return OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))

    def manifest_extras(self, engine_dir: Path) -> dict:
        meta = json.loads((engine_dir / OPTIONS_FILE).read_text(encoding="utf-8"))
        ops, tensors, signature = self.graph(engine_dir)
        io = {"inputs": [], "outputs": []}
        for kind, details in (("inputs", signature.get_input_details()), ("outputs", signature.get_output_details())):
            for name in _ordered(details):
                d = details[name]
                scale, zero = d["quantization"]
                io[kind].append({"shape": [int(s) for s in d["shape_signature"]], "dtype": np.dtype(d["dtype"]).name,
                                 **({"scale": float(scale), "zero_point": int(zero)} if scale else {})})
        return {"build": {k: meta[k] for k in ("channel_last", "recipe", "calibration_samples")} | {"io": io},
                "results": {"device_query": {"edgetpu": edgetpu_rules.audit(
                    ops, tensors, {int(d["index"]) for d in signature.get_input_details().values()})}}}

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        return True, ""

    def check_package(self, engine_dir: Path) -> None:
        """Before every load: the file is a TFLite flatbuffer (identifier `TFL3` at byte 4). The runtime then parses
        and verifies it; loading runs LiteRT's native kernels (XNNPACK) on a verified file."""
        head = (engine_dir / TFLITE_FILE).read_bytes()[:8]
        if len(head) < 8 or head[4:8] != b"TFL3":
            raise KilnError(f"{engine_dir / TFLITE_FILE}: not a TFLite model (no TFL3 flatbuffer identifier)",
                            "do not load it: rebuild the engine (kiln compile <engine>)")

    def load(self, engine_dir: Path) -> "LiteRTRunner":
        return LiteRTRunner(engine_dir)


def _ordered(names) -> list[str]:
    """A signature's input/output names (`args_0`, `output_0`, …) in position order."""
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[-1]))


class LiteRTRunner:
    """A .tflite on the LiteRT runtime through its signature; NCHW float in and out (transposed, and quantized for a
    full-integer model, here); one interpreter per batch size (a resize reallocates every tensor)."""

    def __init__(self, engine_dir: Path) -> None:
        from ai_edge_litert.interpreter import Interpreter

        meta = json.loads((engine_dir / OPTIONS_FILE).read_text(encoding="utf-8"))
        self._make = lambda: Interpreter(model_path=str(engine_dir / TFLITE_FILE),
                                         num_threads=meta["threads"] or None).get_signature_runner()
        self.channel_last = set(meta["channel_last"])
        self._by_batch: dict[int, object] = {}

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        values = list(feed.values())
        batch = int(values[0].shape[0])
        if batch not in self._by_batch:
            self._by_batch[batch] = self._make()
        runner = self._by_batch[batch]
        details = runner.get_input_details()
        args = {}
        for i, (name, v) in enumerate(zip(_ordered(details), values, strict=True)):
            v = np.asarray(v, np.float32)
            if i in self.channel_last:
                v = v.transpose(0, 2, 3, 1)
            scale, zero = details[name]["quantization"]
            if scale:
                info = np.iinfo(details[name]["dtype"])
                v = np.clip(np.round(v / scale) + zero, info.min, info.max)
            args[name] = np.ascontiguousarray(v, details[name]["dtype"])
        result, out = runner(**args), runner.get_output_details()
        outs = []
        for name in _ordered(result):
            scale, zero = out[name]["quantization"]
            y = result[name]
            outs.append((y.astype(np.float32) - zero) * scale if scale else np.array(y))
        return outs

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({"input": batch})[0]
