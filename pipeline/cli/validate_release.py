"""`kiln validate-release`: validate a registered version on this host (the one a build-only version needs: a host with
the runtime): download and verify it, run the face-task gate, attach the verdict to the registry; a pass makes it
promotable (exit 1 = fail)"""

from __future__ import annotations

import argparse

from pipeline.cli.common import load_cfg

NAME = "validate-release"
HELP = ("validate a registered version on this host (the one a build-only version needs: a host with the "
        "runtime): download and verify it, run the face-task gate, attach the verdict to the registry; a pass "
        "makes it promotable (exit 1 = fail)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="registered model (kiln-<engine>) or engine name")
    p.add_argument("version", help="model version number")


def run(args) -> int:
    from pipeline.release import revalidate

    result = revalidate.run(load_cfg(args), args.name, int(args.version))
    print(result.line())
    return 0 if result.passed else 1
