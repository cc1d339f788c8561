"""The golden reference as later stages read it: the FP32 outputs of golden@<model> (verified against their
manifest first) and the manifest inputs of the files a model's graph is read from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import models
from pipeline.manifest import file_input, manifest_path, read_verified

if TYPE_CHECKING:
    from pipeline.config import ModelConfig


def source_inputs(mcfg: ModelConfig, root: Path) -> list[dict]:
    """Manifest inputs (digests) of the files the model's graph is read from (models.weight_deps)."""
    if mcfg.onnx is None:
        return [file_input("weights", root / w, root) for w in models.weight_deps(mcfg)]
    return [file_input("onnx_source" if i == 0 else "onnx_external_data", root / f, root)
            for i, f in enumerate(mcfg.onnx.files)]


def load_reference(directory: Path) -> tuple[list[str], list[list[np.ndarray]]]:
    """(output names, outputs per feed) of a golden artifact, its files verified against its manifest first."""
    read_verified(manifest_path(directory, directory.name), fast=True)
    index = json.loads((directory / "index.json").read_text(encoding="utf-8"))
    names = index["outputs"]
    return names, [[np.load(directory / "reference" / f"{i:04d}.{n}.npy", allow_pickle=False) for n in names]
                   for i in range(index["feeds"])]
