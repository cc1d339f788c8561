"""Model sources. params.yaml names a PyTorch factory as "module:callable" (called with the weights path), or an
ONNX file (`onnx: {path, sha256}`, imported by import@<model>, pipeline/onnx_import.py)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import KilnError
from pipeline.dvcfiles import address

if TYPE_CHECKING:  # keep `import pipeline.models.<x>` free of yaml/config for GPU-side scripts
    import torch

    from pipeline.config import ModelConfig


def factory_modules(mcfg: "ModelConfig") -> list[str]:
    """The module a model's factory lives in (a stage that builds the model depends on its code); none for ONNX."""
    return [] if mcfg.factory is None else [mcfg.factory.partition(":")[0]]


def weight_deps(mcfg: "ModelConfig") -> list[str]:
    """The model's own source files — its weights, or its ONNX file and the external-data files it reads — as
    dependency paths (none for a graph without learned weights)."""
    if mcfg.onnx is not None:
        return mcfg.onnx.files
    return [] if mcfg.source_file is None else [Path(mcfg.source_file).as_posix()]


def build(cfg: "ModelConfig", root: Path = Path(".")) -> "torch.nn.Module":
    """Instantiate a model in eval mode from its params.yaml entry; `weights` is relative to the project root."""
    if cfg.factory is None:
        raise KilnError(f"params.yaml: models.{cfg.name} comes from an ONNX file, not a PyTorch factory",
                        "this step needs a PyTorch model; ONNX models run through ONNX Runtime (golden, import)")
    module_name, _, attr = cfg.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise KilnError(f"params.yaml: models.{cfg.name}.factory: cannot import {cfg.factory!r} ({e})",
                        "name an importable 'module:callable'") from None
    if cfg.weights is None:  # a graph with no learned weights (the aligner)
        return factory().eval()
    weights = Path(root) / cfg.weights
    if not weights.is_file():
        raise KilnError(f"{weights}: weights for model {cfg.name!r} not found",
                        f"run `dvc repro {address('assets')}` (or `kiln assets`), or fix models.<name>.weights in "
                        "params.yaml")
    return factory(weights).eval()
