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

import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from pipeline import paths, samples, stage
from pipeline.dvcfiles import address
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, read_verified, write_manifest
from pipeline.quant.calibration import PREPROCESS, preprocess, quantizable_op_types
from pipeline.quant.contract import contract, inventory
from pipeline.quant.qdq import load_ranges, pairs, quantize_graph, recipe_options
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "quantize", "pipeline.stages.quantize", "INT8 QDQ ONNX from the stored calibration, one per recipe",
    keys=lambda cfg: list(pairs(cfg)),
    deps=lambda cfg, key: [paths.export(pairs(cfg)[key][0]).as_posix(),
                           paths.calibration(pairs(cfg)[key][0]).as_posix(),
                           paths.golden(pairs(cfg)[key][0]).as_posix(),
                           *samples.deps(cfg, pairs(cfg)[key][0], "golden")],
    params=lambda cfg, key: [f"quantize.recipes.{pairs(cfg)[key][1]}", *samples.params(cfg, pairs(cfg)[key][0])],
    dynamic=lambda cfg, key: roles.modules(cfg.model(pairs(cfg)[key][0]).samples),
    outs=lambda cfg, key: [stage.Out(paths.quantized(*pairs(cfg)[key]).as_posix())],
    portable=True,
    help="INT8 QDQ ONNX of <model>-<recipe> from the export and its calibration ranges")


@dataclass(frozen=True)
class QuantizeResult:
    onnx_path: Path
    quantized_ops: dict[str, int]     # op type → nodes computing on DequantizeLinear inputs
    float_nodes: list[str]            # "OpType name" of nodes with no DequantizeLinear input
    golden: dict[str, float]
    ranges: dict[str, int]


def run(cfg: Config, model_name: str, recipe_name: str, root: Path = Path(".")) -> QuantizeResult:
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
                            f"recalibrate: dvc repro -f {address(f'calibrate@{model_name}')}")
        onnx_path = d / "model.onnx"
        coverage = quantize_graph(pre, doc["tensors"], recipe, onnx_path)
        inv = inventory(onnx.load(str(onnx_path)))
        coverage["quantized_activations"] = inv["quantize_linear"]
        problems = contract(recipe, inv)
        if problems:
            raise GateFailed(f"{label}: the quantized graph breaks recipe {recipe_name!r}: {'; '.join(problems)}",
                             "ONNX Runtime's quantizer changed behaviour; inspect the graph and the recipe")
        # informational: ORT CPU on the golden inputs vs the FP32 reference, golden@ (cosine / max |Δ|)
        from pipeline.gates.parity import parity
        from pipeline.gates.reference import load_reference

        _, reference = load_reference(paths.golden(model_name, root))
        par = parity(onnx_path, samples.feeds(cfg, model_name, "golden", root), reference)
        golden = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in par.items()}
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
              f"vs the FP32 reference (golden@) on {g['samples']} samples: min {g['cosine_min']:.5f}, "
              f"mean {g['cosine_mean']:.5f} (informational; validate gates)")
        return 0

    return stage.main(STAGE, body, argv, key_help="<model>-<recipe>, e.g. embedder-ort")


if __name__ == "__main__":
    sys.exit(main())
