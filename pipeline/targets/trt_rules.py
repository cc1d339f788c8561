"""GPU-free TensorRT audit: check an ONNX statically against the TensorRT ONNX parser's rules.

TensorRT needs a working CUDA driver even to *parse* an ONNX (the parser hangs off a `Builder`, which fails to
initialise without one), so CI cannot ask TensorRT what it would reject. This module
answers the same question from the graph alone, for what the parser documents:

* the operator table (`SUPPORTED` / `UNSUPPORTED`, below) — source: onnx/onnx-tensorrt `docs/operators.md`,
  "TensorRT 10.15 supports operators in the inclusive range of opset 9 to opset 24" (the 10.x table; the 11.x parser
  keeps the same list for the ops used here). An op in neither list, or in a non-default domain, needs a plugin;
* opset range 9..24 for the default domain;
* explicit quantization (same file, plus the TensorRT "explicit quantization" guide): `QuantizeLinear`
  input FP32/FP16/BF16 with `y_zero_point` 0; `DequantizeLinear` input INT8/FP8/FP4/INT4 only with `x_zero_point`
  0 (so int32 bias DQ and uint8 activations fail: "UINT8 is only supported as network input or output tensor
  types"); scales must be build-time constants; activations per-tensor; weights per-tensor or per-channel along the
  output-channel axis (Conv W axis 0, ConvTranspose W axis 1, Gemm B axis 1 — 0 when transB — and MatMul B the
  last axis);
* a few per-op restrictions from the table's "Restrictions" column that a face model can hit (pool dilations,
  MaxPool `Indices`, Reduce* `axes` as a non-constant input).

It also says, per compute node, whether the engine would run it in the requested precision (strongly typed: the
dtypes the ONNX carries) — the same native/fallback split as the other targets' audits, labelled "static".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline.targets.base import OpSupport

TABLE_SOURCE = "onnx/onnx-tensorrt docs/operators.md (TensorRT 10.15; opset 9..24)"
OPSET_MIN, OPSET_MAX = 9, 24

SUPPORTED = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization BlackmanWindow
Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv
DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If ImageScaler
InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM
LpNormalization LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression
NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin
ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN RoiAlign
RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh
Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TensorScatter ThresholdedRelu
Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

UNSUPPORTED = frozenset("""
AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad Compress
ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder MatMulInteger MaxRoiPool MaxUnpool
MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional OptionalGetElement OptionalHasElement QLinearConv
QLinearMatMul RegexFullMatch SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength
SequenceMap SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer StringSplit TfIdfVectorizer Unique
""".split())

# What counts as compute for the precision audit (same split as the ort-cpu target's audit, so rows compare).
HEAVY = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
LIGHT = frozenset({"Add", "Mul", "AveragePool", "MaxPool", "GlobalAveragePool"})
_REDUCE = frozenset(op for op in SUPPORTED if op.startswith("Reduce"))
_T = onnx.TensorProto
_DQ_INPUTS = {_T.INT8: "int8", _T.FLOAT8E4M3FN: "fp8", _T.INT4: "int4", _T.FLOAT4E2M1: "fp4"}
_Q_INPUTS = {_T.FLOAT, _T.FLOAT16, _T.BFLOAT16}
_FLOAT_NAMES = {_T.FLOAT: "float32", _T.FLOAT16: "float16", _T.BFLOAT16: "bfloat16"}
# weight input slot → required per-channel axis (None: depends on attributes, see _weight_axis)
_WEIGHT_SLOT = {"Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1}


def dtype_name(t: int) -> str:
    return _T.DataType.Name(t).lower() if t else "unknown"


@dataclass(frozen=True)
class Problem:
    node: str
    op: str
    rule: str       # op-unsupported | custom-domain | opset | q-zero-point | dq-zero-point | dq-input-type | ...
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"node": self.node, "op": self.op, "rule": self.rule, "detail": self.detail}


@dataclass(frozen=True)
class StaticAudit:
    precision: str
    opset: int
    problems: list[Problem]     # what the TensorRT ONNX parser would reject: the build fails on any of these
    support: OpSupport          # per compute node: native in `precision`, or falls back (runs_as)
    ops: dict[str, int] = field(default_factory=dict)

    @property
    def parses(self) -> bool:
        return not self.problems

    def summary(self) -> dict[str, Any]:
        return {"method": "static", "table": TABLE_SOURCE, "precision": self.precision, "opset": self.opset,
                "parses": self.parses, "problems": [p.as_dict() for p in self.problems],
                "problem_rules": dict(sorted(Counter(p.rule for p in self.problems).items())),
                "audit": self.support.summary(), "ops": self.ops}


class _Graph:
    """Constants, producers and element types of one graph (shape inference fills intermediate dtypes)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # noqa: BLE001 — an uninferable graph still gets the op/QDQ checks
            inferred = model
        g = inferred.graph
        self.nodes = list(g.node)
        self.consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        self.types: dict[str, int] = {i.name: i.data_type for i in g.initializer}
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        self.producer: dict[str, onnx.NodeProto] = {}
        for n in self.nodes:
            for o in n.output:
                self.producer[o] = n
            if n.op_type == "Constant" and n.output:
                for a in n.attribute:
                    if a.name == "value":
                        self.consts[n.output[0]] = numpy_helper.to_array(a.t)
                        self.types[n.output[0]] = a.t.data_type
        self.graph_inputs = {i.name for i in g.input}

    def const(self, name: str) -> np.ndarray | None:
        """The value of a build-time constant (initializer, Constant, or Identity of one), else None."""
        if name in self.consts:
            return self.consts[name]
        p = self.producer.get(name)
        if p is not None and p.op_type == "Identity":
            return self.const(p.input[0])
        return None

    def dq_source(self, name: str) -> onnx.NodeProto | None:
        p = self.producer.get(name)
        return p if p is not None and p.op_type == "DequantizeLinear" else None


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _label(n: onnx.NodeProto) -> str:
    return f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type


