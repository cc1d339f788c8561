"""Parity of an ONNX graph with its golden reference: the ONNX checks (onnx.checker, strict shape inference, the
operator inventory) and ONNX Runtime's outputs compared with golden. The comparison itself, `print_parity` and
`model_deps` are numpy-only in pipeline/gates/agreement.py (a torch.export program is compared without onnx) and are
importable from here too."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from pipeline.errors import KilnError
from pipeline.gates.agreement import compare, model_deps, print_parity

__all__ = ["check_graph", "compare", "model_deps", "parity", "print_parity"]


def check_graph(path: Path) -> tuple[dict[str, int], dict[str, list]]:
    """onnx.checker (full) + strict shape inference; returns the operator inventory and output shapes."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise KilnError(f"{path}: exported graph is invalid: {str(e).splitlines()[0]}",
                        "the model uses an op the exporter lowers incorrectly; see the ONNX error above") from None
    ops = dict(sorted(Counter(n.op_type for n in model.graph.node).items()))
    shapes = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    return ops, shapes


def parity(onnx_path: Path, feeds, reference: list[list[np.ndarray]]) -> dict[str, float]:
    """ONNX Runtime (CPU, the portable session: the same numbers on every x86-64 CPU) vs the PyTorch reference on
    every feed and output."""
    from pipeline.portable import ort_session

    sess = ort_session(onnx_path)
    return compare(lambda feed: sess.run(None, feed), feeds, reference)
