"""aoti-cpu: probe, the torch.export program stage, one real AOTInductor compile, and the engines' `source:` key."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
import yaml

from pipeline import config, paths, targets
from pipeline.errors import KilnError
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.stages import toolchain as toolchain_stage, program, validate
from pipeline.targets.aoti import BUILD_ROOT, PACKAGE_FILE
from conftest import REPO
from conftest import write_params as _write

ENGINE = "embedder-aoti-cpu-fp32"


# ---------------------------------------------------------------------------------------------- probe
def test_probe_records_torch_compiler_and_flags(tmp_path):
    tc = toolchain_stage.probe("aoti-cpu")
    path, changed = toolchain_stage.write("aoti-cpu", tc, tmp_path)
    doc = yaml.safe_load(path.read_text())
    assert changed and tc.available and doc["available"] is True and "info" not in doc   # host facts: the record
    r = doc["rebuild_on"]
    assert r["torch"] == torch.__version__
    assert r["cxx_version"] and ("g++" in r["cxx_version"] or "clang" in r["cxx_version"])
    assert {"O3", "shared", "fPIC"} <= set(r["cxx_flags"]) and r["vec_isa"] and "isa" in r and "machine" in r
    assert tc.info["cxx_path"].startswith("/") and "cpp_builder" in tc.info["flags_source"]
    assert "torch" in tc.info["libraries"]
    assert tc.line().startswith("aoti-cpu: available (torch ")
    assert toolchain_stage.write("aoti-cpu", tc, tmp_path) == (path, False)      # unchanged → not rewritten


def test_target_declares_its_source_kind():
    assert targets.TARGETS["aoti-cpu"].source_kind == "program"
    assert targets.source_kind("aoti-cpu") == "program" and targets.source_kind("ort-cpu") == "onnx"


# ---------------------------------------------------------------------------------------------- program stage
@pytest.fixture(scope="module")
def program_dir(built, cfg):
    r = program.run(cfg, "embedder", built)
    assert r.deterministic == "fresh-process re-export: bit-identical", r.deterministic
    return paths.program("embedder", built)


def test_program_stage_writes_a_loadable_program(program_dir, built, cfg):
    m = read_manifest(program_dir / "embedder.manifest.json")
    assert m["kind"] == "program" and m["build"]["reproducibility"]["checked"].endswith("bit-identical")
    assert {i["role"] for i in m["inputs"]} == {"golden", "weights"}
    assert m["results"]["parity"]["max_abs"] <= cfg.export.parity.max_abs
    assert m["results"]["ops"]["aten.conv2d.default"] == 29
    assert verify_manifest(program_dir / "embedder.manifest.json", root=built) == []
    ep = torch.export.load(program_dir / program.PROGRAM_FILE)
    x = torch.rand(3, 3, 150, 150) * 255  # a batch size it was not traced with: the batch dim is symbolic
    assert ep.module()(x).shape == (3, 128)
    saved = zipfile.ZipFile(program_dir / program.PROGRAM_FILE)
    assert not any(str(built) in saved.read(n).decode("latin-1") for n in saved.namelist()), "checkout path inside"
    assert not any("stack_trace" in saved.read(n).decode("latin-1") for n in saved.namelist() if n.endswith(".json"))


# ---------------------------------------------------------------------------------------------- one real compile
@pytest.mark.slow
def test_compiled_package_loads_matches_golden_and_verifies(program_dir, built, cfg):
    toolchain_stage.run(cfg, built)
    r = compile_stage.run(cfg, ENGINE, built)          # the one AOTInductor compile of the suite (20–50 s)
    engine = paths.engine(ENGINE, built)
    import fcntl
    import os

    base = BUILD_ROOT / f"kiln-aoti-build-{os.getuid()}"
    with open(base / "lock", "w", encoding="utf-8") as lock:   # another checkout's compile (same user, same fixed
        fcntl.flock(lock, fcntl.LOCK_EX)                       # directory) holds the lock while it builds there
        assert not (base / "build").exists(), "inductor build dir left behind"
    manifest = engine / f"{ENGINE}.manifest.json"
    assert verify_manifest(manifest, root=built) == []
    m = read_manifest(manifest)
    assert [i["role"] for i in m["inputs"]] == ["program"]
    assert m["build"]["reproducibility"]["claim"] == "bit-identical"
    assert "rebuild-check" in m["build"]["reproducibility"]["checked"]          # not checked at compile: says how
    assert m["toolchain"]["target.aoti-cpu"]["cxx_version"] and m["results"]["package"]["cpu_isa"]
    with zipfile.ZipFile(engine / PACKAGE_FILE) as z:                            # no checkout path inside
        assert not any(str(built).encode() in z.read(n) for n in z.namelist())

    # audit: what the generated wrapper calls
    a = r.audit.summary()
    assert r.audit.ok and a["native"]["aten.convolution"] == 29 and a["other"]["generated_kernels"] >= 10
    assert any(k.startswith("inductor.aten.") for k in a["native"])
    with zipfile.ZipFile(engine / PACKAGE_FILE) as z:
        assert any(n.endswith(".wrapper.so") for n in z.namelist())
    int8_view = targets.get("aoti-cpu").audit(engine, "int8")  # the same package read as INT8: convs are float
    assert {f["op"] for f in int8_view.fallback} >= {"aten.convolution"}

    # loads, runs any batch, and passes the face-task gate
    from pipeline import engines

    runner = engines.load("aoti-cpu", engine)
    assert runner.run(np.zeros((5, 3, 150, 150), np.float32)).shape == (5, 128)
    v = validate.run(cfg, ENGINE, built)
    assert v.passed, v.failures
    assert v.metrics["cosine_min"] > 0.99999 and v.metrics["l2_max"] < 1e-3
    assert json.loads((engine / "options.json").read_text())["threads"] == 2

    # cold start: the runner opens the package with the C++ loader alone — no torch._inductor import (≈ 1 s) —
    # and its outputs are bit-identical to torch's own aoti_load_package wrapper
    probe = (f"import sys, numpy as np; from pipeline import engines; "
             f"r = engines.load('aoti-cpu', {str(engine)!r}); x = np.random.default_rng(0).random((3, 3, 150, 150), "
             f"np.float32) * 255; y = r.run(x); assert 'torch._inductor' not in sys.modules, 'inductor imported'; "
             f"import torch; w = torch._inductor.aoti_load_package({str(engine / PACKAGE_FILE)!r}); "
             f"o = w(torch.from_numpy(x)); o = o if isinstance(o, torch.Tensor) else o[0]; "
             f"print(o.shape == y.shape, float(np.abs(o.numpy() - y).max()))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "0.0"], out.stdout


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("mutate, key, hint", [
    (lambda r: r["engines"][ENGINE].update(source="artifacts/export/embedder"), f"engines.{ENGINE}.source",
     "artifacts/program/embedder"),
    (lambda r: r["engines"]["embedder-ort-cpu-fp32"].update(source="artifacts/program/embedder"),
     "engines.embedder-ort-cpu-fp32.source", "artifacts/export/embedder"),
    (lambda r: r["engines"]["embedder-ort-cpu-int8"].update(source="artifacts/export/embedder"),
     "engines.embedder-ort-cpu-int8.source", "artifacts/quantized/embedder-ort"),
    (lambda r: r["engines"][ENGINE].update(onnx=r["engines"][ENGINE].pop("source")),
     f"engines.{ENGINE}.onnx: unknown key", "spelling"),
    (lambda r: r["engines"][ENGINE].pop("source"), f"engines.{ENGINE}.source: missing", "source"),
    (lambda r: r["engines"][ENGINE].update(precision="int8", recipe="ort"), f"engines.{ENGINE}.precision",
     "fp32"),
    (lambda r: r["program"].update(models=[]), "-aoti-cpu-fp32.model: ", "program.models"),  # first aoti engine
    (lambda r: r["program"].update(models=["nobody"]), "program.models: no model named 'nobody'", "known models"),
])
def test_source_key_errors(tmp_path, mutate, key, hint):
    """Structure from config.load; what needs the target registry from targets.check (kiln dag runs both)."""
    p = _write(tmp_path, mutate)
    with pytest.raises(KilnError) as e:
        targets.check(config.load(p))
    assert str(p) in e.value.message and key in e.value.message, e.value.message
    assert hint in e.value.hint, e.value.hint


def test_repository_engines_name_their_sources(cfg):
    assert cfg.engine(ENGINE).source == "artifacts/program/embedder"
    assert cfg.engine("embedder-ort-cpu-int8").source == "artifacts/quantized/embedder-ort"
