"""leaderboard: per graph, which compiler and precision win on this host, and at what accuracy — the headline answer.

One row per engine (model × target × precision) from the bench (one interleaved run per model), the engine's
validation verdict and its compile audit: p50 at batch 1 and 8, speed-up over PyTorch eager and over the model's
ONNX Runtime FP32 engine (same run), the accuracy metric its gate reads, the fallback count. Per model the fastest
engine that passed its gate is marked, at the batch a face system feeds that graph (`ranked_at`: 1, or the largest
benched batch for the nets that get every candidate crop in one call); an engine that failed its gate, or was not
run here, can never be marked. Writes artifacts/reports/leaderboard.json (flat rows, a DVC plot) and leaderboard.md
(the README's table).
Timings are the bench's records, so both files are uncached like the bench itself.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline import paths, stage, tables
from pipeline.config import PRECISIONS
from pipeline.manifest import json_bytes, manifest_path, write_bytes_atomic

EAGER = "pytorch-eager"
BASELINE = ("ort-cpu", "fp32")                 # the speed-up every row is also measured against
ACCURACY = {"chips": ("cosine_min", "golden cosine min"), "aligner": ("pixel_mae", "pixel MAE"),
            "pnet": ("box_iou_min", "box IoU min"), "rnet": ("box_iou_min", "box IoU min"),
            "onet": ("box_iou_min", "box IoU min"), "retinaface": ("box_iou_min", "box IoU min")}


# Graphs a face system feeds a batch per call: MTCNN runs R-Net and O-Net once per photo on every candidate crop (≈ 50
# R-Net crops in a one-face portrait, ≈ 160 in a three-face frame). Ranked at batch 1 they would be ranked by per-call
# overhead, which is not what they pay there (on a Zen 5 the batch-1 winner ran R-Net's crops 1.5–2.0× slower than
# the batch-8 one), so they are ranked at the largest benched batch. Every other graph runs once per photo (P-Net
# once per pyramid level) or per face.
CROP_FED = ("rnet", "onet")


def ranked_at(cfg, model: str) -> int:
    """The batch `model`'s engines are ranked at: the one a face system feeds it per call (see CROP_FED)."""
    return max(cfg.bench.batches) if cfg.model(model).samples in CROP_FED else 1


def _models(cfg) -> list[str]:
    return [m for m in cfg.models if cfg.engines_of(m)]


STAGE = stage.Stage(
    "leaderboard", "pipeline.stages.leaderboard",
    "per graph: every engine's speed, accuracy and fallbacks side by side; the fastest that passes its gate marked",
    deps=lambda cfg, key: [*((paths.bench(m) / paths.BENCH_FILE).as_posix() for m in _models(cfg)),
                           *(paths.validation(e).as_posix() for e in cfg.engines),
                           *(paths.engine(e).as_posix() for e in cfg.engines)],
    params=lambda cfg, key: ["engines"],
    outs=lambda cfg, key: [stage.Out((paths.reports() / "leaderboard.md").as_posix(), cache=False),
                           stage.Out((paths.reports() / "leaderboard.json").as_posix(), cache=False, kind="plots",
                                     plot={"template": "bar_horizontal", "x": "b1_speedup_vs_ort_fp32", "y": "row",
                                           "title": "batch-1 speed-up over ONNX Runtime FP32 (same run)"})])


