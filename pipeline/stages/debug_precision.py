"""debug-precision@<model>-<recipe>: the layer-wise FP32 vs INT8 report of every quantized model, as an artifact.

`kiln compare` (pipeline/compare.py) of the FP32 export against the recipe's QDQ model on the model's golden feed:
per intermediate tensor cosine, max |Δ|, SNR and the error the layer adds itself, the first layer below
MIN_SNR_DB and the worst layers. `layers.json` (a list of rows) beside its manifest, so a new calibration, recipe
or toolchain that moves a layer shows up as a diff of `layers.json`, and `dvc plots show` draws SNR against depth.
ONNX Runtime runs one thread here: the sums are then the same bytes on every run of one host.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import compare, paths, samples, stage
from pipeline.manifest import (build_manifest, input_ref, json_bytes, manifest_path, read_verified,
                               write_bytes_atomic, write_manifest)
from pipeline.quant.qdq import pairs
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config

MIN_SNR_DB = 20.0          # a tensor below this SNR is a bad layer (relative error power 1 %)
BATCH = 16
LAYERS_FILE = "layers.json"


STAGE = stage.Stage(
    "debug-precision", "pipeline.stages.debug_precision",
    "layer-wise FP32 vs INT8 report of a quantized model on its golden feed (SNR per layer, first bad layer)",
    keys=lambda cfg: list(pairs(cfg)),
    deps=lambda cfg, key: [paths.export(pairs(cfg)[key][0]).as_posix(),
                           paths.quantized(*pairs(cfg)[key]).as_posix(),
                           *samples.deps(cfg, pairs(cfg)[key][0], "golden")],
    params=lambda cfg, key: [f"quantize.recipes.{pairs(cfg)[key][1]}", *samples.params(cfg, pairs(cfg)[key][0])],
    dynamic=lambda cfg, key: roles.modules(cfg.model(pairs(cfg)[key][0]).samples),
    outs=lambda cfg, key: [stage.Out((paths.precision(key) / LAYERS_FILE).as_posix(), kind="plots",
                                     plot={"template": "linear", "x": "depth", "y": "snr_db",
                                           "title": "INT8 vs FP32: SNR (dB) of each layer by depth"}),
                           stage.Out(manifest_path(paths.precision(key), key).as_posix())],
    help="layer-wise FP32 vs INT8 report of a quantized model (SNR per layer, first bad one)")


@dataclass(frozen=True)
class PrecisionReport:
    directory: Path
    comparison: compare.Comparison


def run(cfg: Config, key: str, root: Path = Path(".")) -> PrecisionReport:
    model, recipe = pairs(cfg)[key]
    fp32_dir, int8_dir = paths.export(model, root), paths.quantized(model, recipe, root)
    fp32_manifest, int8_manifest = manifest_path(fp32_dir, model), manifest_path(int8_dir, key)
    read_verified(fp32_manifest)
    read_verified(int8_manifest)
    c = compare.compare(fp32_dir / paths.ONNX_FILE, int8_dir / paths.ONNX_FILE,
                        samples.stream(cfg, model, "golden", root, BATCH), MIN_SNR_DB, threads=1, model=model)
    doc = c.to_json()
    d = paths.precision(key, root)
    d.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(d / LAYERS_FILE, json_bytes(doc["layers"]))       # a list of rows: DVC plots reads it as is
    write_manifest(d, build_manifest(
        kind="precision-report", name=key, model=model, precision="int8", directory=d, files=[d / LAYERS_FILE],
        inputs=[input_ref("fp32", fp32_manifest, root), input_ref("int8", int8_manifest, root)],
        build={"compared": f"export@{model} vs quantize@{key}", "min_snr_db": MIN_SNR_DB, "feed": "golden",
               "batch": BATCH, "threads": 1},
        results={"first_bad": doc["first_bad"], "outputs": doc["outputs"], "worst": doc["worst"][:5],
                 "samples": c.samples, "layers": len(c.layers)},
        **STAGE.identity(cfg, key, root)))
    return PrecisionReport(d, c)


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        t0 = time.perf_counter()
        r = run(args.cfg, args.key)
        print(compare.report(r.comparison, 5))
        print(f"debug-precision@{args.key}: {r.directory} in {time.perf_counter() - t0:.1f} s")
        return 0

    return stage.main(STAGE, body, argv, key_help="<model>-<recipe> from quantize")


if __name__ == "__main__":
    sys.exit(main())
