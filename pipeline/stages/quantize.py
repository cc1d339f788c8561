"""quantize@<model>-<recipe>: an INT8 QDQ ONNX from the export and the calibrate stage's precomputed ranges.

The export is pre-processed exactly as `calibrate` did (ORT's `quant_pre_process`, deterministic) and the result
must have the graph digest recorded in ranges.json — otherwise the ranges name tensors of a different graph and the
stage stops. The ranges drive ORT's `QDQQuantizer` directly (as `quantize_static` does after its own calibration),
so no calibration data is read here.

Recipes (params `quantize.recipes`):

* `ort` — per-channel symmetric S8 weights, asymmetric U8 activations, int32 biases: ONNX Runtime CPU's fast path.
* `symmetric` — per-channel S8 weights, S8 activations with zero-point 0 (`ActivationSymmetric`), biases left float
  (`QuantizeBias: False`): the explicit-quantization form TensorRT accepts.

The quantized graph is inventoried (which nodes compute on dequantized inputs, which stayed float, Q/DQ counts,
activation zero points and bias types) and the recipe's contract is checked on it; a graph that breaks it fails the
stage. An informational golden-set cosine (ORT CPU vs the FP32 PyTorch reference) goes into the results; the gate
is the later validate stage.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline import paths, samples, stage
from pipeline.config import Recipe
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, read_verified, write_manifest
from pipeline.stages.calibrate import PREPROCESS, calibration_tensors, preprocess, quantizable_op_types


def pairs(cfg) -> dict[str, tuple[str, str]]:
    """`<model>-<recipe>` → (model, recipe) for every quantized model × recipe."""
    return {f"{m}-{r}": (m, r) for m in cfg.quantize.models for r, recipe in cfg.recipes.items()
            if recipe.models is None or m in recipe.models}


STAGE = stage.Stage(
    "quantize", "pipeline.stages.quantize", "INT8 QDQ ONNX from the stored calibration, one per recipe",
    keys=lambda cfg: list(pairs(cfg)),
    deps=lambda cfg, key: [paths.export(pairs(cfg)[key][0]).as_posix(),
                           paths.calibration(pairs(cfg)[key][0]).as_posix(),
                           paths.golden(pairs(cfg)[key][0]).as_posix(),
                           *samples.deps(cfg, pairs(cfg)[key][0], "golden")],
    params=lambda cfg, key: [f"quantize.recipes.{pairs(cfg)[key][1]}", *samples.params(cfg, pairs(cfg)[key][0])],
    outs=lambda cfg, key: [stage.Out(paths.quantized(*pairs(cfg)[key]).as_posix())])

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
_DTYPE_NAMES = {onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.INT8: "int8", onnx.TensorProto.INT32: "int32",
                onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}
_BIASED_OPS = ("Conv", "ConvTranspose", "Gemm")
_WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_ACTIVATION_TYPES = {"u8": onnx.TensorProto.UINT8, "s8": onnx.TensorProto.INT8}


@dataclass(frozen=True)
class QuantizeResult:
    onnx_path: Path
    quantized_ops: dict[str, int]     # op type → nodes computing on DequantizeLinear inputs
    float_nodes: list[str]            # "OpType name" of nodes with no DequantizeLinear input
    golden: dict[str, float]
    ranges: dict[str, int]


def _dtype(t: int) -> str:
    return _DTYPE_NAMES.get(t, onnx.TensorProto.DataType.Name(t).lower())


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
        doc = json.loads(Path(path).read_text())
        if not all(isinstance(r["min"], float) and isinstance(r["max"], float) and math.isfinite(r["min"])
                   and math.isfinite(r["max"]) for r in doc["tensors"].values()):
            raise TypeError("min/max must be finite numbers")
    except FileNotFoundError:
        raise KilnError(f"{path}: calibration ranges not found",
                        f"run calibrate first (dvc repro {stage.address('calibrate')})") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise KilnError(f"{path}: not a valid ranges file ({e.__class__.__name__}: {e})",
                        f"rebuild it: dvc repro -f {stage.address('calibrate')}") from None
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
                        f"the ranges belong to another graph; rebuild: dvc repro -f {stage.address('calibrate')}")
    opts = recipe_options(recipe)
    # QDQQuantizer is what quantize_static drives after calibrating; ORT has no public entry point that takes
    # precomputed ranges. Keyword arguments, ORT pinned in the lock, and tests/test_calibrate_quantize.py fails
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
                        f"dvc repro -f {stage.address('calibrate')}") from None
    # quantize_model() appends Q/DQ nodes at the end of the graph; ORT's save_model_to_file sorts it topologically
    # (what quantize_static does). onnx.save_model on `quantized` would write a graph the ONNX checker rejects.
    quantizer.model.save_model_to_file(str(dest))
    try:
        onnx.checker.check_model(str(dest), full_check=True)
    except onnx.checker.ValidationError as e:
        raise KilnError(f"the quantized graph is invalid: {str(e).splitlines()[0]}",
                        "ONNX Runtime's quantizer produced a broken graph; check its version") from None
    return {"graph_tensors": len(needed), "with_range": len(needed) - len(missing)}


def inventory(model: onnx.ModelProto) -> dict:
    """What a QDQ graph quantizes: DQ-fed vs float nodes, Q/DQ counts, activation zero points, weight/bias types."""
    inits = {i.name: i for i in model.graph.initializer}
    nodes = list(model.graph.node)
    dq_out = {n.output[0]: n for n in nodes if n.op_type == "DequantizeLinear"}
    quantized, floating, float_nodes = Counter(), Counter(), []
    for n in nodes:
        if n.op_type in QDQ_OPS:
            continue
        if any(i in dq_out for i in n.input):
            quantized[n.op_type] += 1
        else:
            floating[n.op_type] += 1
            float_nodes.append(f"{n.op_type} {n.name}")

    bias_slots = {n.input[2] for n in nodes if n.op_type in _BIASED_OPS and len(n.input) > 2 and n.input[2]}
    # weights: the constant input of a Conv / Gemm / MatMul; any other quantized constant (an elementwise Mul's
    # scalar in an imported graph's input scaling, a PRelu slope) ORT quantizes like an activation: `constant_types`
    weight_slots = {n.input[1] for n in nodes if n.op_type in _WEIGHTED_OPS and len(n.input) > 1}
    # Every activation QuantizeLinear / DequantizeLinear node: its zero point's type and whether it is 0.
    act_types, act_zero = Counter(), Counter()
    weight_types, constant_types, per_channel = Counter(), Counter(), 0
    for n in nodes:
        if n.op_type == "QuantizeLinear" or (n.op_type == "DequantizeLinear" and n.input[0] not in inits):
            zp = inits.get(n.input[2]) if len(n.input) > 2 else None
            act_types["none" if zp is None else _dtype(zp.data_type)] += 1
            act_zero["zero" if zp is None or not np.any(numpy_helper.to_array(zp)) else "nonzero"] += 1
        elif n.op_type == "DequantizeLinear" and n.output[0] not in bias_slots and n.output[0] not in weight_slots:
            constant_types[_dtype(inits[n.input[0]].data_type)] += 1
        elif n.op_type == "DequantizeLinear" and n.output[0] not in bias_slots:
            dtype = inits[n.input[0]].data_type
            weight_types[_dtype(dtype)] += 1
            scale = inits.get(n.input[1])
            per_channel += (dtype == onnx.TensorProto.INT8 and scale is not None
                            and numpy_helper.to_array(scale).size > 1)
    biases = Counter()
    for b in bias_slots:
        if b in dq_out:
            biases[_dtype(inits[dq_out[b].input[0]].data_type) if dq_out[b].input[0] in inits else "dq"] += 1
        elif b in inits:
            biases[_dtype(inits[b].data_type)] += 1
        else:
            biases["computed"] += 1
    return {"quantized_ops": dict(sorted(quantized.items())), "float_ops": dict(sorted(floating.items())),
            "float_nodes": float_nodes, "quantize_linear": sum(n.op_type == "QuantizeLinear" for n in nodes),
            "dequantize_linear": sum(n.op_type == "DequantizeLinear" for n in nodes),
            "activation_qdq_types": dict(sorted(act_types.items())),
            "activation_qdq_zero_points": dict(sorted(act_zero.items())),
            "weight_types": dict(sorted(weight_types.items())), "per_channel_weights": int(per_channel),
            **({"constant_types": dict(sorted(constant_types.items()))} if constant_types else {}),
            "bias_types": dict(sorted(biases.items()))}


def contract(recipe: Recipe, inv: dict) -> list[str]:
    """How the quantized graph breaks the recipe (empty = it keeps it)."""
    problems = []
    act = _dtype(_ACTIVATION_TYPES[recipe.activations])
    if set(inv["activation_qdq_types"]) != {act}:
        problems.append(f"activation Q/DQ types are {inv['activation_qdq_types']}, the recipe wants only {act}")
    if recipe.symmetric_activations and inv["activation_qdq_zero_points"].get("nonzero", 0):
        problems.append(f"{inv['activation_qdq_zero_points']['nonzero']} activation Q/DQ zero points are not 0")
    if set(inv["weight_types"]) != {"int8"}:
        problems.append(f"weights are {inv['weight_types']}, the recipe wants int8")
    if recipe.per_channel and inv["per_channel_weights"] != sum(inv["weight_types"].values()):
        problems.append(f"only {inv['per_channel_weights']} of {sum(inv['weight_types'].values())} weights are "
                        "quantized per channel")
    want_bias = "float32" if recipe.bias_float else "int32"
    if set(inv["bias_types"]) - {want_bias}:
        problems.append(f"biases are {inv['bias_types']}, the recipe wants {want_bias}")
    if not sum(inv["quantized_ops"].values()):
        problems.append("no node computes on quantized inputs")
    return problems


def golden_check(cfg, onnx_path: Path, root: Path, model_name: str) -> dict[str, float]:
    """Informational: ORT CPU on the golden inputs vs the FP32 reference, golden@ (cosine / max |Δ|)."""
    from pipeline.stages.export import parity
    from pipeline.stages.golden import load_reference

    _, reference = load_reference(paths.golden(model_name, root))
    par = parity(onnx_path, samples.feeds(cfg, model_name, "golden", root), reference)
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in par.items()}


def run(cfg, model_name: str, recipe_name: str, root: Path = Path(".")) -> QuantizeResult:
    cfg.model(model_name)
    if recipe_name not in cfg.recipes:
        raise KilnError(f"{cfg.source}: quantize.recipes: no recipe named {recipe_name!r}",
                        f"known recipes: {', '.join(sorted(cfg.recipes))}")
    recipe = cfg.recipes[recipe_name]
    export_dir, cal_dir = paths.export(model_name, root), paths.calibration(model_name, root)
    cal_manifest = manifest_path(cal_dir, model_name)
    read_verified(manifest_path(export_dir, model_name))     # a modified input is refused, not quantized
    read_verified(cal_manifest)
    inputs = [input_ref("onnx", manifest_path(export_dir, model_name), root),
              input_ref("calibration", cal_manifest, root)]
    label = f"quantize@{model_name}-{recipe_name}"
    out = paths.quantized(model_name, recipe_name, root)
    with tempfile.TemporaryDirectory(prefix="kiln-quantize-") as tmp, atomic_dir(out) as d:
        pre = Path(tmp) / "preprocessed.onnx"
        digest = preprocess(export_dir / "model.onnx", pre)
        doc = load_ranges(cal_dir / "ranges.json")
        if doc.get("graph_xxh3_128") != digest:
            raise KilnError(f"{cal_dir / 'ranges.json'}: ranges were computed on pre-processed graph "
                            f"{doc.get('graph_xxh3_128')}, this export pre-processes to {digest}",
                            f"recalibrate: dvc repro -f {stage.address(f'calibrate@{model_name}')}")
        onnx_path = d / "model.onnx"
        coverage = quantize_graph(pre, doc["tensors"], recipe, onnx_path)
        inv = inventory(onnx.load(str(onnx_path)))
        coverage["quantized_activations"] = inv["quantize_linear"]
        problems = contract(recipe, inv)
        if problems:
            raise GateFailed(f"{label}: the quantized graph breaks recipe {recipe_name!r}: {'; '.join(problems)}",
                             "ONNX Runtime's quantizer changed behaviour; inspect the graph and the recipe")
        golden = golden_check(cfg, onnx_path, root, model_name)
        from onnxruntime import __version__ as ort_version

        opts = recipe_options(recipe)
        build = {"recipe": asdict(recipe), "onnxruntime": ort_version, "format": "QDQ",
                 "reduce_range": recipe.reduce_range,
                 "weight_type": opts["weight_type"].name, "activation_type": opts["activation_type"].name,
                 "extra_options": opts["extra_options"], "op_types": quantizable_op_types(),
                 "preprocess": PREPROCESS, "calibration_method": doc.get("method")}
        results = {**inv, "ranges": coverage, "recipe_contract": "kept", "golden": golden,
                   "calibration_graph_xxh3_128": digest}
        write_manifest(d, build_manifest(
            kind="onnx", name=f"{model_name}-{recipe_name}", model=model_name, precision="int8", directory=d,
            files=[onnx_path], inputs=inputs, build=build, results=results,
            **STAGE.identity(cfg, f"{model_name}-{recipe_name}", root)))
    return QuantizeResult(out / paths.ONNX_FILE, inv["quantized_ops"], inv["float_nodes"], golden, coverage)


def main(argv: list[str] | None = None) -> int:
    import time

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        model, recipe = pairs(args.cfg)[args.key]
        r = run(args.cfg, model, recipe)
        g = r.golden
        print(f"quantize@{args.key}: {r.onnx_path} ({r.onnx_path.stat().st_size / 1e6:.1f} MB) in "
              f"{time.perf_counter() - t0:.1f} s")
        print(f"  {sum(r.quantized_ops.values())} nodes on quantized inputs ("
              + ", ".join(f"{k}×{v}" for k, v in r.quantized_ops.items()) + f"); {len(r.float_nodes)} float"
              + (f" ({', '.join(r.float_nodes)})" if r.float_nodes else ""))
        print(f"  ranges for {r.ranges['with_range']}/{r.ranges['graph_tensors']} activation tensors; golden cosine "
              f"vs the FP32 reference (golden@) on {g['samples']} samples: min {g['cosine_min']:.5f}, mean {g['cosine_mean']:.5f} "
              "(informational; validate gates)")
        return 0

    return stage.main(STAGE, body, argv, key_help="<model>-<recipe>, e.g. embedder-ort")


if __name__ == "__main__":
    sys.exit(main())
