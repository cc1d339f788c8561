"""fallback-table: for every model × target × precision, how many compute nodes run natively, which fall back.

Sources, labelled in every row:

* `engine` — a built engine's manifest, `results.audit` (ort-cpu, aoti-cpu, tensorrt built on a GPU host, or
  tensorrt-rtx: the builder's own layer list, noted "built only", with any disagreement with the static rules);
  a target that also asked about another device notes it (OpenVINO's NPU query, LiteRT's Edge TPU rules);
* `static` — for a TensorRT engine not built on this host: trt_rules' audit of the ONNX the engine would be built
  from (read from artifacts/reports/trt-audit/<model>.json, or computed if that report is absent). Static rows say
  `parses: false` where the TensorRT ONNX parser would reject the graph (the engine would not build at all);
* `missing` — an engine in params.yaml that is neither built here nor statically auditable.

Writes artifacts/reports/fallback.json (a list of flat rows: DVC plots-friendly) and fallback.md (a table).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, stage
from pipeline.report.fallbacks import markdown, rows, table
from pipeline.manifest import json_bytes, write_bytes_atomic
from pipeline.targets.trt_static import audited_models, report_path

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "fallback-table", "pipeline.stages.fallback_table",
    "native vs fallback compute nodes per model × target × precision (built engines' audits; static for tensorrt)",
    deps=lambda cfg, key: [paths.engine(e).as_posix() for e in cfg.engines]
    # each audit report by its own path: `dvc repro --pull` fetches a missing dep as an output, which a directory
    # holding outputs is not
    + [report_path(m).as_posix() for m in audited_models(cfg)],
    params=lambda cfg, key: ["engines", "targets"],
    outs=lambda cfg, key: [stage.Out((paths.reports() / "fallback.md").as_posix(), cache=False),
                           stage.Out((paths.reports() / "fallback.json").as_posix(), cache=False, kind="plots",
                                     plot={"template": "bar_horizontal", "x": "fallback_nodes", "y": "row",
                                           "title": "compute nodes falling back from the requested precision"})],
    help="native vs fallback compute nodes for every model × target × precision")


@dataclass(frozen=True)
class FallbackResult:
    rows: list[dict]
    json_path: Path
    md_path: Path


def run(cfg: Config, root: Path = Path(".")) -> FallbackResult:
    found = rows(cfg, root)
    d = paths.reports(root)
    jp, mp = d / "fallback.json", d / "fallback.md"
    write_bytes_atomic(jp, json_bytes(found))
    write_bytes_atomic(mp, markdown(found).encode())
    return FallbackResult(found, jp, mp)


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        r = run(args.cfg)
        print(table(r.rows))
        print(f"→ {r.json_path}, {r.md_path}")
        return 0

    return stage.main(STAGE, body, argv)


if __name__ == "__main__":
    sys.exit(main())
