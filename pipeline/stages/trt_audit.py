"""trt-audit@<model>: would TensorRT parse the ONNX its engines are built from? Answered without a GPU.

For each precision in `targets.tensorrt.static_audit.precisions` the ONNX is prepared exactly as the tensorrt target
would (fp32 export; FP16 conversion of it; the `int8_recipe` QDQ model) and checked by `trt_rules`. The report goes
to artifacts/reports/trt-audit/<model>.json; any rule the TensorRT ONNX parser would reject fails the stage (exit 1),
so a quantization recipe that drifts out of TensorRT's form stops CI before a GPU host finds out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline import paths
from pipeline.config import Config
from pipeline.errors import KilnError
from pipeline.manifest import write_bytes_atomic
from pipeline.targets.tensorrt import TrtOptions, static_audit

TARGET = "tensorrt"


@dataclass(frozen=True)
class TrtAuditResult:
    path: Path
    report: dict
    failures: list[str]


def report_path(model: str, root: Path = Path(".")) -> Path:
    return root / paths.ARTIFACTS / "reports" / "trt-audit" / f"{model}.json"


def source_for(cfg: Config, model: str, precision: str, root: Path) -> tuple[Path, str]:
    """The ONNX a `precision` TensorRT engine of `model` is built from, and how it is named in reports."""
    if precision == "int8":
        recipe = TrtOptions.parse(cfg.targets[TARGET].options).int8_recipe
        return paths.quantized(model, recipe, root) / "model.onnx", f"artifacts/quantized/{model}-{recipe}"
    return paths.export(model, root) / "model.onnx", f"artifacts/export/{model}"


def audits(cfg: Config, model: str, root: Path = Path(".")) -> list[dict]:
    """One entry per audited precision: the static audit summary, or why it was skipped (no such ONNX here)."""
    if TARGET not in cfg.targets:
        raise KilnError(f"{cfg.source}: targets: no `{TARGET}` entry", "add targets.tensorrt (see params.yaml)")
    cfg.model(model)
    opts = TrtOptions.parse(cfg.targets[TARGET].options)
    out = []
    for precision in opts.audit_precisions:
        onnx_path, label = source_for(cfg, model, precision, root)
        if not onnx_path.is_file():
            out.append({"precision": precision, "onnx": label, "skipped": f"{label}/model.onnx not built"})
            continue
        out.append({"onnx": label, **static_audit(onnx_path, precision).summary()})
    return out


def run(cfg: Config, model: str, root: Path = Path(".")) -> TrtAuditResult:
    entries = audits(cfg, model, root)
    failures = [f"{e['precision']} ({e['onnx']}): {p['node']} ({p['op']}): {p['detail']}"
                for e in entries if not e.get("skipped") for p in e["problems"]]
    report = {"model": model, "target": TARGET, "method": "static", "audits": entries,
              "parses": not failures}
    path = report_path(model, root)
    write_bytes_atomic(path, (json.dumps(report, sort_keys=True, indent=1) + "\n").encode())
    return TrtAuditResult(path, report, failures)
