"""`kiln profile`: merge profiles/NAME.yaml into params.yaml (comments kept, checked, atomic; twice changes nothing),
e.g. `kiln profile rtx`"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "profile"
HELP = ("merge profiles/NAME.yaml into params.yaml (comments kept, checked, atomic; twice changes nothing), e.g. "
        "`kiln profile rtx`")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="profile name (profiles/<name>.yaml)")


def run(args) -> int:
    from pipeline.dagtools import profiles

    changed = profiles.apply(args.name, args.params)
    if not changed:
        print(f"profile {args.name}: already applied to {args.params}; nothing changed")
        return 0
    print(f"profile {args.name}: merged into {args.params} ({len(changed)} key(s)): " + ", ".join(changed))
    if (Path("lockfiles") / f"{args.name}.txt").is_file():
        print("next: bash scripts/setup.sh --profile " + args.name + " (its toolchain), then bash scripts/run.sh")
    else:
        print("next: bash scripts/run.sh (this profile needs no other packages)")
    return 0
