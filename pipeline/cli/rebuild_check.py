"""`kiln rebuild-check`: rebuild one stage in a fresh process in a scratch project and classify the result: bit-
identical, numerically equivalent, task-equivalent (exit 1 if below the target's claim)"""

from __future__ import annotations

import argparse

from pipeline.cli.common import load_cfg

NAME = "rebuild-check"
HELP = ("rebuild one stage in a fresh process in a scratch project and classify the result: bit-identical, "
        "numerically equivalent, task-equivalent (exit 1 if below the target's claim)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", help="a DAG stage, e.g. compile@embedder-aoti-cpu-fp32 or export@embedder")
    p.add_argument("--cpu", metavar="MODEL", help="rebuild on an emulated CPU (qemu-user's CPU model, e.g. EPYC-Rome "
                   "for a Zen 2 with AVX2 only): do the portable stages give this host's bytes on another ISA?")


def run(args) -> int:
    from pipeline.dagtools import rebuild

    return rebuild.main(load_cfg(args), args.stage, cpu=args.cpu)
