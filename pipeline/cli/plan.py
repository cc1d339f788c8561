"""`kiln plan`: per engine: its hardware family (CI matrix job), whether this host can build it, and whether the shared
DVC remote already has its current build"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import load_cfg

NAME = "plan"
HELP = ("per engine: its hardware family (CI matrix job), whether this host can build it, and whether the shared "
        "DVC remote already has its current build")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-remote", action="store_true", help="plan against dvc.lock and this host only")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args) -> int:
    import dataclasses
    import json

    from pipeline.dagtools import plan

    rows = plan.plan(load_cfg(args), Path("."), remote=not args.no_remote)
    print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) if args.json else plan.render(rows))
    return 0
