"""The ONNX side of the TensorRT targets, with no TensorRT, CUDA or torch: the exact ONNX a `precision` engine is
built from (`prepare_onnx`, `onnx_bytes`), its static audit (`static_audit` → trt_rules), and the ONNX compute nodes
the builder audit accounts for (`compute_nodes`)."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import KilnError

PRECISIONS = ("fp32", "fp16", "int8")


# ---------------------------------------------------------------------------------------------- ONNX preparation
def prepare_onnx(src: Path, precision: str, batch_dim: str = "batch"):
    """The exact ONNX TensorRT parses for `precision`: opset-checked, batch dimension symbolic, FP16 if asked.

    FP16 keeps FP32 graph inputs/outputs (see the module doc). int8 requires a QDQ graph (the `symmetric` recipe);
    whether TensorRT accepts its Q/DQ form is the static audit's job (trt_rules).
    """
    import onnx

    from pipeline.targets import trt_rules

    if precision not in PRECISIONS:
        raise KilnError(f"tensorrt: unknown precision {precision!r}", f"use one of {', '.join(PRECISIONS)}")
    model = onnx.load(str(src))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not trt_rules.OPSET_MIN <= opset <= trt_rules.OPSET_MAX:
        raise KilnError(f"{src}: opset {opset} is outside what the TensorRT ONNX parser supports "
                        f"({trt_rules.OPSET_MIN}..{trt_rules.OPSET_MAX})", "re-export with export.opset in range")
    inp = model.graph.input[0]
    dim0 = inp.type.tensor_type.shape.dim[0]
    if not dim0.dim_param:
        dim0.ClearField("dim_value")
        dim0.dim_param = batch_dim          # a fixed batch makes the profile call fail
    has_qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    if precision == "int8" and not has_qdq:
        raise KilnError(f"{src}: an int8 TensorRT engine needs a QDQ ONNX (explicit quantization)",
                        "point the engine at the `symmetric` recipe: artifacts/quantized/<model>-symmetric")
    if precision != "int8" and has_qdq:
        raise KilnError(f"{src}: a {precision} engine was given a QDQ (int8) ONNX", "use the FP32 export")
    if precision == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)
    return model


def onnx_bytes(model) -> bytes:
    return model.SerializeToString(deterministic=True)


def static_audit(onnx_path: Path, precision: str):
    """trt_rules' audit of the ONNX a `precision` engine would be built from (prepared exactly as compile does)."""
    from pipeline.targets import trt_rules

    return trt_rules.audit_model(prepare_onnx(Path(onnx_path), precision), precision)


COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def compute_nodes(model) -> dict[str, str]:
    """The ONNX compute nodes (name → op type) of the graph TensorRT parsed: what the builder audit accounts for."""
    return {n.name: n.op_type for n in model.graph.node if n.op_type in COMPUTE_OPS}
