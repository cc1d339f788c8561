"""PyTorch → ONNX: `export_onnx` writes a model's graph with the dynamic axes its params declare.

The exporter is pinned (params `export.exporter`, `export.opset`) because only a pinned exporter gives
byte-identical files (tests/models/test_export.py exports twice in fresh processes and compares the bytes).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import ExportConfig, ModelConfig


def export_onnx(model: torch.nn.Module, mcfg: ModelConfig, ecfg: ExportConfig, path: Path,
                example: dict[str, np.ndarray] | None = None) -> None:
    """Write the ONNX graph of `model`, with the dynamic axes of params `models.<name>.dynamic` on its inputs and
    its role's on every output (pipeline/roles/ `output_axes`).

    `example` (a golden feed) gives the input names, order and shapes; by default one input named `input` of
    batch 2 × `input_shape`. Deterministic for a pinned exporter.
    """
    if example is None:
        example = {"input": np.zeros((2, *mcfg.input_shape), np.float32)}
    output_names = list(getattr(model, "output_names", ["output"]))
    axes = {name: {a: f"{name}_{a}" for a in mcfg.dynamic.get(name, ())} for name in example}
    out_axes = roles.get(mcfg.samples).output_axes()     # P-Net (fully convolutional): the spatial axes too
    axes.update({name: dict(out_axes) for name in output_names})
    args = tuple(torch.from_numpy(v) for v in example.values())
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice; the choice is pinned
        kwargs = {"external_data": False} if ecfg.exporter == "dynamo" else {}
        torch.onnx.export(model, args, str(path), dynamo=ecfg.exporter == "dynamo", opset_version=ecfg.opset,
                          input_names=list(example), output_names=output_names,
                          dynamic_axes={k: v for k, v in axes.items() if v}, do_constant_folding=True, **kwargs)