def _weight_axis(consumer: onnx.NodeProto, rank: int) -> int:
    if consumer.op_type == "Conv":
        return 0
    if consumer.op_type == "ConvTranspose":
        return 1
    if consumer.op_type == "Gemm":
        return 0 if _attr(consumer, "transB", 0) else 1
    return rank - 1  # MatMul B [.., K, N]: N is the output channel


def _check_qdq(g: _Graph, n: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]]) -> list[Problem]:
    out, name = [], n.name or n.output[0]
    scale = g.const(n.input[1]) if len(n.input) > 1 else None
    if scale is None:
        out.append(Problem(name, n.op_type, "scale-not-constant", "scales must be build-time constants"))
    zp = g.const(n.input[2]) if len(n.input) > 2 and n.input[2] else None
    if len(n.input) > 2 and n.input[2] and zp is None:
        out.append(Problem(name, n.op_type, "zero-point-not-constant", "zero point must be a build-time constant"))
    if zp is not None and np.any(zp):
        rule = "q-zero-point" if n.op_type == "QuantizeLinear" else "dq-zero-point"
        out.append(Problem(name, n.op_type, rule, f"zero point must be all zeros (got {np.unique(zp)[:4].tolist()}; "
                           "TensorRT only supports symmetric quantization)"))
    if n.op_type == "QuantizeLinear":
        t_in = g.types.get(n.input[0])
        if t_in and t_in not in _Q_INPUTS:
            out.append(Problem(name, n.op_type, "q-input-type", f"input is {dtype_name(t_in)}; FP32/FP16/BF16 only"))
        t_out = _attr(n, "output_dtype", 0) or (g.types.get(n.input[2]) if zp is not None else 0)
        if t_out and t_out not in _DQ_INPUTS:
            out.append(Problem(name, n.op_type, "q-output-type", f"quantizes to {dtype_name(t_out)}; TensorRT "
                               "quantizes to INT8/FP8/FP4/INT4 only (UINT8 only at network I/O)"))
    else:
        t_in = g.types.get(n.input[0])
        if t_in and t_in not in _DQ_INPUTS:
            out.append(Problem(name, n.op_type, "dq-input-type", f"input is {dtype_name(t_in)}; DequantizeLinear "
                               "accepts INT8/FP8/FP4/INT4 only (e.g. int32 biases, uint8 activations fail)"))
    if scale is not None and scale.size > 1:
        axis = int(_attr(n, "axis", 1))
        weight = g.const(n.input[0]) if n.op_type == "DequantizeLinear" else None
        if weight is None:
            out.append(Problem(name, n.op_type, "per-channel-activation",
                               "activations must be quantized per tensor (scale has "
                               f"{scale.size} elements)"))
        else:
            axis = axis % weight.ndim
            for c in consumers.get(n.output[0], []):
                slot = _WEIGHT_SLOT.get(c.op_type)
                if slot is None or len(c.input) <= slot or c.input[slot] != n.output[0]:
                    continue
                want = _weight_axis(c, weight.ndim)
                if axis != want or scale.size != weight.shape[want]:
                    out.append(Problem(name, n.op_type, "per-channel-axis",
                                       f"{c.op_type} weight quantized along axis {axis} ({scale.size} scales); "
                                       f"TensorRT wants the output-channel axis {want} ({weight.shape[want]})"))
    return out


