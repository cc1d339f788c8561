"""`kiln promote`: move 'production' to a registered version after proving its stored files and its stored, digest-
checked validation verdict (exit 1 if refused); --system: a whole face system"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import (FORCE_HELP, RE_ENROLL_HELP, SYSTEM_HELP, check_reason, is_system, load_cfg, no_force,
                                 print_move, print_system_move)
from pipeline.errors import KilnError

NAME = "promote"
HELP = ("move 'production' to a registered version after proving its stored files and its stored, digest-checked "
        "validation verdict (exit 1 if refused); --system: a whole face system")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="registered model (kiln-<engine>), engine name, or with --system a system name")
    p.add_argument("version", help="model version number")
    p.add_argument("--reason", help="why (recorded in the release history)")
    p.add_argument("--system", action="store_true", help=SYSTEM_HELP)
    p.add_argument("--re-enroll", action="store_true", help=RE_ENROLL_HELP)
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--shadow-report", metavar="LOG", help="with --system: the shadow log (kiln-run serve --shadow "
                   "--shadow-log) of this version beside production, summarised into the move's record")


def run(args) -> int:
    from pipeline import registry

    check_reason(args)                         # before anything reads the registry

    if is_system(args):
        from pipeline.registry import systems

        no_force(args)
        shadow = None
        if args.shadow_report:
            from pipeline.registry import shadow as shadow_report

            shadow = shadow_report.load(Path(args.shadow_report))     # a bad log: one line, before the registry
        print_system_move(systems.promote(load_cfg(args), args.name, args.version, reason=args.reason,
                                          re_enroll=args.re_enroll, shadow=shadow))
        return 0
    if args.shadow_report:
        raise KilnError("--shadow-report is for a face system", "e.g. kiln promote --system dlib-mtcnn 2 "
                        "--shadow-report shadow.jsonl")
    if args.re_enroll:
        raise KilnError("--re-enroll is for a face system", "e.g. kiln promote --system dlib-mtcnn 2 --re-enroll")
    print_move(registry.promote(load_cfg(args), args.name, args.version, reason=args.reason, force=args.force))
    return 0
