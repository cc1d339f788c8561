"""Export: byte-identical across fresh processes, parity-gated, inventoried, manifest verifies."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys

import pytest

from pipeline.errors import GateFailed
from pipeline.manifest import verify_manifest
from pipeline.stages import export
from conftest import REPO

_EXPORT = """
import dataclasses, sys
from pathlib import Path
from pipeline import config, models
from pipeline.models.export import export_onnx
cfg = config.load(Path(sys.argv[1]))
m = dataclasses.replace(cfg.model("embedder"), weights=sys.argv[2])
export_onnx(models.build(m), m, cfg.export, Path(sys.argv[3]))
"""


def test_export_is_byte_identical_across_processes(tmp_path, assets_dir):
    digests = []
    for i in range(2):
        out = tmp_path / f"m{i}.onnx"
        subprocess.run([sys.executable, "-c", _EXPORT, str(REPO / "params.yaml"),
                        str(assets_dir / "dlib_face_recognition_resnet_model_v1.dat"), str(out)], check=True)
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_exported_artifact_is_checked_and_recorded(built):
    d = built / "artifacts/export/embedder"
    m = json.loads((d / "embedder.manifest.json").read_text())
    assert verify_manifest(d / "embedder.manifest.json", root=built) == []
    assert m["results"]["ops"]["Conv"] == 29 and m["results"]["parity"]["max_abs"] < 1e-4
    assert m["results"]["outputs"]["output"] == ["batch", 128]
    assert {i["role"] for i in m["inputs"]} == {"golden"}
    assert m["toolchain"]["torch"].startswith("2.13.0") and m["build"]["opset"] == 17
    assert "source" not in m and "record" not in m                      # identity only: no commit, host or times
    assert "pipeline/stages/export.py" in m["code"] and "export" in m["params"]["values"]


def test_parity_beyond_tolerance_fails_and_writes_nothing(built, cfg, tmp_path):
    strict = cfg.replace(export=dataclasses.replace(cfg.export, parity=dataclasses.replace(cfg.export.parity,
                                                                                          max_abs=0.0)))
    before = (built / "artifacts/export/embedder/model.onnx").stat().st_mtime_ns
    with pytest.raises(GateFailed, match="differs from PyTorch beyond tolerance"):
        export.run(strict, "embedder", built)
    assert (built / "artifacts/export/embedder/model.onnx").stat().st_mtime_ns == before
    assert not [p.name for p in (built / "artifacts/export").iterdir() if p.name.startswith(".")]  # no temp dirs
