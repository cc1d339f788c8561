"""What a QDQ graph quantizes — its inventory: nodes on dequantized inputs vs float nodes, Q/DQ counts, activation
zero points, weight, constant and bias types — and how it breaks a recipe's contract."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline.config import Recipe

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
_DTYPE_NAMES = {onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.INT8: "int8", onnx.TensorProto.INT32: "int32",
                onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}
_BIASED_OPS = ("Conv", "ConvTranspose", "Gemm")
_WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_ACTIVATION_TYPES = {"u8": onnx.TensorProto.UINT8, "s8": onnx.TensorProto.INT8}


def _dtype(t: int) -> str:
    return _DTYPE_NAMES.get(t, onnx.TensorProto.DataType.Name(t).lower())


def inventory(model: onnx.ModelProto) -> dict:
    """What a QDQ graph quantizes: DQ-fed vs float nodes, Q/DQ counts, activation zero points, weight/bias types."""
    inits = {i.name: i for i in model.graph.initializer}
    nodes = list(model.graph.node)
    dq_out = {n.output[0]: n for n in nodes if n.op_type == "DequantizeLinear"}
    quantized, floating, float_nodes = Counter(), Counter(), []
    for n in nodes:
        if n.op_type in QDQ_OPS:
            continue
        if any(i in dq_out for i in n.input):
            quantized[n.op_type] += 1
        else:
            floating[n.op_type] += 1
            float_nodes.append(f"{n.op_type} {n.name}")

    bias_slots = {n.input[2] for n in nodes if n.op_type in _BIASED_OPS and len(n.input) > 2 and n.input[2]}
    # weights: the constant input of a Conv / Gemm / MatMul; any other quantized constant (an elementwise Mul's
    # scalar in an imported graph's input scaling, a PRelu slope) ORT quantizes like an activation: `constant_types`
    weight_slots = {n.input[1] for n in nodes if n.op_type in _WEIGHTED_OPS and len(n.input) > 1}
    # Every activation QuantizeLinear / DequantizeLinear node: its zero point's type and whether it is 0.
    act_types, act_zero = Counter(), Counter()
    weight_types, constant_types, per_channel = Counter(), Counter(), 0
    for n in nodes:
        if n.op_type == "QuantizeLinear" or (n.op_type == "DequantizeLinear" and n.input[0] not in inits):
            zp = inits.get(n.input[2]) if len(n.input) > 2 else None
            act_types["none" if zp is None else _dtype(zp.data_type)] += 1
            act_zero["zero" if zp is None or not np.any(numpy_helper.to_array(zp)) else "nonzero"] += 1
        elif n.op_type == "DequantizeLinear" and n.output[0] not in bias_slots and n.output[0] not in weight_slots:
            constant_types[_dtype(inits[n.input[0]].data_type)] += 1
        elif n.op_type == "DequantizeLinear" and n.output[0] not in bias_slots:
            dtype = inits[n.input[0]].data_type
            weight_types[_dtype(dtype)] += 1
            scale = inits.get(n.input[1])
            per_channel += (dtype == onnx.TensorProto.INT8 and scale is not None
                            and numpy_helper.to_array(scale).size > 1)
    biases = Counter()
    for b in bias_slots:
        if b in dq_out:
            biases[_dtype(inits[dq_out[b].input[0]].data_type) if dq_out[b].input[0] in inits else "dq"] += 1
        elif b in inits:
            biases[_dtype(inits[b].data_type)] += 1
        else:
            biases["computed"] += 1
    return {"quantized_ops": dict(sorted(quantized.items())), "float_ops": dict(sorted(floating.items())),
            "float_nodes": float_nodes, "quantize_linear": sum(n.op_type == "QuantizeLinear" for n in nodes),
            "dequantize_linear": sum(n.op_type == "DequantizeLinear" for n in nodes),
            "activation_qdq_types": dict(sorted(act_types.items())),
            "activation_qdq_zero_points": dict(sorted(act_zero.items())),
            "weight_types": dict(sorted(weight_types.items())), "per_channel_weights": int(per_channel),
            **({"constant_types": dict(sorted(constant_types.items()))} if constant_types else {}),
            "bias_types": dict(sorted(biases.items()))}


def contract(recipe: Recipe, inv: dict) -> list[str]:
    """How the quantized graph breaks the recipe (empty = it keeps it)."""
    problems = []
    act = _dtype(_ACTIVATION_TYPES[recipe.activations])
    if set(inv["activation_qdq_types"]) != {act}:
        problems.append(f"activation Q/DQ types are {inv['activation_qdq_types']}, the recipe wants only {act}")
    if recipe.symmetric_activations and inv["activation_qdq_zero_points"].get("nonzero", 0):
        problems.append(f"{inv['activation_qdq_zero_points']['nonzero']} activation Q/DQ zero points are not 0")
    if set(inv["weight_types"]) != {"int8"}:
        problems.append(f"weights are {inv['weight_types']}, the recipe wants int8")
    if recipe.per_channel and inv["per_channel_weights"] != sum(inv["weight_types"].values()):
        problems.append(f"only {inv['per_channel_weights']} of {sum(inv['weight_types'].values())} weights are "
                        "quantized per channel")
    want_bias = "float32" if recipe.bias_float else "int32"
    if set(inv["bias_types"]) - {want_bias}:
        problems.append(f"biases are {inv['bias_types']}, the recipe wants {want_bias}")
    if not sum(inv["quantized_ops"].values()):
        problems.append("no node computes on quantized inputs")
    return problems
