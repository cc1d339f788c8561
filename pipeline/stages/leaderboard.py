"""leaderboard: per graph, which compiler and precision win on this host, and at what accuracy — the headline answer.

One row per engine (model × target × precision) from the bench (one interleaved run per model), the engine's
validation verdict and its compile audit: p50 at batch 1 and 8, speed-up over PyTorch eager and over the model's
ONNX Runtime FP32 engine (same run), the accuracy metric its gate reads, the fallback count. Per model the fastest
engine that passed its gate is marked, at the batch a face system feeds that graph (`ranked_at`: 1, or the largest
benched batch for the nets that get every candidate crop in one call); an engine that failed its gate, or was not
run here, or an INT8 engine `not faster here` (bench verdict not-faster-here on this host class), can never be
marked; the markdown names the host class the timings were measured on. Writes artifacts/reports/leaderboard.json
(flat rows, a DVC plot) and leaderboard.md (the README's table); the rows are pipeline/report/leaderboard.py's.
Timings are the bench's records, so both files are uncached like the bench itself.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, stage
from pipeline.report.leaderboard import markdown, models, rows
from pipeline.manifest import json_bytes, write_bytes_atomic
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "leaderboard", "pipeline.stages.leaderboard",
    "per graph: every engine's speed, accuracy and fallbacks side by side; the fastest that passes its gate marked",
    deps=lambda cfg, key: [*((paths.bench(m) / paths.BENCH_FILE).as_posix() for m in models(cfg)),
                           *(paths.validation(e).as_posix() for e in cfg.engines),
                           *(paths.engine(e).as_posix() for e in cfg.engines)],
    params=lambda cfg, key: ["engines"],
    dynamic=lambda cfg, key: sorted({m for model in models(cfg) for m in roles.modules(cfg.model(model).samples)}),
    outs=lambda cfg, key: [stage.Out((paths.reports() / "leaderboard.md").as_posix(), cache=False),
                           stage.Out((paths.reports() / "leaderboard.json").as_posix(), cache=False, kind="plots",
                                     plot={"template": "bar_horizontal", "x": "b1_speedup_vs_ort_fp32", "y": "row",
                                           "title": "batch-1 speed-up over ONNX Runtime FP32 (same run)"})],
    help="per graph: every engine's speed, accuracy and fallbacks; the fastest that passes marked")


@dataclass(frozen=True)
class Leaderboard:
    rows: list[dict]
    winners: dict[str, str]       # model → engine name (absent: no engine passed its gate here)
    json_path: Path
    md_path: Path


def run(cfg: Config, root: Path = Path(".")) -> Leaderboard:
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
            best = next(x for x in r.rows if x["engine"] == engine)
            by = f", {best['wins_by']:.2f}× the next ({best['runner_up']})" if best.get("wins_by") else ""
            print(f"  {model} on {best.get('host_class') or 'this host'}: {engine}{by}")
        for x in r.rows:
            if x.get("bench_gate") == "not-faster-here":
                print(f"  {x['engine']}: not faster here ({x.get('host_class')}): never the winner")
        print(f"→ {r.json_path}, {r.md_path}")
        return 0

    return stage.main(STAGE, body, argv)


if __name__ == "__main__":
    sys.exit(main())
