"""`kiln report`: one self-contained HTML page: every engine's latency (p50/p99, b1/b8), speed-up, accuracy, verdict
and fallbacks; plots; matching curves; the verified provenance graph (exit 1 if a link is broken)"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import load_cfg

NAME = "report"
HELP = ("one self-contained HTML page: every engine's latency (p50/p99, b1/b8), speed-up, accuracy, verdict and "
        "fallbacks; plots; matching curves; the verified provenance graph (exit 1 if a link is broken)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="artifacts/reports/report.html", help="where to write it")


def run(args) -> int:
    from pipeline.report import page as report

    r = report.for_workspace(load_cfg(args), Path("."))
    out = report.write(r, Path(args.out))
    print(f"report: {len(r.rows)} engines, {len(r.curves)} matching curves, {len(r.manifests)} artifacts in the "
          f"provenance graph → {out}")
    return 1 if r.broken else 0
