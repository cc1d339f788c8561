"""Model factories. params.yaml names a factory as "module:callable"; it is called with the weights path."""

from __future__ import annotations

import importlib

import torch

from pipeline.config import ModelConfig
from pipeline.errors import KilnError


def build(cfg: ModelConfig) -> torch.nn.Module:
    """Instantiate a model in eval mode from its params.yaml entry."""
    module_name, _, attr = cfg.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise KilnError(f"params.yaml: models.{cfg.name}.factory: cannot import {cfg.factory!r} ({e})",
                        "name an importable 'module:callable'") from None
    if not cfg.weights.is_file():
        raise KilnError(f"{cfg.weights}: weights for model {cfg.name!r} not found",
                        "run `dvc repro assets` (or `kiln assets`), or fix models.<name>.weights in params.yaml")
    model = factory(cfg.weights)
    return model.eval()
