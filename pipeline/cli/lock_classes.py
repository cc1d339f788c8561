"""`kiln lock-classes`: after dvc repro: every stage's lock entry against a commit's — bit-identical, host-bound,
follows its inputs, not reproducible or different (exit 1 if a stage with the committed inputs, or a portable stage,
did not reproduce)"""

from __future__ import annotations

import argparse

NAME = "lock-classes"
HELP = ("after dvc repro: every stage's lock entry against a commit's — bit-identical, host-bound, follows its "
        "inputs, not reproducible or different (exit 1 if a stage with the committed inputs, or a portable "
        "stage, did not reproduce)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", default="HEAD", help="the commit whose dvc.lock files to compare with (HEAD)")


def run(args) -> int:
    from pipeline.dagtools import lockdiff

    return lockdiff.main(args.against)
