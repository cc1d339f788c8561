"""trt-audit@<model>: would TensorRT parse the ONNX its engines are built from? Answered without a GPU.

For each precision in `targets.tensorrt.static_audit.precisions` the ONNX is prepared exactly as the tensorrt target
would (fp32 export; FP16 conversion of it; the `int8_recipe` QDQ model) and checked by `trt_rules`. The report goes
to artifacts/reports/trt-audit/<model>.json; any rule the TensorRT ONNX parser would reject fails the stage (exit 1),
so a quantization recipe that drifts out of TensorRT's form stops CI before a GPU host finds out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, stage
from pipeline.errors import GateFailed
from pipeline.manifest import json_bytes, write_bytes_atomic
from pipeline.targets.trt_static import TARGET, audited_models, audits, int8_source, report_path

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "trt-audit", "pipeline.stages.trt_audit",
    "GPU-free TensorRT ONNX-parser audit of the ONNX the model's tensorrt engines build from (exit 1 = would not "
    "parse)",
    keys=audited_models,
    deps=lambda cfg, key: [paths.export(key).as_posix(), *int8_source(cfg, key)],
    params=lambda cfg, key: [f"targets.{TARGET}.static_audit"],
    outs=lambda cfg, key: [stage.Out(report_path(key).as_posix())],     # cached: other hosts pull it (fallback-table)
    help="check without a GPU that TensorRT's ONNX parser would accept a model's ONNX")


@dataclass(frozen=True)
class TrtAuditResult:
    path: Path
    report: dict
    failures: list[str]


def run(cfg: Config, model: str, root: Path = Path(".")) -> TrtAuditResult:
    entries = audits(cfg, model, root)
    failures = [f"{e['precision']} ({e['onnx']}): {p['node']} ({p['op']}): {p['detail']}"
                for e in entries if not e.get("skipped") for p in e["problems"]]
    report = {"model": model, "target": TARGET, "method": "static", "audits": entries,
              "parses": not failures}
    path = report_path(model, root)
    write_bytes_atomic(path, json_bytes(report))
    return TrtAuditResult(path, report, failures)


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        r = run(args.cfg, args.key)
        for e in r.report["audits"]:
            if e.get("skipped"):
                print(f"trt-audit@{args.key} {e['precision']}: skipped ({e['skipped']})")
                continue
            a = e["audit"]
            print(f"trt-audit@{args.key} {e['precision']} ({e['onnx']}, opset {e['opset']}): "
                  f"{'parses' if e['parses'] else 'WOULD NOT PARSE'}; {a['native_nodes']} compute nodes native, "
                  f"{a['fallback_nodes']} fall back" + (f"; {e['problem_rules']}" if e["problem_rules"] else ""))
        print(f"  → {r.path}")
        if r.failures:
            raise GateFailed(f"trt-audit@{args.key}: TensorRT's ONNX parser would reject {len(r.failures)} node(s): "
                             + "; ".join(r.failures[:5]), "use the `symmetric` recipe (zero points 0, s8, float bias)")
        return 0

    return stage.main(STAGE, body, argv, key_help="model name from params.yaml (e.g. embedder)")


if __name__ == "__main__":
    sys.exit(main())
