"""Static Edge TPU rules: which ops of a full-integer .tflite the Edge TPU compiler would map to the Edge TPU, and
which it would leave to the CPU. The compiler (edgetpu_compiler, Debian package from Google's apt host) cannot be
reached here, so this is the public op table applied as rules — like trt_rules for TensorRT — not a compile.

Sources (read 2026-12-03; the live table at https://coral.ai/docs/edgetpu/models-intro/#supported-operations could
not be read in full from here, so it was reconstructed from):
* the 2019 copy of that table (runtime ≤ 12 rows and limitation texts);
* google-coral/edgetpu CHANGES.md: runtime 13 added EXPAND_DIMS, PACK, QUANTIZE, SUM, TRANSPOSE_CONV;
* Coral maintainers in google-coral/edgetpu issues #156 (LSTM), #193 (TRANSPOSE), #384 (RSQRT): compiler 16,
  which needs runtime 14;
* Axis's copy of the newer limitation texts (ARTPEC-7 uses the Edge TPU compiler) and its optimization tips.
Rows whose minimum runtime was not confirmed say `14?`.

Model-level rules applied: every activation int8/uint8 (a constant also int32: bias, permutation, axes); static shapes;
at most the 3 innermost dimensions of a tensor above 1. The compiler partitions once: the first op it cannot map, and
every op after it, run on the CPU. Limitations that need an op's builtin options (no fused activation on pools and
concatenation, equal x/y dilation on convolutions) are not read by the runtime's op listing and are listed as
`unchecked`.
"""

from __future__ import annotations

import numpy as np

# op → (minimum Edge TPU runtime, the limitation the rules below check or list)
OPS: dict[str, tuple[str, str]] = {
    "ADD": ("all", ""), "AVERAGE_POOL_2D": ("all", "no fused activation (unchecked)"),
    "CONCATENATION": ("all", "no fused activation (unchecked)"), "CONV_2D": ("all", "same x/y dilation (unchecked)"),
    "DEPTHWISE_CONV_2D": ("all", "same x/y dilation (unchecked)"), "EXPAND_DIMS": ("13", ""),
    "FULLY_CONNECTED": ("all", "default weights format; output one-dimensional"), "L2_NORMALIZATION": ("all", ""),
    "LOGISTIC": ("all", ""), "UNIDIRECTIONAL_SEQUENCE_LSTM": ("14", "unidirectional only"),
    "MAXIMUM": ("all", ""), "MAX_POOL_2D": ("all", "no fused activation (unchecked)"),
    "MEAN": ("all", "no reduction in the batch dimension"), "MINIMUM": ("all", ""), "MUL": ("all", ""),
    "PACK": ("13", "no packing in the batch dimension"), "PAD": ("all", "no padding in the batch dimension"),
    "PRELU": ("14?", "alpha one-dimensional"), "QUANTIZE": ("13", ""), "REDUCE_MAX": ("14?", "not the batch dim"),
    "REDUCE_MIN": ("14?", "not the batch dim"), "RELU": ("all", ""), "RELU6": ("all", ""),
    "RELU_N1_TO_1": ("all", ""), "RESHAPE": ("all", "large tensors may not map"),
    "RESIZE_BILINEAR": ("all", "3-D input/output"), "RESIZE_NEAREST_NEIGHBOR": ("all", "3-D input/output"),
    "RSQRT": ("14?", ""), "SLICE": ("all", ""), "SOFTMAX": ("all", "1-D input, at most 16000 elements"),
    "SPACE_TO_DEPTH": ("all", ""), "SPLIT": ("all", ""), "SQUEEZE": ("all", "leading 1s only"),
    "STRIDED_SLICE": ("all", "all strides 1"), "SUB": ("all", ""), "SUM": ("13", ""),
    "SQUARED_DIFFERENCE": ("14?", ""), "TANH": ("all", ""), "TRANSPOSE": ("14", ""),
    "TRANSPOSE_CONV": ("13", ""),
}
INTEGER = {"int8", "uint8"}


def _problems(op: dict, tensors: dict[int, dict], activations: set[int]) -> list[str]:
    """Why the compiler would not map this op (empty: it would). Shape rules apply to activations (a tensor some op
    computes, or a graph input), not to constant weights (a conv filter is 4-D by definition)."""
    name = op["op_name"]
    if name not in OPS:
        return [f"{name} is not in the Edge TPU op table"]
    found = []
    for i in [int(i) for i in [*op["inputs"], *op["outputs"]] if i >= 0]:
        dtype = np.dtype(tensors[i]["dtype"]).name
        # activations int8/uint8; constants may also be int32 (a bias, a permutation, paddings, axes)
        if dtype not in INTEGER and (i in activations or dtype != "int32"):
            found.append(f"{'tensor' if i in activations else 'constant'} {tensors[i]['name']} is {dtype}")
    for i in [*op["inputs"], *op["outputs"]]:
        if i < 0 or i not in activations:
            continue
        shape = [int(s) for s in tensors[i]["shape_signature"]]
        if any(s < 0 for s in shape):
            found.append(f"{tensors[i]['name']} has a dynamic shape {shape}")
        elif any(s > 1 for s in shape[:-3]):
            found.append(f"{tensors[i]['name']} {shape}: only the 3 innermost dimensions may exceed 1")
    if name == "SOFTMAX":
        shape = [int(s) for s in tensors[op["inputs"][0]]["shape_signature"]]
        if sum(s > 1 for s in shape) > 1 or int(np.prod(shape)) > 16000:
            found.append(f"SOFTMAX input {shape}: only 1-D inputs of at most 16000 elements")
    return found


def audit(ops: list[dict], tensors: dict[int, dict], graph_inputs: set[int]) -> dict:
    """The Edge TPU rule audit of a .tflite's ops in execution order (tensors by index; `graph_inputs`: the input
    tensors' indices), in the shape of a device query."""
    first, unsupported, min_runtime = None, {}, set()
    activations = {int(i) for op in ops for i in op["outputs"]} | set(graph_inputs)
    for op in ops:
        if problems := _problems(op, tensors, activations):
            first = first if first is not None else op["index"]
            unsupported.setdefault(op["op_name"], problems[0])
        else:
            min_runtime.add(OPS[op["op_name"]][0])
    mapped = len(ops) if first is None else sum(op["index"] < first for op in ops)
    return {"queried": True, "how": "static rules (pipeline/targets/edgetpu_rules.py); edgetpu_compiler not run",
            "ops": len(ops), "supported": mapped, "cpu_ops": len(ops) - mapped,
            "first_unsupported": None if first is None else f"op {first} {ops[first]['op_name']}",
            "unsupported_op_types": sorted(unsupported), "why": unsupported,
            "min_runtime": max((r for r in min_runtime if r != "all"), default="all"),
            "unchecked": sorted({f"{op['op_name']}: {OPS[op['op_name']][1]}" for op in ops
                                 if op["op_name"] in OPS and "unchecked" in OPS[op["op_name"]][1]})}
