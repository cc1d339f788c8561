"""`kiln mixed`: mixed precision under the model's real gate: the smallest set of nodes to keep in float so the INT8
model passes (exit 1 if none within --max-float); prints the recipe to add"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import load_cfg

NAME = "mixed"
HELP = ("mixed precision under the model's real gate: the smallest set of nodes to keep in float so the INT8 "
        "model passes (exit 1 if none within --max-float); prints the recipe to add")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model in quantize.models")
    p.add_argument("recipe", help="the INT8 recipe to start from (quantize.recipes)")
    p.add_argument("--max-float", type=int, default=8, help="the most nodes to leave in float")
    p.add_argument("--rank", choices=["gate", "snr"], default="gate",
                   help="sensitivity: each node alone in float under the gate (default), or kiln compare's SNR")
    p.add_argument("--json", metavar="PATH", help="write the ranking and every trial as JSON")


def run(args) -> int:
    from pipeline.quant import mixed
    from pipeline.manifest import json_bytes, write_bytes_atomic

    result = mixed.search(load_cfg(args), args.model, args.recipe, Path("."), args.max_float, args.rank)
    print(mixed.report(result))
    if args.json:
        write_bytes_atomic(Path(args.json), json_bytes(result.to_json()))
        print(f"→ {args.json}")
    return 0 if result.chosen is not None else 1
