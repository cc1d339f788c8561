"""Model factories. params.yaml names a factory as "module:callable"; it is called with the weights path."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import KilnError
from pipeline.stage import address

if TYPE_CHECKING:  # keep `import pipeline.models.<x>` free of yaml/config for GPU-side scripts
    import torch

    from pipeline.config import ModelConfig


def factory_module(mcfg: "ModelConfig") -> str:
    """The module a model's factory lives in (a stage that builds the model depends on its code)."""
    return mcfg.factory.partition(":")[0]


def weight_deps(mcfg: "ModelConfig") -> list[str]:
    """The model's own weights file, as a dependency path (none for a graph without learned weights)."""
    return [] if mcfg.weights is None else [Path(mcfg.weights).as_posix()]


def build(cfg: "ModelConfig", root: Path = Path(".")) -> "torch.nn.Module":
    """Instantiate a model in eval mode from its params.yaml entry; `weights` is relative to the project root."""
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
