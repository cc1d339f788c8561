"""Choosing a calibration by the face-task gate: each candidate method's ranges quantize the graph with recipe
`calibrate.select_recipe` (the quantize stage's own code), the QDQ model runs through the model's gate (validate@'s
own metrics and limits), and the best one is kept — passing before failing, then the gate's key metric (its role's
key_metric), then the order of `calibrate.candidates`.

The QDQ model is judged as its quantize/dequantize arithmetic in float (pipeline/portable.py `ort_session`), not on
this host's int8 kernels: the ranges are shared by every host and every target, so the choice must not depend on
the CPU that made it (int8 kernels round differently with and without VNNI). Each INT8 engine is still gated on its
own host's kernels by validate@.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.quant.calibration import differs
from pipeline.quant.qdq import quantize_graph

if TYPE_CHECKING:
    from pipeline.config import Config


@dataclass(frozen=True)
class Trial:
    """One candidate method's INT8 model on the model's face-task gate."""
    method: str
    metrics: dict[str, float]
    failures: list[str]
    differs_from_minmax: int       # tensors whose range moves an end by > DIFFERS_REL of max |x|

    @property
    def passed(self) -> bool:
        return not self.failures


def choose(trials: list[Trial], metric: str, sign: int) -> Trial:
    """Passing before failing, then the key metric (better first; a missing or non-finite one last), then order."""
    def key(i: int):
        v = trials[i].metrics.get(metric)
        v = float(v) if isinstance(v, (int, float)) and np.isfinite(v) else -np.inf * sign
        return (not trials[i].passed, -sign * v, i)

    return trials[min(range(len(trials)), key=key)]


def judge(cfg: Config, model_name: str, pre: Path, candidates: dict[str, dict], minmax: dict, root: Path,
          progress: Callable[[str], None] = print, label: str = "calibrate") -> list[Trial]:
    """Each candidate's INT8 model (recipe calibrate.select_recipe) through the model's face-task gate."""
    from pipeline.gates.evaluate import OnnxRunner, evaluate_model
    from pipeline.roles import registry as roles

    recipe = cfg.recipes[cfg.calibrate.select_recipe]
    metric = roles.get(cfg.model(model_name).samples).key_metric
    trials = []
    with tempfile.TemporaryDirectory(prefix="kiln-calibrate-judge-") as tmp:
        for method, ranges in candidates.items():
            dest = Path(tmp) / f"{method}.onnx"
            quantize_graph(pre, ranges, recipe, dest)
            metrics, failures, _, _ = evaluate_model(cfg, model_name, OnnxRunner(dest, portable=True), root)
            dest.unlink()
            trial = Trial(method, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()
                                   if isinstance(v, (int, float))}, failures, differs(ranges, minmax))
            trials.append(trial)
            progress(f"{label}: {method:>18}: {metric} {trial.metrics.get(metric)} — "
                     + ("pass" if trial.passed else "fail: " + "; ".join(failures)))
    return trials
