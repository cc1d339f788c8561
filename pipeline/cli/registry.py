"""`kiln registry`: registry maintenance: `kiln registry sync` registers every built, validated engine and index
(idempotent) — for a new or lost registry"""

from __future__ import annotations

import argparse

from pipeline.cli.common import load_cfg

NAME = "registry"
HELP = ("registry maintenance: `kiln registry sync` registers every built, validated engine and index "
        "(idempotent) — for a new or lost registry")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["sync"])


def run(args) -> int:
    from pipeline.registry.sync import sync

    receipts = sync(load_cfg(args))
    print(f"registry sync: {len(receipts)} registered ({sum(r.new for r in receipts)} new)")
    return 0
