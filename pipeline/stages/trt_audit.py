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

from pipeline import paths, stage, targets
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import json_bytes, write_bytes_atomic
from pipeline.targets.tensorrt import static_audit

TARGET = "tensorrt"


def _int8_source(cfg, model: str) -> list[str]:
    recipe = targets.options(cfg, TARGET).int8_recipe
    return [paths.quantized(model, recipe).as_posix()] if model in cfg.quantize.models and recipe in cfg.recipes else []


STAGE = stage.Stage(
    "trt-audit", "pipeline.stages.trt_audit",
    "GPU-free TensorRT ONNX-parser audit of the ONNX the model's tensorrt engines build from (exit 1 = would not "
    "parse)",
    keys=lambda cfg: list(cfg.models) if TARGET in cfg.targets else [],
    deps=lambda cfg, key: [paths.export(key).as_posix(), *_int8_source(cfg, key)],
    params=lambda cfg, key: [f"targets.{TARGET}.static_audit"],
    outs=lambda cfg, key: [stage.Out(report_path(key).as_posix())])   # cached: another host pulls it for fallback-table


@dataclass(frozen=True)
class TrtAuditResult:
    path: Path
    report: dict
    failures: list[str]


def report_path(model: str, root: Path = Path(".")) -> Path:
    return paths.reports(root) / "trt-audit" / f"{paths.slug(model, 'model')}.json"


def source_for(cfg, model: str, precision: str, root: Path) -> tuple[Path, str]:
    """The ONNX a `precision` TensorRT engine of `model` is built from, and how it is named in reports."""
    if precision == "int8":
        recipe = targets.options(cfg, TARGET).int8_recipe
        return paths.quantized(model, recipe, root) / "model.onnx", f"artifacts/quantized/{model}-{recipe}"
    return paths.export(model, root) / "model.onnx", f"artifacts/export/{model}"


def audits(cfg, model: str, root: Path = Path(".")) -> list[dict]:
    """One entry per audited precision: the static audit summary, or why it was skipped (no such ONNX here)."""
    if TARGET not in cfg.targets:
        raise KilnError(f"{cfg.source}: targets: no `{TARGET}` entry", "add targets.tensorrt (see params.yaml)")
    cfg.model(model)
    opts = targets.options(cfg, TARGET)
    out = []
    for precision in opts.audit_precisions:
        onnx_path, label = source_for(cfg, model, precision, root)
        if not onnx_path.is_file():
            out.append({"precision": precision, "onnx": label, "skipped": f"{label}/model.onnx not built"})
            continue
        out.append({"onnx": label, **static_audit(onnx_path, precision).summary()})
    return out


def run(cfg, model: str, root: Path = Path(".")) -> TrtAuditResult:
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
