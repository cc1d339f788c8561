"""fallback-table: for every model × target × precision, how many compute nodes run natively, which fall back.

Sources, labelled in every row:

* `engine` — a built engine's manifest, `results.audit` (ort-cpu, aoti-cpu, or tensorrt built on a GPU host);
* `static` — for a TensorRT engine not built on this host: trt_rules' audit of the ONNX the engine would be built
  from (read from artifacts/reports/trt-audit/<model>.json, or computed if that report is absent). Static rows say
  `parses: false` where the TensorRT ONNX parser would reject the graph (the engine would not build at all);
* `missing` — an engine in params.yaml that is neither built here nor statically auditable.

Writes artifacts/reports/fallback.json (a list of flat rows: DVC plots-friendly) and fallback.md (a table).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline import paths
from pipeline.config import Config
from pipeline.manifest import manifest_path, write_bytes_atomic
from pipeline.stages import trt_audit

STATIC_TARGETS = ("tensorrt",)


@dataclass(frozen=True)
class FallbackResult:
    rows: list[dict]
    json_path: Path
    md_path: Path


def out_dir(root: Path = Path(".")) -> Path:
    return root / paths.ARTIFACTS / "reports"


def _row(model: str, target: str, precision: str, engine: str, source: str, audit: dict | None,
         parses: bool | None = None, note: str = "") -> dict:
    fallback = audit.get("fallback", []) if audit else []
    return {"row": f"{model}/{target}/{precision}", "model": model, "target": target, "precision": precision,
            "engine": engine, "source": source,
            "native_nodes": audit.get("native_nodes") if audit else None,
            "fallback_nodes": audit.get("fallback_nodes") if audit else None,
            "falls_back_as": dict(sorted(Counter(f["runs_as"] for f in fallback).items())),
            "fallback_ops": dict(sorted(Counter(f["op"] for f in fallback).items())),
            "parses": parses, "note": note}


def _static_entries(cfg: Config, model: str, root: Path) -> list[dict]:
    report = trt_audit.report_path(model, root)
    if report.is_file():
        return json.loads(report.read_text())["audits"]
    return trt_audit.audits(cfg, model, root)


def rows(cfg: Config, root: Path = Path(".")) -> list[dict]:
    out, covered = [], set()
    for name, spec in sorted(cfg.engines.items()):
        m = manifest_path(paths.engine(name, root), name)
        covered.add((spec.model, spec.target, spec.precision))
        if m.is_file():
            doc = json.loads(m.read_text())
            out.append(_row(spec.model, spec.target, spec.precision, name, "engine", doc["results"]["audit"]))
        elif spec.target in STATIC_TARGETS:
            covered.discard((spec.model, spec.target, spec.precision))   # filled by the static rows below
        else:
            out.append(_row(spec.model, spec.target, spec.precision, name, "missing", None,
                            note="not built on this host (dvc repro compile)"))
    engine_of = {(s.model, s.target, s.precision): n for n, s in cfg.engines.items()}
    for target in STATIC_TARGETS:
        if target not in cfg.targets:
            continue
        for model in sorted(cfg.models):
            for e in _static_entries(cfg, model, root):
                key = (model, target, e["precision"])
                if key in covered:
                    continue
                engine = engine_of.get(key, "")
                if e.get("skipped"):
                    out.append(_row(model, target, e["precision"], engine, "static", None, note=e["skipped"]))
                    continue
                rules = ", ".join(f"{k}×{v}" for k, v in e["problem_rules"].items())
                out.append(_row(model, target, e["precision"], engine, "static", e["audit"], e["parses"],
                                note=f"from {e['onnx']}" + (f"; parser would reject: {rules}" if rules else "")))
    return sorted(out, key=lambda r: (r["model"], r["target"], ["fp32", "fp16", "int8"].index(r["precision"])))


def markdown(table: list[dict]) -> str:
    head = ["model", "target", "precision", "source", "native", "fallback", "falls back as", "parses", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        as_ = ", ".join(f"{k} ×{v}" for k, v in r["falls_back_as"].items()) or "-"
        cells = [r["model"], r["target"], r["precision"], r["source"],
                 "-" if r["native_nodes"] is None else str(r["native_nodes"]),
                 "-" if r["fallback_nodes"] is None else str(r["fallback_nodes"]), as_,
                 {None: "-", True: "yes", False: "**no**"}[r["parses"]], r["note"] or ""]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return ("# Native vs fallback compute nodes per model × target × precision\n\n"
            "`engine`: the built engine's audit. `static`: TensorRT's ONNX-parser rules applied to the ONNX the engine "
            "would be built from (no GPU here). Compute nodes: Conv, ConvTranspose, MatMul, Gemm (+ Add, Mul, pools "
            "when they run natively).\n\n" + "\n".join(lines) + "\n")


def run(cfg: Config, root: Path = Path(".")) -> FallbackResult:
    table = rows(cfg, root)
    d = out_dir(root)
    jp, mp = d / "fallback.json", d / "fallback.md"
    write_bytes_atomic(jp, (json.dumps(table, sort_keys=True, indent=1) + "\n").encode())
    write_bytes_atomic(mp, markdown(table).encode())
    return FallbackResult(table, jp, mp)
