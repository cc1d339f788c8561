"""The native-vs-fallback table: for every model × target × precision, how many compute nodes run natively and
which fall back — from each built engine's manifest (`results.audit`, with notes on the devices its target also
asked about), statically for a TensorRT engine not built here (trt_static), else `missing` — as flat rows
(DVC plots-friendly) and a markdown table."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, tables
from pipeline.config import PRECISIONS
from pipeline.manifest import manifest_path
from pipeline.targets import trt_static

if TYPE_CHECKING:
    from pipeline.config import Config

STATIC_TARGETS = ("tensorrt",)


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


def device_notes(query: dict) -> list[str]:
    """One note per other device a target's audit asked about (OpenVINO's NPU query, LiteRT's Edge TPU rules)."""
    notes = []
    for device, q in sorted(query.items()):
        if device == "CPU":
            continue
        if not q.get("queried"):
            reason = q.get("reason", "?")
            if lib := re.search(r'[Cc]annot load library "?([^":]+)', reason):    # OpenVINO: a missing plugin part
                reason = f"cannot load {lib.group(1)}"
            notes.append(f"{device}: not queried ({reason[:110]})")
            continue
        note = f"{device}: {q['supported']}/{q['ops']} ops supported"
        if q.get("cpu_ops"):
            note += f", {q['cpu_ops']} left to the CPU from {q['first_unsupported']}"
        if q.get("unsupported_op_types"):
            note += " (" + ", ".join(q["unsupported_op_types"][:5]) + ")"
        notes.append(note)
    return notes


def _static_entries(cfg: Config, model: str, root: Path) -> list[dict]:
    report = trt_static.report_path(model, root)
    if report.is_file():
        return json.loads(report.read_text(encoding="utf-8"))["audits"]
    return trt_static.audits(cfg, model, root)


def rows(cfg: Config, root: Path = Path(".")) -> list[dict]:
    out, covered = [], set()
    for name, spec in sorted(cfg.engines.items()):
        m = manifest_path(paths.engine(name, root), name)
        covered.add((spec.model, spec.target, spec.precision))
        if m.is_file():
            doc = json.loads(m.read_text(encoding="utf-8"))
            notes = []
            if (doc.get("build") or {}).get("build_only"):
                notes.append("built only (builder's layer audit; not run on this host)")
            if found := (doc.get("results") or {}).get("disagreements_with_static_rules"):
                notes.append(f"{len(found)} disagreement(s) with the static rules: " + "; ".join(found[:3]))
            notes += device_notes((doc.get("results") or {}).get("device_query") or {})
            out.append(_row(spec.model, spec.target, spec.precision, name, "engine", doc["results"]["audit"],
                            note="; ".join(notes)))
        elif spec.target in STATIC_TARGETS:
            covered.discard((spec.model, spec.target, spec.precision))   # filled by the static rows below
        else:
            out.append(_row(spec.model, spec.target, spec.precision, name, "missing", None,
                            note="not built on this host"))
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
    return sorted(out, key=lambda r: (r["model"], r["target"], PRECISIONS.index(r["precision"])))


def table(rows_: list[dict]) -> str:
    head = ["model", "target", "precision", "source", "native", "fallback", "falls back as", "parses", "note"]
    return tables.markdown(head, [[r["model"], r["target"], r["precision"], r["source"],
                                   "-" if r["native_nodes"] is None else str(r["native_nodes"]),
                                   "-" if r["fallback_nodes"] is None else str(r["fallback_nodes"]),
                                   ", ".join(f"{k} ×{v}" for k, v in r["falls_back_as"].items()) or "-",
                                   {None: "-", True: "yes", False: "**no**"}[r["parses"]], r["note"] or ""]
                                  for r in rows_])


def markdown(rows_: list[dict]) -> str:
    return ("# Native vs fallback compute nodes per model × target × precision\n\n"
            "`engine`: the built engine's audit. `static`: TensorRT's ONNX-parser rules applied to the ONNX the engine "
            "would be built from (no GPU here). Compute nodes: Conv, ConvTranspose, MatMul, Gemm (+ Add, Mul, pools "
            "when they run natively).\n\n" + table(rows_) + "\n")
