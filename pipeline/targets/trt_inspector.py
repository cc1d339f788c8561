"""TensorRT engine-inspector parsing, with no TensorRT: the inspector JSON (10.x or 11.x schema) → the manifest's
layer / precision summary (`parse_inspector`), and which compute work of a built engine runs in a precision
(`inspector_audit`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import Any

from pipeline.targets.base import OpSupport


# ---------------------------------------------------------------------------------------------- inspector JSON
_DTYPE_TOKENS = [("fp32", "float32"), ("float", "float32"), ("fp16", "float16"), ("half", "float16"),
                 ("bf16", "bfloat16"), ("int8", "int8"), ("fp8", "fp8"), ("int4", "int4"), ("fp4", "fp4"),
                 ("int32", "int32"), ("int64", "int64"), ("uint8", "uint8"), ("bool", "bool")]


def norm_dtype(text: str | None) -> str:
    """'Row major linear FP32', 'Channel major FP16 format where channel % 8 == 0', 'Int8', 'kHALF' → canonical."""
    if not text:
        return "unknown"
    words = re.findall(r"[a-z0-9]+", str(text).lower().replace("datatype.", ""))
    for w in reversed(words):       # the datatype comes last in 10.x "Format/Datatype" strings
        w = w[1:] if w.startswith("k") and w[1:] in dict(_DTYPE_TOKENS) else w
        for token, name in _DTYPE_TOKENS:
            if w == token:
                return name
    return "unknown"


def _tensor(t: Any) -> dict[str, Any]:
    if isinstance(t, str):
        return {"name": t, "dtype": "unknown", "format": ""}
    if "DataType" in t:                                   # 11.x: Format and DataType are separate fields
        return {"name": t.get("Name", ""), "dtype": norm_dtype(t["DataType"]), "format": t.get("Format", "")}
    fd = t.get("Format/Datatype", "")                     # 10.x: one combined string
    return {"name": t.get("Name", ""), "dtype": norm_dtype(fd), "format": fd}


def parse_inspector(engine_info: dict | str, layers: list | None = None) -> dict[str, Any]:
    """Engine-inspector JSON (TensorRT 10.x or 11.x schema) → the manifest's layer/precision summary.

    `engine_info` is `get_engine_information(JSON)`; `layers` optional per-layer `get_layer_information(i, JSON)`
    (used when the engine document lists only names). 10.x: `"Bindings": [names]`, layer I/O with a combined
    `"Format/Datatype"` string. 11.x: `"I/O Tensors": [{Name, IOMode, DataType, Dimensions, ...}]`, layer I/O with
    separate `Format` and `DataType`. Engines built without `profiling_verbosity = DETAILED` give names only.
    """
    info = json.loads(engine_info) if isinstance(engine_info, str) else engine_info
    raw_layers = info.get("Layers", [])
    if layers is not None and (not raw_layers or all(isinstance(x, str) for x in raw_layers)):
        raw_layers = [json.loads(x) if isinstance(x, str) and x.lstrip().startswith("{") else x for x in layers]
    if "I/O Tensors" in info:
        schema = "11.x"
        io = [{"name": t.get("Name", ""), "mode": str(t.get("IOMode", "")).lower(),
               "dtype": norm_dtype(t.get("DataType")), "shape": t.get("Dimensions")} for t in info["I/O Tensors"]]
    elif "Bindings" in info:
        schema = "10.x"
        io = [{"name": b, "mode": "", "dtype": "unknown", "shape": None} if isinstance(b, str) else
              {"name": b.get("Name", ""), "mode": "", "dtype": "unknown", "shape": None} for b in info["Bindings"]]
    else:
        schema = "unknown"
        io = []
    out_layers, detailed = [], False
    for layer in raw_layers:
        if isinstance(layer, str):
            out_layers.append({"name": layer, "type": "unknown", "inputs": [], "outputs": [], "onnx": []})
            continue
        detailed = True
        ins = [_tensor(t) for t in layer.get("Inputs", [])]
        outs = [_tensor(t) for t in layer.get("Outputs", [])]
        onnx_names = re.findall(r"\[ONNX Layer: ([^\]]+)\]", str(layer.get("Metadata", "")))
        kind = layer.get("LayerType", layer.get("ParameterType", ""))
        out_layers.append({"name": layer.get("Name", ""), "type": kind,
                           "parameter_type": layer.get("ParameterType", ""), "tactic": layer.get("TacticName", ""),
                           "inputs": [t["dtype"] for t in ins], "outputs": [t["dtype"] for t in outs],
                           "onnx": onnx_names})
    signature = [[x["name"], x["type"], x["inputs"], x["outputs"]] for x in out_layers]
    by_precision = Counter(x["outputs"][0] if x["outputs"] else "unknown" for x in out_layers)
    return {"schema": schema, "detailed": detailed, "num_layers": len(out_layers),
            "layer_types": dict(sorted(Counter(x["type"] for x in out_layers).items())),
            "layer_output_precisions": dict(sorted(by_precision.items())), "io_tensors": io,
            "layers": [{k: x[k] for k in ("name", "type", "inputs", "outputs", "onnx")} for x in out_layers],
            "layer_signature": hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()}


# compute layers: TensorRT's names, and the Myelin backend's (a convolution runs as "correlation", or inside a
# "runtime_fusion" with its epilogue)
_COMPUTE_LAYER = re.compile(r"conv|correlation|gemm|matrixmultiply|fullyconnected|deconvolution|matmul|runtime_fusion",
                            re.I)


def inspector_audit(summary: dict[str, Any], precision: str) -> OpSupport:
    """Which compute work of a built engine runs in `precision` (a layer's first input dtype).

    With `summary["onnx_compute_nodes"]` (name → op, recorded at build) the unit is the ONNX compute node, as in the
    static audit: each is judged by the compute layer that covers it (a layer's metadata names the ONNX nodes it
    fuses; quantize / cast prologues are not compute layers), and a node no compute layer covers is reported.
    Without it, each compute layer counts once."""
    want = {"fp32": "float32", "fp16": "float16", "int8": "int8"}[precision]
    native, fallback, other = Counter(), [], Counter()

    def is_compute(layer) -> bool:
        return bool(_COMPUTE_LAYER.search(layer["type"] or "")
                    or _COMPUTE_LAYER.search(layer.get("parameter_type", "")))

    def runs(layer) -> str:
        return layer["inputs"][0] if layer["inputs"] else "unknown"

    for layer in summary["layers"]:
        if not is_compute(layer):
            other[layer["type"] or "unknown"] += 1
    nodes = summary.get("onnx_compute_nodes")
    if nodes is None:
        for layer in filter(is_compute, summary["layers"]):
            if runs(layer) == want:
                native[layer["type"]] += 1
            else:
                fallback.append({"node": layer["name"], "op": layer["type"], "runs_as": runs(layer)})
        return OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))
    covering: dict[str, list] = {}
    for layer in filter(is_compute, summary["layers"]):
        for name in layer["onnx"]:
            covering.setdefault(name, []).append(layer)
    for name, op in sorted(nodes.items()):
        layers = covering.get(name, [])
        if not layers:
            fallback.append({"node": name, "op": op, "runs_as": "no compute layer names it"})
        elif all(runs(x) == want for x in layers):
            native[op] += 1
        else:
            fallback.append({"node": name, "op": op, "runs_as": ",".join(sorted({runs(x) for x in layers}))})
    return OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))
