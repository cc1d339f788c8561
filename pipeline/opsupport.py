"""Which ops of an imported ONNX graph each target cannot run, asked of the target's own toolchain, before compiling.

import@<model> runs this for every ONNX target the model has engines for, so that a user's model with an op a
target lacks fails at import with the op and the target named, instead of deep inside compile@. The questions:

* ort-cpu       ONNX Runtime builds a session (graph optimizations off): a missing kernel or op fails that build;
* openvino-cpu  OpenVINO's ONNX frontend converts the graph (ops without a conversion rule are listed by name), then
                `query_model` maps each op to a device: any op not mapped to CPU is unsupported;
* tensorrt, tensorrt-rtx  the static parser rules (pipeline/targets/trt_rules.py): no GPU needed;
* anything else: not asked (reported as such, never as supported).

A toolchain that is absent on this host is reported as not checked, with its reason.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.onnx_import import ort_ops

_OV_OPS = re.compile(r"No conversion rule found for operations: ([^\n]+)")


def _ort(path: Path) -> list[str] | str:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 — ORT raises its own Fail / NotImplemented / InvalidGraph types
        return ort_ops(str(e))
    return []


def _openvino(path: Path) -> list[str] | str:
    try:
        import openvino as ov
    except ImportError as e:
        return f"not checked: {e}"
    core = ov.Core()
    try:
        model = core.read_model(str(path))
    except RuntimeError as e:
        m = _OV_OPS.search(str(e))
        return sorted(s.strip() for s in m.group(1).split(",")) if m else [f"(read failed: {str(e).splitlines()[0]})"]
    placed = core.query_model(model, "CPU")
    return sorted({op.get_type_name() for op in model.get_ops() if op.get_friendly_name() not in placed
                   and op.get_type_name() not in ("Parameter", "Result", "Constant")})


def _tensorrt(path: Path) -> list[str] | str:
    import onnx

    from pipeline.targets import trt_rules

    audit = trt_rules.audit_model(onnx.load(str(path)), "fp32")
    return sorted({p.op for p in audit.problems if p.rule in ("custom-domain", "op-unsupported", "op-unknown")})


CHECKS = {"ort-cpu": _ort, "openvino-cpu": _openvino, "tensorrt": _tensorrt, "tensorrt-rtx": _tensorrt}


def unsupported(path: Path, targets: list[str]) -> dict[str, list[str] | str]:
    """{target: the ops it cannot run (empty: all supported), or a line saying why it was not checked}."""
    return {t: (CHECKS[t](path) if t in CHECKS else "not checked: no op-support query for this target")
            for t in targets}
