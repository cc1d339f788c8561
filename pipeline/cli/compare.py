"""`kiln compare`: layer by layer, where two ONNX graphs of one model part ways on its golden feed: cosine, max |Δ|,
SNR and the error each layer adds; the first layer below --min-snr-db"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import load_cfg
from pipeline.errors import KilnError

NAME = "compare"
HELP = ("layer by layer, where two ONNX graphs of one model part ways on its golden feed: cosine, max |Δ|, SNR "
        "and the error each layer adds; the first layer below --min-snr-db")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="ONNX file, or an export / quantized / ort-cpu engine directory (manifest verified)")
    p.add_argument("b", help="the graph to compare with A (e.g. the INT8 QDQ model made from A)")
    p.add_argument("--model", help="the model whose golden feed to run (default: from the manifests)")
    p.add_argument("--set", default="golden", choices=["golden", "calibration"], help="image set to feed")
    p.add_argument("--batch", type=int, default=16, help="samples per run (memory is bounded by one batch)")
    p.add_argument("--min-snr-db", type=float, default=20.0, help="a tensor below this SNR is a bad layer")
    p.add_argument("--top", type=int, default=10, help="how many of the worst layers to print")
    p.add_argument("--json", metavar="PATH", help="write every layer's numbers as JSON (e.g. for `dvc plots`)")


def run(args) -> int:
    from pipeline import compare, samples
    from pipeline.manifest import json_bytes, write_bytes_atomic

    cfg = load_cfg(args)
    (a, model_a), (b, model_b) = compare.resolve(args.a), compare.resolve(args.b)
    model = args.model or model_a or model_b
    if model is None:
        raise KilnError(f"{args.a}, {args.b}: no manifest says which model these graphs belong to",
                        "pass --model NAME (its golden feed is the input)")
    cfg.model(model)                      # a KilnError naming params.yaml for an unknown model
    feeds = samples.stream(cfg, model, args.set, Path("."), args.batch)
    result = compare.compare(a, b, feeds, args.min_snr_db, model=model)
    print(compare.report(result, args.top))
    if args.json:
        write_bytes_atomic(Path(args.json), json_bytes(result.to_json()))
        print(f"→ {args.json}")
    return 0
