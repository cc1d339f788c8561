"""`kiln upgrade-report`: each engine a toolchain change rebuilt, beside the production version (downloaded and
verified from the registry) on this host: outputs on the golden feeds, the face-task gate of both, latency
interleaved in one run with its noise band, a verdict per engine and the systems that pin it (exit 1: an engine
differs or is slower)"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import load_cfg

NAME = "upgrade-report"
HELP = ("each engine a toolchain change rebuilt, beside the production version (downloaded and verified from the "
        "registry) on this host: outputs on the golden feeds, both face-task gates, latency interleaved in one run "
        "with its noise band, a verdict per engine (same | better | worse | differs) and the systems that pin it; "
        "logged for kiln promote (exit 1: an engine differs or is slower)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("engines", nargs="*", metavar="ENGINE", help="engines of params.yaml (default: every engine)")
    p.add_argument("--all", action="store_true", help="also compare engines whose toolchain is unchanged but whose "
                   "build differs from production (code, params, inputs)")
    p.add_argument("--json", metavar="PATH", help="write every row's numbers as JSON")
    p.add_argument("--no-record", action="store_true", help="do not log the rows to the registry (kiln-upgrades)")


def run(args) -> int:
    from pipeline.manifest import write_json_atomic
    from pipeline.release import upgrade

    report = upgrade.run(load_cfg(args), Path("."), args.engines or None, every=args.all, record=not args.no_record)
    print(upgrade.table(report))
    for engine, rid in sorted(report.runs.items()):
        print(f"  {engine}: logged as run {rid} (experiment kiln-upgrades): kiln promote --system shows it")
    if args.json:
        write_json_atomic(Path(args.json), report.doc())
        print(f"→ {args.json}")
    return upgrade.exit_code(report)
