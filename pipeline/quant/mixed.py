"""`kiln mixed <model> <recipe>`: the smallest set of nodes to keep in float so the INT8 model passes its real gate.

Starting from the recipe's full INT8 QDQ model (the stored calibration, the quantize stage's own code), nodes are
left in float one at a time in sensitivity order until the model's face-task gate — `validate@`'s own metrics and
limits: the embedder's golden cosine / identities / decisions, the detector cascade for an MTCNN net, the aligner's
pixel error — passes, then the search stops. Every candidate model runs on ONNX Runtime's CPU kernels, as the
ort-cpu engine would.

Sensitivity, computed once:
* `gate` (default): each quantizable node alone in float, judged by the gate itself (failures, then the gate's
  key metric). Costs one quantize + one gate per node: O-Net's 19 nodes take about a minute.
* `snr`: the layer-wise report's ranking (`kiln compare`: lowest own SNR first) — cheap, but blind to what the
  gate sees: for O-Net it points at the dense layers while the node that moves boxes is the final Softmax.

The result is a recipe to put in params.yaml (`float_nodes`, `models`), never applied silently: the search is
exploration, the recipe is the reviewed, reproducible artifact (`quantize@` builds it, `validate@` gates it).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.dvcfiles import address
from pipeline.errors import KilnError
from pipeline.manifest import manifest_path, read_verified

if TYPE_CHECKING:
    from pipeline.config import Config

@dataclass(frozen=True)
class Trial:
    float_nodes: tuple[str, ...]
    metrics: dict
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class MixedResult:
    model: str
    recipe: str
    full_int8: Trial
    ranking: list[str]
    trials: list[Trial] = field(default_factory=list)
    chosen: tuple[str, ...] | None = None       # None: no set within max_float passed

    def to_json(self) -> dict:
        return {"model": self.model, "recipe": self.recipe, "full_int8": dataclasses.asdict(self.full_int8),
                "ranking": self.ranking, "trials": [dataclasses.asdict(t) for t in self.trials],
                "chosen": list(self.chosen) if self.chosen is not None else None}


def greedy(ranking: list[str], evaluate: Callable[[tuple[str, ...]], Trial], max_float: int) -> tuple[list[Trial],
                                                                                                    tuple | None]:
    """Add nodes in ranking order, evaluating after each, until one passes (then stop) or max_float is reached."""
    trials, chosen = [], ()
    for node in ranking[:max_float]:
        chosen = (*chosen, node)
        t = evaluate(chosen)
        trials.append(t)
        if t.passed:
            return trials, chosen
    return trials, None


def search(cfg: Config, model: str, recipe_name: str, root: Path = Path("."), max_float: int = 8, rank: str = "gate",
           progress: Callable[[str], None] = print, ranking: list[str] | None = None) -> MixedResult:
    """The search; `ranking` given skips computing one (its names must be nodes of the pre-processed graph)."""
    import onnx

    from pipeline.compare import compare
    from pipeline.gates.evaluate import OnnxRunner, evaluate_model
    from pipeline.quant.calibration import preprocess, quantizable_op_types
    from pipeline.quant.qdq import load_ranges, quantize_graph
    from pipeline.roles import registry as roles
    from pipeline.samples import stream

    if model not in cfg.quantize.models:
        raise KilnError(f"{cfg.source}: {model!r} is not in quantize.models", "quantize it first")
    if recipe_name not in cfg.recipes:
        raise KilnError(f"{cfg.source}: quantize.recipes has no {recipe_name!r}",
                        f"known: {', '.join(sorted(cfg.recipes))}")
    if rank not in ("gate", "snr"):
        raise KilnError(f"rank {rank!r} is not a sensitivity ranking", "use gate or snr")
    base = cfg.recipes[recipe_name]
    export_dir, cal_dir = paths.export(model, root), paths.calibration(model, root)
    read_verified(manifest_path(export_dir, model))
    read_verified(manifest_path(cal_dir, model))
    role = roles.get(cfg.model(model).samples)
    metric, sign = role.key_metric, role.direction

    with tempfile.TemporaryDirectory(prefix="kiln-mixed-") as tmp:
        work = Path(tmp)
        pre = work / "preprocessed.onnx"
        digest = preprocess(export_dir / paths.ONNX_FILE, pre)
        doc = load_ranges(cal_dir / "ranges.json")
        if doc.get("graph_xxh3_128") != digest:
            raise KilnError(f"{cal_dir / 'ranges.json'}: ranges belong to another graph",
                            f"recalibrate: dvc repro -f {address(f'calibrate@{model}')}")
        ops = set(quantizable_op_types())
        candidates = [n.name for n in onnx.load(str(pre)).graph.node if n.op_type in ops and n.name]
        cache: dict[tuple[str, ...], Trial] = {}

        def evaluate(nodes: tuple[str, ...]) -> Trial:
            key = tuple(sorted(nodes))
            if key not in cache:
                dest = work / "candidate.onnx"
                recipe = dataclasses.replace(base, float_nodes=tuple(nodes))
                quantize_graph(pre, doc["tensors"], recipe, dest)
                metrics, failures, _, _ = evaluate_model(cfg, model, OnnxRunner(dest), root)
                cache[key] = Trial(tuple(nodes), {k: v for k, v in metrics.items() if not isinstance(v, list)},
                                   failures)
                progress(f"  float {list(nodes) or 'none'}: {metric} {metrics.get(metric)}, "
                         f"{'pass' if not failures else 'fail: ' + '; '.join(failures)}")
            return cache[key]

        full = evaluate(())
        result = MixedResult(model, recipe_name, full, [])
        if full.passed:
            result.chosen = ()
            return result
        if ranking is not None:
            unknown = [n for n in ranking if n not in candidates]
            if unknown:
                raise KilnError(f"{unknown} are not quantizable nodes of {model}'s graph",
                                "take names from `kiln compare` or the debug-precision@ report")
        elif rank == "gate":
            singles = {c: evaluate((c,)) for c in candidates}
            ranking = sorted(candidates, key=lambda c: (len(singles[c].failures),
                                                         -sign * singles[c].metrics.get(metric, 0.0)))
        else:
            quantize_graph(pre, doc["tensors"], base, work / "full.onnx")
            c = compare(pre, work / "full.onnx", stream(cfg, model, "golden", root, 16), threads=1, model=model)
            by_snr = {r.name: r.own_snr_db for r in [*c.layers, *c.outputs]}
            producer = {o: n.name for n in onnx.load(str(pre)).graph.node for o in n.output}
            ranked = sorted(by_snr, key=lambda t: by_snr[t])
            ranking = [producer[t] for t in ranked if producer.get(t) in candidates]
        result.ranking = ranking
        result.trials, result.chosen = greedy(ranking, evaluate, max_float)
        return result


def report(r: MixedResult) -> str:
    lines = [f"mixed@{r.model}-{r.recipe}: full INT8 {'passes' if r.full_int8.passed else 'fails'} its gate"
             + ("" if r.full_int8.passed else f" ({'; '.join(r.full_int8.failures)})")]
    if r.ranking:
        lines.append(f"sensitivity ranking (first 8): {r.ranking[:8]}")
    for t in r.trials:
        lines.append(f"  float {list(t.float_nodes)}: {'pass' if t.passed else 'fail'}")
    if r.chosen is None:
        lines.append("no float set within --max-float passes: see the trials above for the smallest sets tried")
    elif r.chosen:
        lines.append(f"float set that passes (greedy, in ranking order): {list(r.chosen)} — as a recipe in "
                     "params.yaml:")
        lines.append(f"  {r.recipe}-mixed: {{<the {r.recipe} recipe's keys>, models: [{r.model}], "
                     f"float_nodes: [{', '.join(r.chosen)}]}}")
    return "\n".join(lines)
