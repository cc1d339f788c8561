"""calibrate@<model>: per-tensor activation ranges of the FP32 ONNX over the calibration set, streamed in batches.

The ranges belong to the graph that `quantize` actually quantizes: ONNX Runtime's `quant_pre_process` (symbolic +
ONNX shape inference and ORT's basic optimizer, which folds the affine Mul/Add into each Conv and so renames or
removes tensors). So the stage pre-processes the export into a temporary directory, calibrates that graph, and records
the pre-processed graph's xxh3-128 in `ranges.json`; `quantize` repeats the deterministic pre-processing and refuses
ranges whose graph digest differs. That keeps this artifact a few kilobytes instead of a second 22 MB model.

Memory is bounded by `calibrate.batch`, never by the set size: two streamed passes (min/max, then |x| histograms)
give every candidate of `calibrate.candidates` — minmax, percentile-<p>, entropy (TensorRT's KL search) — from the
same counts (pipeline/quant/calibration.py holds the maths and why).

The choice is data, not habit: each candidate's ranges quantize the graph with recipe `calibrate.select_recipe`
(the quantize stage's own code), the QDQ model runs as float arithmetic on ONNX Runtime (pipeline/portable.py: the
same choice on every CPU; each engine's own int8 kernels are gated by validate@) through the model's face-task
gate (validate@'s own metrics and limits: the embedder's golden cosine / identities / decisions, the detector
cascade for an MTCNN net), and the best one is kept — passing before failing, then the gate's key metric
(the role's key metric, pipeline/roles/), then the order of `candidates` (pipeline/quant/selection.py). ranges.json
holds every candidate's ranges and `tensors`, the chosen ones (what quantize@ reads); selection.json holds every
candidate's gate result and the rule.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, samples, stage
from pipeline.errors import KilnError
from pipeline.manifest import (atomic_dir, build_manifest, input_ref, manifest_path, read_verified, write_json_atomic,
                               write_manifest)
from pipeline.quant.calibration import (DIFFERS_REL, MAX_CLIPPED, PREPROCESS, QUANTIZED_LEVELS, SMOOTHING,
                                        compute_ranges, preprocess, quantizable_op_types)
from pipeline.quant.selection import Trial, choose, judge
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "calibrate", "pipeline.stages.calibrate",
    "activation ranges of the FP32 ONNX on the calibration set (streamed), each candidate method judged by the "
    "face-task gate; the best is reused by every recipe/target",
    keys=lambda cfg: list(cfg.quantize.models),
    deps=lambda cfg, key: list(dict.fromkeys([paths.export(key).as_posix(), *samples.deps(cfg, key, "calibration"),
                                              paths.golden(key).as_posix(), *samples.deps(cfg, key, "golden")])),
    params=lambda cfg, key: ["calibrate", f"quantize.recipes.{cfg.calibrate.select_recipe}", "validate",
                             f"models.{key}", *samples.params(cfg, key)],
    dynamic=lambda cfg, key: roles.modules(cfg.model(key).samples, gate=True),
    outs=lambda cfg, key: [stage.Out(paths.calibration(key).as_posix())],
    portable=True,
    help="stream the calibration set through the ONNX and store activation ranges")


@dataclass(frozen=True)
class CalibrationResult:
    directory: Path
    method: str                    # the chosen candidate
    tensors: int
    samples: int
    differs_fraction: float        # share of tensors whose chosen range differs from min/max by > 1 %
    seconds: dict[str, float]      # per pass
    trials: list[Trial]
    metric: str                    # the gate's key metric that ranked them


def run(cfg: Config, model_name: str, root: Path = Path("."), progress: Callable[[str], None] = print
        ) -> CalibrationResult:
    """Calibrate `model_name`'s export on the calibration set → ranges.json + manifest."""
    ccfg = cfg.calibrate
    cfg.model(model_name)
    export_dir = paths.export(model_name, root)
    export_manifest = manifest_path(export_dir, model_name)
    read_verified(export_manifest)                     # a modified export is refused, not calibrated
    feeds = samples.stream(cfg, model_name, "calibration", root, batch=ccfg.batch)
    label = f"calibrate@{model_name}"
    out = paths.calibration(model_name, root)
    with tempfile.TemporaryDirectory(prefix="kiln-calibrate-") as tmp, atomic_dir(out) as d:
        pre = Path(tmp) / "preprocessed.onnx"
        graph_digest = preprocess(export_dir / paths.ONNX_FILE, pre)
        stats, seconds = compute_ranges(pre, feeds, ccfg, progress, label)
        if stats["samples"] == 0:
            raise KilnError(f"{label}: the calibration photos gave no inputs for this graph",
                            "check data.photos: the reference detector must find faces in them")
        t0 = time.perf_counter()
        read_verified(manifest_path(paths.golden(model_name, root), model_name))
        trials = judge(cfg, model_name, pre, stats["candidates"], stats["minmax"], root, progress, label)
        seconds["judge"] = round(time.perf_counter() - t0, 3)
        role = samples.role(cfg, model_name)
        metric, sign = role.key_metric, role.direction
        best = choose(trials, metric, sign)
        ranges = {"method": best.method, "tensors": stats["candidates"][best.method], "minmax": stats["minmax"],
                  "candidates": stats["candidates"], "samples": stats["samples"], "graph_xxh3_128": graph_digest}
        write_json_atomic(d / "ranges.json", ranges)
        selection = {"recipe": ccfg.select_recipe, "metric": metric, "higher_is_better": sign > 0,
                     "rule": "passing before failing, then the key metric, then the order of calibrate.candidates",
                     "chosen": best.method, "passed": best.passed,
                     "trials": [{"method": t.method, "passed": t.passed, "failures": t.failures,
                                 "tensors_differing_from_minmax": t.differs_from_minmax, "metrics": t.metrics}
                                for t in trials]}
        write_json_atomic(d / "selection.json", selection)
        n, changed = len(ranges["tensors"]), best.differs_from_minmax
        results = {"method": best.method, "tensors": n, "samples": ranges["samples"],
                   "graph_xxh3_128": graph_digest,
                   "differs_from_minmax": {"rel_threshold": DIFFERS_REL, "tensors": changed,
                                           "fraction": round(changed / n, 6)},
                   "selection": {"recipe": ccfg.select_recipe, "metric": metric, "chosen": best.method,
                                 "chosen_passes_gate": best.passed,
                                 "candidates": {t.method: {"passed": t.passed, metric: t.metrics.get(metric)}
                                                for t in trials}}}
        build = {"candidates": list(ccfg.candidates), "select_recipe": ccfg.select_recipe, "preprocess": PREPROCESS,
                 "op_types": quantizable_op_types(), "batch": ccfg.batch,
                 "judged_on": "onnxruntime CPU, basic graph optimizations (QDQ as float arithmetic)"}
        if any(m != "minmax" for m in ccfg.candidates):
            build.update(bins=ccfg.bins, histogram="abs")
        if "entropy" in ccfg.candidates:
            build.update(quantized_levels=QUANTIZED_LEVELS, smoothing=SMOOTHING, max_clipped=MAX_CLIPPED,
                         exact_zeros="excluded")
        inputs = [input_ref("onnx", export_manifest, root),
                  *samples.inputs(cfg, model_name, "calibration", root),
                  input_ref("golden", manifest_path(paths.golden(model_name, root), model_name), root),
                  *samples.inputs(cfg, model_name, "golden", root)]
        unique = list({json.dumps(i, sort_keys=True): i for i in inputs}.values())
        write_manifest(d, build_manifest(
            kind="calibration", name=model_name, model=model_name, directory=d,
            files=[d / "ranges.json", d / "selection.json"], inputs=unique, build=build, results=results,
            **STAGE.identity(cfg, model_name, root)))
    return CalibrationResult(out, best.method, n, ranges["samples"], changed / n, seconds, trials, metric)


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        t0 = time.perf_counter()
        r = run(args.cfg, args.key)
        run_.record["seconds_per_pass"] = r.seconds
        chosen = next(t for t in r.trials if t.method == r.method)
        print(f"calibrate@{args.key}: chose {r.method} by the face-task gate ({r.metric} "
              f"{chosen.metrics.get(r.metric)}, {'passes' if chosen.passed else 'fails'}) of "
              f"{len(r.trials)} candidates; ranges of {r.tensors} tensors over {r.samples} samples in "
              f"{time.perf_counter() - t0:.1f} s → {r.directory / 'ranges.json'}")
        print(f"  {r.differs_fraction:.0%} of the tensors' chosen ranges differ from plain min/max by > 1 %")
        return 0

    return stage.main(STAGE, body, argv, key_help="model name from quantize.models (e.g. embedder)")


if __name__ == "__main__":
    sys.exit(main())
