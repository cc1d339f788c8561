"""The build's summary (pipeline/report/summary.py) on a hand-made tree: every engine, precision report and system
by params; a gate that did not pass named at the top; a missing file named with the stage that writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import paths
from pipeline.errors import KilnError
from pipeline.manifest import manifest_path
from pipeline.quant.qdq import pairs
from pipeline.report import summary


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")


def tree(cfg, root: Path, failed: str | None = None) -> None:
    for e, spec in cfg.engines.items():
        _write(manifest_path(paths.validation(e, root), e), {"results": {"verdict": "fail" if e == failed else "pass"}})
        _write(manifest_path(paths.engine(e, root), e),
               {"toolchain": {f"target.{spec.target}": {"version": spec.target}}})
    for key in pairs(cfg):
        _write(summary.precision_file(key, root),
               {"results": {"first_bad": None, "worst": [{"name": "/conv1", "snr_db": 24.5}]}})
    for name in cfg.systems:
        _write(paths.system(name, root) / paths.VERDICT_FILE, {"verdict": "pass"})


def test_every_part_of_the_build_is_on_the_page(cfg, tmp_path):
    tree(cfg, tmp_path)
    doc = summary.collect(cfg, tmp_path)
    text = summary.markdown(doc)
    assert summary.problems(doc) == [] and "Every gate passed." in text
    assert all(f"| {e} " in text for e in cfg.engines) and all(f"| {s} " in text for s in cfg.systems)
    by_target = {}
    for r in doc["engines"]:
        by_target.setdefault(r["target"], set()).add(r["toolchain"])
    assert all(len(v) == 1 for v in by_target.values()) and len({next(iter(v)) for v in by_target.values()}) > 1


def test_a_gate_that_did_not_pass_heads_the_page(cfg, tmp_path):
    bad = next(iter(cfg.engines))
    tree(cfg, tmp_path, failed=bad)
    doc = summary.collect(cfg, tmp_path)
    assert summary.problems(doc) == [f"engine {bad}: fail"]
    assert f"Not passed: engine {bad}: fail." in summary.markdown(doc)


def test_a_missing_validation_names_its_stage(cfg, tmp_path):
    tree(cfg, tmp_path)
    e = next(iter(cfg.engines))
    manifest_path(paths.validation(e, tmp_path), e).unlink()
    with pytest.raises(KilnError) as err:
        summary.collect(cfg, tmp_path)
    assert f"validate@{e}" in err.value.message and "dvc repro dag/validate/dvc.yaml:" in err.value.hint
