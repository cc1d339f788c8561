"""summary: the build on one page — every engine's registration and gate, the gallery indexes, the INT8 precision
reports and every face system's gate and load — the last stage of the default DAG.

It reads what the registrations (register@, register-index@), the precision reports (debug-precision@) and the
system benchmarks (sysbench@) wrote, so a plain `dvc repro` (the root dvc.yaml and everything upstream of it)
reaches every stage with only three stages in the root file: DVC re-parses and rewrites a stage's whole dvc.lock
after each run, and the root lock of the 46 registrations and reports cost ≈ 2 s of that per stage. Writes
artifacts/reports/summary/summary.md and summary.json (pipeline/report/summary.py), uncached like the sysbench
figures they quote.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, stage
from pipeline.manifest import json_bytes, write_bytes_atomic
from pipeline.report.summary import collect, inputs, markdown, problems

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "summary", "pipeline.stages.summary",
    "the build on one page: each engine's gate, registration and toolchain, the indexes, precision, systems",
    deps=lambda cfg, key: inputs(cfg),
    params=lambda cfg, key: ["engines", "systems", "matching.gallery_sizes", "quantize.models",
                                       "quantize.recipes"],
    outs=lambda cfg, key: [stage.Out((paths.summary() / "summary.md").as_posix(), cache=False),
                           stage.Out((paths.summary() / "summary.json").as_posix(), cache=False)],
    help="the build on one page: engines, indexes, precision, systems")


def run(cfg: Config, root: Path = Path(".")) -> tuple[dict, Path]:
    doc = collect(cfg, root)
    d = paths.summary(root)
    d.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(d / "summary.json", json_bytes(doc))
    write_bytes_atomic(d / "summary.md", markdown(doc).encode())
    return doc, d


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        doc, d = run(args.cfg)
        print(markdown(doc))
        bad = problems(doc)
        run_.record["problems"] = bad
        print(f"→ {d / 'summary.md'}, {d / 'summary.json'}")
        return 0

    return stage.main(STAGE, body, argv)


if __name__ == "__main__":
    sys.exit(main())
