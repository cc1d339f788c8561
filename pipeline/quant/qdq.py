"""QDQ quantization from precomputed ranges: the `<model>-<recipe>` pairs, a recipe's quantizer options, the
ranges file calibrate@ writes, and ORT's QDQQuantizer driven with those ranges (as `quantize_static` does after
its own calibration)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from pipeline.dvcfiles import address
from pipeline.config import Recipe
from pipeline.errors import KilnError
from pipeline.quant.calibration import calibration_tensors, quantizable_op_types

if TYPE_CHECKING:
    from pipeline.config import Config


def pairs(cfg: Config) -> dict[str, tuple[str, str]]:
    """`<model>-<recipe>` → (model, recipe) for every quantized model × recipe."""
    return {f"{m}-{r}": (m, r) for m in cfg.quantize.models for r, recipe in cfg.recipes.items()
            if recipe.models is None or m in recipe.models}


def recipe_options(recipe: Recipe) -> dict:
    """QDQQuantizer arguments for a recipe (the `extra_options` keys are those of ORT's quantize_static)."""
    from onnxruntime.quantization import QuantType

    if recipe.weights != "s8":
        raise KilnError(f"recipe {recipe.name!r}: weights {recipe.weights!r} are not supported", "use s8")
    return {"weight_type": QuantType.QInt8,
            "activation_type": QuantType.QUInt8 if recipe.activations == "u8" else QuantType.QInt8,
            "per_channel": recipe.per_channel,
            "extra_options": {"ActivationSymmetric": recipe.symmetric_activations, "WeightSymmetric": True,
                              "QuantizeBias": not recipe.bias_float}}


def load_ranges(path: Path) -> dict:
    """ranges.json as written by calibrate, checked for shape."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if not all(isinstance(r["min"], float) and isinstance(r["max"], float) and math.isfinite(r["min"])
                   and math.isfinite(r["max"]) for r in doc["tensors"].values()):
            raise TypeError("min/max must be finite numbers")
    except FileNotFoundError:
        raise KilnError(f"{path}: calibration ranges not found",
                        f"run calibrate first (dvc repro {address('calibrate')})") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise KilnError(f"{path}: not a valid ranges file ({e.__class__.__name__}: {e})",
                        f"rebuild it: dvc repro -f {address('calibrate')}") from None
    return doc


def tensors_data(ranges: dict[str, dict[str, float]]):
    """Precomputed ranges → ORT's TensorsData, as its MinMax calibrator would have returned them."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    return TensorsData(CalibrationMethod.MinMax, {name: TensorData(lowest=np.float32(r["min"]),
                                                                   highest=np.float32(r["max"]))
                                                  for name, r in sorted(ranges.items())})


def quantize_graph(pre: Path, ranges: dict[str, dict[str, float]], recipe: Recipe, dest: Path) -> dict[str, int]:
    """QDQ-quantize the pre-processed graph `pre` with precomputed `ranges` → `dest`; returns range coverage."""
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

    model = load_model_with_shape_infer(pre)     # what quantize_static does; marks the model as shape-inferred
    names = {n.name for n in model.graph.node}
    unknown = [n for n in recipe.float_nodes if n not in names]
    if unknown:
        raise KilnError(f"recipe {recipe.name!r}: float_nodes {unknown} are not nodes of this graph",
                        "take the names from `kiln compare` or the debug-precision@ report (pre-processed graph)")
    needed = calibration_tensors(model)
    missing = [t for t in needed if t not in ranges]
    if missing:
        raise KilnError(f"calibration ranges: no range for {len(missing)} of the graph's {len(needed)} activation "
                        f"tensors (e.g. {missing[0]!r})",
                        f"the ranges belong to another graph; rebuild: dvc repro -f {address('calibrate')}")
    opts = recipe_options(recipe)
    # QDQQuantizer is what quantize_static drives after calibrating; ORT has no public entry point that takes
    # precomputed ranges. Keyword arguments, ORT pinned in the lock, and tests/quant/test_calibrate_quantize.py fails
    # loudly if the signature changes.
    quantizer = QDQQuantizer(model=model, per_channel=opts["per_channel"], reduce_range=recipe.reduce_range,
                             weight_qType=opts["weight_type"], activation_qType=opts["activation_type"],
                             tensors_range=tensors_data(ranges), nodes_to_quantize=None,
                             nodes_to_exclude=list(recipe.float_nodes) or None,
                             op_types_to_quantize=quantizable_op_types(), extra_options=opts["extra_options"])
    try:
        quantizer.quantize_model()
    except ValueError as e:
        raise KilnError(f"QDQ quantization failed: {str(e).splitlines()[0]}",
                        "the ranges do not cover the graph; rebuild: "
                        f"dvc repro -f {address('calibrate')}") from None
    # quantize_model() appends Q/DQ nodes at the end of the graph; ORT's save_model_to_file sorts it topologically
    # (what quantize_static does). onnx.save_model on `quantized` would write a graph the ONNX checker rejects.
    quantizer.model.save_model_to_file(str(dest))
    try:
        onnx.checker.check_model(str(dest), full_check=True)
    except onnx.checker.ValidationError as e:
        raise KilnError(f"the quantized graph is invalid: {str(e).splitlines()[0]}",
                        "ONNX Runtime's quantizer produced a broken graph; check its version") from None
    return {"graph_tensors": len(needed), "with_range": len(needed) - len(missing)}
