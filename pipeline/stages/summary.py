"""summary: the build on one page — every engine's gate and toolchain, the INT8 precision reports and every face
system's gate — the last stage of the default DAG.

It reads the validations, precision reports and system gates (cached outputs, so any host can pull them), so the
groups nothing else depends on that write cached outputs (debug-precision@, system@ through them) can live in
dag/<group>/ and a plain `dvc repro` (the root dvc.yaml and everything upstream of it) still reaches them. DVC
re-parses and rewrites a stage's whole dvc.lock after each run: the root lock of 46 registrations and reports cost
≈ 2 s of that per stage. The groups with uncached outputs (registrations, load sweeps) stay in the root file: a
host that pulls with `--allow-missing` has no receipts of engines it did not register. Writes
artifacts/reports/summary/summary.md and summary.json (pipeline/report/summary.py).
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
    "the build on one page: each engine's gate and toolchain, INT8 precision, each system's gate",
    deps=lambda cfg, key: inputs(cfg),
    params=lambda cfg, key: ["engines", "systems", "quantize.models", "quantize.recipes"],
    outs=lambda cfg, key: [stage.Out((paths.summary() / "summary.md").as_posix(), cache=False),
                           stage.Out((paths.summary() / "summary.json").as_posix(), cache=False)],
    help="the build on one page: engines, INT8 precision, systems")


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
