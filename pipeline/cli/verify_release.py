"""`kiln verify-release`: verify a release archive offline (no MLflow, no network): signature, every file digest, the
manifest chain, the verdict (exit 1 at the first failure)"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "verify-release"
HELP = ("verify a release archive offline (no MLflow, no network): signature, every file digest, the manifest "
        "chain, the verdict (exit 1 at the first failure)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("archive", help="the .tar.gz written by kiln release")
    p.add_argument("--key", required=True, help="the publisher's public key (.pub)")


def run(args) -> int:
    from pipeline.release import system as system_release
    from pipeline.tables import shown

    for line in system_release.verify(Path(args.archive), Path(args.key)):     # an engine's or a system's
        print(f"ok  {shown(line, 1000)}")                                      # it quotes the release's values
    print(f"verify-release: {args.archive} verified offline")
    return 0