@dataclass(frozen=True)
class Leaderboard:
    rows: list[dict]
    winners: dict[str, str]       # model → engine name (absent: no engine passed its gate here)
    json_path: Path
    md_path: Path


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def rows(cfg, root: Path = Path(".")) -> tuple[list[dict], dict[str, str]]:
    out, winners = [], {}
    for model in _models(cfg):
        bench = _read(paths.bench(model, root) / paths.BENCH_FILE) or {"engines": {}, "not_run": {}}
        timed = bench["engines"]
        metric, label = ACCURACY[cfg.model(model).samples]
        base = next((e.name for e in cfg.engines_of(model) if (e.target, e.precision) == BASELINE), None)
        at = ranked_at(cfg, model)
        model_rows = []
        for e in cfg.engines_of(model):
            t = timed.get(e.name, {})
            verdict = _read(paths.validation(e.name, root) / paths.VALIDATION_FILE) or {}
            built = _read(manifest_path(paths.engine(e.name, root), e.name))
            audit = (built or {}).get("results", {}).get("audit", {})
            row = {"row": f"{model}/{e.target}/{e.precision}", "model": model, "engine": e.name,
                   "target": e.target, "precision": e.precision, "recipe": e.recipe,
                   "b1_p50_ms": t.get("b1_p50_ms"), "b8_p50_ms": t.get("b8_p50_ms"),
                   "b1_speedup_vs_eager": t.get("b1_speedup_vs_eager"),
                   "b8_speedup_vs_eager": t.get("b8_speedup_vs_eager"),
                   "accuracy_metric": label, "accuracy": (verdict.get("metrics") or {}).get(metric),
                   "verdict": verdict.get("verdict", "missing"),
                   "fallback_nodes": audit.get("fallback_nodes"), "best": False, "ranked_at": at,
                   "note": bench.get("not_run", {}).get(e.name, "" if t else "not benched")}
            for b in (1, 8):
                mine, ref = t.get(f"b{b}_p50_ms"), (timed.get(base) or {}).get(f"b{b}_p50_ms") if base else None
                row[f"b{b}_speedup_vs_ort_fp32"] = round(ref / mine, 3) if mine and ref else None
            model_rows.append(row)
        key = f"b{at}_p50_ms"
        passing = [r for r in model_rows if r["verdict"] == "pass" and timed.get(r["engine"], {}).get(key) is not None]
        if passing:
            best = min(passing, key=lambda r: timed[r["engine"]][key])
            best["best"] = True
            winners[model] = best["engine"]
        out.extend(sorted(model_rows, key=lambda r: (r["target"], PRECISIONS.index(r["precision"]))))
    return out, winners


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(rows_: list[dict]) -> str:
    head = ["model", "target", "precision", "b1 p50 ms", "b8 p50 ms", "b1 × eager", "b8 × eager", "b1 × ORT FP32",
            "b8 × ORT FP32", "accuracy", "gate", "fallbacks", "note"]
    body = [[("**" + r["model"] + "**") if r["best"] else r["model"], r["target"], r["precision"] +
             (f" ({r['recipe']})" if r["recipe"] else ""), _f(r["b1_p50_ms"], ".2f"), _f(r["b8_p50_ms"], ".2f"),
             _f(r["b1_speedup_vs_eager"], ".2f"), _f(r["b8_speedup_vs_eager"], ".2f"),
             _f(r["b1_speedup_vs_ort_fp32"], ".2f"), _f(r["b8_speedup_vs_ort_fp32"], ".2f"),
             f"{r['accuracy_metric']} {_f(r['accuracy'], '.5g')}", r["verdict"],
             _f(r["fallback_nodes"], "d"),
             "; ".join(x for x in (f"fastest at batch {r['ranked_at']} that passes its gate" if r["best"] else "",
                                   r["note"]) if x)]
            for r in rows_]
    return ("# Who wins, per graph (this host, one bench run per model)\n\n"
            "Bold model: the fastest engine that passed its validation gate, at the batch a face system feeds the "
            "graph (1; R-Net and O-Net, fed every candidate crop in one call: the largest benched batch). "
            "× = speed-up (p50 ratio in "
            "the same interleaved run). Accuracy: the metric the model's gate reads (embedder: golden cosine min; "
            "MTCNN nets: box IoU min vs the reference cascade; aligner: pixel MAE).\n\n"
            + tables.markdown(head, body) + "\n")


def run(cfg, root: Path = Path(".")) -> Leaderboard:
    found, winners = rows(cfg, root)
    d = paths.reports(root)
    jp, mp = d / "leaderboard.json", d / "leaderboard.md"
    write_bytes_atomic(jp, json_bytes(found))
    write_bytes_atomic(mp, markdown(found).encode())
    return Leaderboard(found, winners, jp, mp)


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        r = run(args.cfg)
        print(markdown(r.rows))
        for model, engine in r.winners.items():
            print(f"  {model}: {engine}")
        print(f"→ {r.json_path}, {r.md_path}")
        return 0

    return stage.main(STAGE, body, argv)


if __name__ == "__main__":
    sys.exit(main())
