"""`kiln rollback`: move 'production' back to the version it held before the current one (--system: every part of the
system's previous version at once)"""

from __future__ import annotations

import argparse

from pipeline.cli.common import (FORCE_HELP, RE_ENROLL_HELP, SYSTEM_HELP, check_reason, is_system, load_cfg, no_force,
                                 print_move, print_system_move)
from pipeline.errors import KilnError

NAME = "rollback"
HELP = ("move 'production' back to the version it held before the current one (--system: every part of the "
        "system's previous version at once)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="registered model (kiln-<engine>), engine name, or with --system a system name")
    p.add_argument("--reason", help="why (recorded in the release history)")
    p.add_argument("--system", action="store_true", help=SYSTEM_HELP)
    p.add_argument("--re-enroll", action="store_true", help=RE_ENROLL_HELP)
    p.add_argument("--force", action="store_true", help=FORCE_HELP)


def run(args) -> int:
    from pipeline import registry

    check_reason(args)

    if is_system(args):
        from pipeline.registry import systems

        no_force(args)
        print_system_move(systems.rollback(load_cfg(args), args.name, reason=args.reason, re_enroll=args.re_enroll))
        return 0
    if args.re_enroll:
        raise KilnError("--re-enroll is for a face system", "e.g. kiln rollback --system dlib-mtcnn --re-enroll")
    print_move(registry.rollback(load_cfg(args), args.name, reason=args.reason, force=args.force))
    return 0
