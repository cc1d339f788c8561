"""`kiln targets`: list compile targets and whether this host can build them"""

from __future__ import annotations

import argparse

from pipeline.cli.common import load_cfg

NAME = "targets"
HELP = ("list compile targets and whether this host can build them")


def arguments(p: argparse.ArgumentParser) -> None:
    """No arguments beyond kiln's own (--params)."""


def run(args) -> int:
    from pipeline import targets

    cfg = load_cfg(args)
    for name in targets.TARGETS:
        state = "enabled" if name in cfg.targets and cfg.targets[name].enabled else "not selected"
        print(f"{targets.get(name).probe().line()} [{state} in {cfg.source}]")
    return 0