def _check_op(g: _Graph, n: onnx.NodeProto) -> list[Problem]:
    name = n.name or (n.output[0] if n.output else n.op_type)
    if n.domain not in ("", "ai.onnx"):
        return [Problem(name, _label(n), "custom-domain", f"domain {n.domain!r} is not ONNX: needs a TensorRT plugin")]
    if n.op_type in UNSUPPORTED:
        return [Problem(name, n.op_type, "op-unsupported", f"{n.op_type} is listed unsupported in {TABLE_SOURCE}")]
    if n.op_type not in SUPPORTED:
        return [Problem(name, n.op_type, "op-unknown", f"{n.op_type} is not in {TABLE_SOURCE}")]
    out = []
    if n.op_type in ("AveragePool", "MaxPool", "LpPool"):
        dil = _attr(n, "dilations")
        if dil and any(d != 1 for d in dil):
            out.append(Problem(name, n.op_type, "op-restriction", "`dilations` must be empty or all ones"))
        if n.op_type == "MaxPool" and len(n.output) > 1 and n.output[1]:
            out.append(Problem(name, n.op_type, "op-restriction", "`Indices` output tensor unsupported"))
    if n.op_type in _REDUCE and len(n.input) > 1 and n.input[1] and g.const(n.input[1]) is None:
        out.append(Problem(name, n.op_type, "op-restriction", "`axes` must be an initializer"))
    return out


def _precision_of(g: _Graph, n: onnx.NodeProto) -> str:
    """The dtype a strongly typed network runs a compute node in: int8 if its inputs come from int8 DQ nodes."""
    data = g.dq_source(n.input[0]) if n.input else None
    heavy_weight_ok = True
    if n.op_type in HEAVY and len(n.input) > 1:
        heavy_weight_ok = g.dq_source(n.input[1]) is not None
    if data is not None and heavy_weight_ok and g.types.get(data.input[0]) in _DQ_INPUTS:
        return _DQ_INPUTS[g.types[data.input[0]]]
    t = g.types.get(n.input[0]) if n.input else None
    return _FLOAT_NAMES.get(t, dtype_name(t or 0))


def audit_model(model: onnx.ModelProto, precision: str) -> StaticAudit:
    """Statically audit one ONNX model (already prepared for `precision`: fp32, fp16-converted or int8 QDQ)."""
    g = _Graph(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    problems: list[Problem] = []
    if not OPSET_MIN <= opset <= OPSET_MAX:
        problems.append(Problem("<model>", "-", "opset", f"default-domain opset {opset} is outside "
                                f"{OPSET_MIN}..{OPSET_MAX} ({TABLE_SOURCE})"))
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    want = {"fp32": "float32", "fp16": "float16", "int8": "int8"}[precision]
    native, fallback, other, ops = Counter(), [], Counter(), Counter()
    for n in g.nodes:
        ops[_label(n)] += 1
        node_problems = _check_op(g, n)
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and not node_problems:
            node_problems += _check_qdq(g, n, consumers)
        problems += node_problems
        name = n.name or (n.output[0] if n.output else n.op_type)
        if node_problems and node_problems[0].rule in ("custom-domain", "op-unsupported", "op-unknown"):
            fallback.append({"node": name, "op": _label(n), "runs_as": "unsupported (parse fails)"})
            continue
        if n.op_type in HEAVY or n.op_type in LIGHT:
            runs = _precision_of(g, n)
            if runs == want:
                native[n.op_type] += 1
            elif n.op_type in HEAVY:
                fallback.append({"node": name, "op": n.op_type, "runs_as": runs})
            else:
                other[n.op_type] += 1
        else:
            other[_label(n)] += 1
    support = OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))
    return StaticAudit(precision, opset, problems, support, dict(sorted(ops.items())))
