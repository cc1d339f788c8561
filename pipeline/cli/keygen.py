"""`kiln keygen`: make an EC P-256 signing key pair for releases (private 0600 + .pub); never overwrites, refuses a
path inside the repository"""

from __future__ import annotations

import argparse

NAME = "keygen"
HELP = ("make an EC P-256 signing key pair for releases (private 0600 + .pub); never overwrites, refuses a path "
        "inside the repository")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="private key path (default: $KILN_SIGNING_KEY)")


def run(args) -> int:
    from pipeline.release import signing

    private, public = signing.keygen(signing.key_path(args.out))
    print(f"private key → {private} (mode 0600; keep it secret, never commit it)\npublic key  → {public} "
          f"(hand it to whoever verifies: kiln verify-release ARCHIVE --key {public.name})")
    return 0
