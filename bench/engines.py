"""Side-by-side engine benchmark from ONE run: INT8 vs FP32 vs PyTorch eager, with golden accuracy.

Usage (after `bash scripts/run.sh` built the engines):  .venv/bin/python bench/engines.py [MODEL]
Writes nothing; prints the markdown table used in the README. Ratios are measured in one process, interleaved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline import config, paths
from pipeline.gates import timing


def main(model: str = "embedder") -> int:
    cfg = config.load(Path("params.yaml"))
    result = timing.measure_model(cfg, model, progress=lambda line: print(line, file=sys.stderr))
    accuracy = {}
    for e in cfg.engines_of(model):
        v = paths.validation(e.name) / "validation.json"
        if v.is_file():
            m = json.loads(v.read_text(encoding="utf-8"))["metrics"]
            accuracy[e.name] = {"golden cos min": m["cosine_min"], "golden L2 max": m["l2_max"]}
    print(timing.table(result.report, cfg.bench.batches, accuracy))
    for k, v in result.report["ratios"].items():
        print(f"speed-up {k}: {v:.2f}×")
    for f in result.failures:
        print(f"FAIL: {f}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
