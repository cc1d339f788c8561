"""The leaderboard's rows: per graph, every engine's speed, accuracy and fallbacks, and the fastest that passed.

One row per engine (model × target × precision) from the bench (one interleaved run per model), the engine's
validation verdict, its bench verdict and its compile audit; `markdown` renders them as the table leaderboard.md and
the README show. Every timing is one host class's (the bench report's `host_class`), and the table says which. An
INT8 engine whose bench verdict is `not-faster-here` (it does not beat its FP32 sibling by the margin, with
confidence, on that host class) is never the winner; its note says `not faster here (<host class>)`.
The leaderboard stage (pipeline/stages/leaderboard.py) writes them; `kiln report` (pipeline/report/page.py) draws them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, tables
from pipeline.config import PRECISIONS
from pipeline.manifest import manifest_path
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config

EAGER = "pytorch-eager"
BASELINE = ("ort-cpu", "fp32")                 # the speed-up every row is also measured against
NOT_FASTER = "not-faster-here"                 # = gates/benchgate.NOT_FASTER (not imported: the stage's closure)


# Graphs a face system feeds a batch per call: MTCNN runs R-Net and O-Net once per photo on every candidate crop (≈ 50
# R-Net crops in a one-face portrait, ≈ 160 in a three-face frame). Ranked at batch 1 they would be ranked by per-call
# overhead, which is not what they pay there (on a Zen 5 the batch-1 winner ran R-Net's crops 1.5–2.0× slower than
# the batch-8 one), so they are ranked at the largest benched batch. Every other graph runs once per photo (P-Net
# once per pyramid level) or per face (pipeline/roles/mtcnn.py sets `crop_fed`).
def ranked_at(cfg: Config, model: str) -> int:
    """The batch `model`'s engines are ranked at: the one a face system feeds it per call (see the role's crop_fed)."""
    return max(cfg.bench.batches) if roles.get(cfg.model(model).samples).crop_fed else 1


def models(cfg: Config) -> list[str]:
    """The models that have engines: one leaderboard section each."""
    return [m for m in cfg.models if cfg.engines_of(m)]


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def rows(cfg: Config, root: Path = Path(".")) -> tuple[list[dict], dict[str, str]]:
    out, winners = [], {}
    for model in models(cfg):
        bench = _read(paths.bench(model, root) / paths.BENCH_FILE) or {"engines": {}, "not_run": {}}
        timed, host_class = bench["engines"], bench.get("host_class")
        role = roles.get(cfg.model(model).samples)
        metric, label = role.key_metric, role.accuracy_label
        base = next((e.name for e in cfg.engines_of(model) if (e.target, e.precision) == BASELINE), None)
        at = ranked_at(cfg, model)
        model_rows = []
        for e in cfg.engines_of(model):
            t = timed.get(e.name, {})
            verdict = _read(paths.validation(e.name, root) / paths.VALIDATION_FILE) or {}
            built = _read(manifest_path(paths.engine(e.name, root), e.name))
            audit = (built or {}).get("results", {}).get("audit", {})
            gate = t.get("bench_gate")
            note = bench.get("not_run", {}).get(e.name, "" if t else "not benched")
            if gate == NOT_FASTER:
                note = "; ".join(x for x in (f"not faster here ({host_class or 'unknown host class'})", note) if x)
            row = {"row": f"{model}/{e.target}/{e.precision}", "model": model, "engine": e.name,
                   "host_class": host_class, "bench_gate": gate,
                   "target": e.target, "precision": e.precision, "recipe": e.recipe,
                   "b1_p50_ms": t.get("b1_p50_ms"), "b8_p50_ms": t.get("b8_p50_ms"),
                   "b1_speedup_vs_eager": t.get("b1_speedup_vs_eager"),
                   "b8_speedup_vs_eager": t.get("b8_speedup_vs_eager"),
                   "accuracy_metric": label, "accuracy": (verdict.get("metrics") or {}).get(metric),
                   "verdict": verdict.get("verdict", "missing"),
                   "fallback_nodes": audit.get("fallback_nodes"), "best": False, "ranked_at": at,
                   "b1_speedup_vs_fp32": t.get("b1_speedup_vs_fp32"), "b8_speedup_vs_fp32": t.get("b8_speedup_vs_fp32"),
                   "wins_by": None, "runner_up": None, "note": note}
            for b in (1, 8):
                mine, ref = t.get(f"b{b}_p50_ms"), (timed.get(base) or {}).get(f"b{b}_p50_ms") if base else None
                row[f"b{b}_speedup_vs_ort_fp32"] = round(ref / mine, 3) if mine and ref else None
            model_rows.append(row)
        key = f"b{at}_p50_ms"
        passing = sorted((r for r in model_rows if r["verdict"] == "pass" and r["bench_gate"] != NOT_FASTER
                          and timed.get(r["engine"], {}).get(key) is not None), key=lambda r: timed[r["engine"]][key])
        if passing:
            best = passing[0]
            best["best"] = True
            winners[model] = best["engine"]
            if len(passing) > 1:        # by how much: the runner-up's p50 over the winner's, same run
                best["runner_up"] = f"{passing[1]['target']}/{passing[1]['precision']}"
                best["wins_by"] = round(timed[passing[1]["engine"]][key] / timed[best["engine"]][key], 3)
        out.extend(sorted(model_rows, key=lambda r: (r["target"], PRECISIONS.index(r["precision"]))))
    return out, winners


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _won(r: dict) -> str:
    by = f", {r['wins_by']:.2f}× the next ({r['runner_up']})" if r.get("wins_by") else ""
    return f"fastest at batch {r['ranked_at']} that passes its gate on {r.get('host_class') or 'this host'}{by}"


def markdown(rows_: list[dict]) -> str:
    head = ["model", "target", "precision", "b1 p50 ms", "b8 p50 ms", "b1 × eager", "b8 × eager", "b1 × ORT FP32",
            "b8 × ORT FP32", "accuracy", "gate", "fallbacks", "note"]
    body = [[("**" + r["model"] + "**") if r["best"] else r["model"], r["target"], r["precision"] +
             (f" ({r['recipe']})" if r["recipe"] else ""), _f(r["b1_p50_ms"], ".2f"), _f(r["b8_p50_ms"], ".2f"),
             _f(r["b1_speedup_vs_eager"], ".2f"), _f(r["b8_speedup_vs_eager"], ".2f"),
             _f(r["b1_speedup_vs_ort_fp32"], ".2f"), _f(r["b8_speedup_vs_ort_fp32"], ".2f"),
             f"{r['accuracy_metric']} {_f(r['accuracy'], '.5g')}", r["verdict"],
             _f(r["fallback_nodes"], "d"),
             "; ".join(x for x in (_won(r) if r["best"] else "", r["note"]) if x)]
            for r in rows_]
    classes = sorted({r["host_class"] for r in rows_ if r.get("host_class")})
    where = f"host class {', '.join(classes)}" if classes else "this host (host class unrecorded)"
    return (f"# Who wins, per graph (measured on {where}, one bench run per model)\n\n"
            "Bold model: the fastest engine that passed its validation gate, at the batch a face system feeds the "
            "graph (1; R-Net and O-Net, fed every candidate crop in one call: the largest benched batch); an INT8 "
            "engine that does not beat its FP32 sibling by the bench margin with confidence on this host class is "
            "`not faster here` and never wins. "
            "× = speed-up (p50 ratio in "
            "the same interleaved run). Accuracy: the metric the model's gate reads (embedder: golden cosine min; "
            "MTCNN nets: box IoU min vs the reference cascade; aligner: pixel MAE).\n\n"
            + tables.markdown(head, body) + "\n")
