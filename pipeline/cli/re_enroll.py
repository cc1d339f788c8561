"""`kiln re-enroll`: enrol the gallery with a system version's embedder exactly as its release will, and record it:
what promoting past `re-enroll required` (--re-enroll) needs first, and what that version's releases are checked
against"""

from __future__ import annotations

import argparse

from pipeline.cli.common import load_cfg
from pipeline.errors import KilnError

NAME = "re-enroll"
HELP = ("enrol the gallery with a system version's embedder exactly as its release will, and record it: what "
        "promoting past `re-enroll required` (--re-enroll) needs first, and what that version's releases are "
        "checked against")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="system name (params.yaml `systems:`) or kiln-system-NAME")
    p.add_argument("version", help="the system version whose embedder enrols the gallery")
    p.add_argument("--system", action="store_true", required=True, help="NAME is a face system (required)")


def run(args) -> int:
    from pipeline.release import system as system_release

    if not args.system:
        raise KilnError("re-enroll is for a face system", "e.g. kiln re-enroll --system dlib-mtcnn 2")
    r = system_release.re_enroll(load_cfg(args), args.name, args.version)
    print(f"re-enroll: {r['system']} v{r['version']}: gallery enrolled by {r['embedder']} — {r['rows']} rows × "
          f"{r['dim']}, sha256 {r['sha256'][:12]} on host class {r['host_class']} (recorded: run {r['run']}); now "
          f"kiln promote --system {args.name} {r['version']} --re-enroll")
    return 0
