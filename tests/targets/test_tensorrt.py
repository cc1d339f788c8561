"""tensorrt target without TensorRT: options → builder plan, fingerprint + rebuild decision, ONNX preparation,
inspector-JSON parsing (10.x and 11.x schemas), the explicit "unavailable" path, and the static audit hook.

Nothing here imports TensorRT or needs a GPU, and nothing skips where TensorRT is installed: the unavailable path
runs as on a host without it (`without_tensorrt` makes `import tensorrt` fail as a missing package does). What needs
TensorRT (compile, load, TrtRunner, probe on a GPU host) is listed in the module docstring of
pipeline/targets/tensorrt.py and is exercised only on a GPU host.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from pipeline import config, paths, targets
from pipeline.errors import KilnError
from pipeline.stages import compile as compile_stage
from pipeline.stages import toolchain as toolchain_stage
from pipeline.targets import tensorrt as trt_target
from pipeline.targets.tensorrt import TensorRT, TrtOptions, build_plan, check_loadable, make_fingerprint
from pipeline.targets.trt_inspector import inspector_audit, norm_dtype, parse_inspector
from pipeline.targets.trt_onnx import prepare_onnx

REPO = Path(__file__).resolve().parents[2]


class NoTensorRT(importlib.abc.MetaPathFinder):
    """A host without TensorRT, whether or not this one has it: `import tensorrt` fails as a missing package does."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "tensorrt":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def without_tensorrt(monkeypatch):
    """This process as on a host without TensorRT (an imported one is forgotten for the test's duration)."""
    monkeypatch.setattr(sys, "meta_path", [NoTensorRT(), *sys.meta_path])
    for name in [m for m in sys.modules if m.partition(".")[0] == "tensorrt"]:
        monkeypatch.delitem(sys.modules, name)


def without_tensorrt_cmd(code: str) -> list[str]:
    """A fresh interpreter that runs `code` as on a host without TensorRT."""
    return [sys.executable, "-c", f"import importlib.abc, sys\n{inspect.getsource(NoTensorRT)}"
                                  f"sys.meta_path.insert(0, NoTensorRT())\n{code}"]

# ----------------------------------------------------------------------------------------------- inspector fixtures
# TensorRT 10.x schema: engine JSON has "Bindings": [names]; layer inputs/outputs carry one combined
# "Format/Datatype" string. Shape of the document as produced by IEngineInspector.get_engine_information(JSON) with
# ProfilingVerbosity.DETAILED (the form trtexec --exportLayerInfo and Polygraphy print for 8.6–10.x).
# Field values (tactic names, format strings) are representative, not captured from a real build [U].
INSPECTOR_10X = {
    "Layers": [
        {"Name": "/stem/Conv + /stem/Relu", "LayerType": "CaskConvolution",
         "Inputs": [{"Name": "input", "Location": "Device", "Dimensions": [8, 3, 150, 150],
                     "Format/Datatype": "Four wide channel vectorized row major Int8 format"}],
         "Outputs": [{"Name": "/stem/Relu_output_0", "Location": "Device", "Dimensions": [8, 32, 73, 73],
                      "Format/Datatype": "Thirty-two wide channel vectorized row major Int8 format"}],
         "ParameterType": "Convolution", "Kernel": [7, 7], "Groups": 1, "OutMaps": 32,
         "Weights": {"Type": "Int8", "Count": 4704}, "Bias": {"Type": "Float", "Count": 32}, "HasReLU": 1,
         "TacticName": "sm90_xmma_fprop_implicit_gemm_interleaved_i8i8_i8i32_f32_nchw_vect_c_32kcrs_vect_c_32",
         "StreamId": 0, "Metadata": "[ONNX Layer: /stem/Conv]\u001e[ONNX Layer: /stem/Relu]"},
        {"Name": "/fc/MatMul", "LayerType": "CaskGemmMatrixMultiply",
         "Inputs": [{"Name": "/Flatten_output_0", "Location": "Device", "Dimensions": [8, 256],
                     "Format/Datatype": "Row major linear FP32"}],
         "Outputs": [{"Name": "output", "Location": "Device", "Dimensions": [8, 128],
                      "Format/Datatype": "Row major linear FP32"}],
         "ParameterType": "MatrixMultiply", "TacticName": "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n", "StreamId": 0,
         "Metadata": "[ONNX Layer: /fc/MatMul]"},
        {"Name": "Reformatting CopyNode for Output Tensor 0 to /fc/MatMul", "LayerType": "Reformat",
         "Inputs": [{"Name": "output", "Location": "Device", "Dimensions": [8, 128],
                     "Format/Datatype": "Row major linear FP32"}],
         "Outputs": [{"Name": "output", "Location": "Device", "Dimensions": [8, 128],
                      "Format/Datatype": "Row major linear FP32"}],
         "ParameterType": "Reformat", "Origin": "REFORMAT", "TacticValue": "0x0000000000000000", "StreamId": 0,
         "Metadata": ""},
    ],
    "Bindings": ["input", "output"],
}
# TensorRT 11.x schema (IEngineInspector migration guide, docs.nvidia.com/deeplearning/tensorrt/11.3.0/api/migration/
# tensorrt-10x-to-11x-IEngineInspector.html): "Bindings" became "I/O Tensors" with
# {Name, IOMode, DataType, Dimensions, Location, IsShapeInferenceIO, ProfileInfo[{MinShape,OptShape,MaxShape,Format}]},
# and the layer I/O "Format/Datatype" field is split into "Format" and "DataType". Exact string values are [U].
INSPECTOR_11X = {
    "Layers": [
        {"Name": "/stem/Conv + /stem/Relu", "LayerType": "CaskConvolution",
         "Inputs": [{"Name": "input", "Location": "Device", "Dimensions": [8, 3, 150, 150],
                     "Format": "Channel major format where channel % 8 == 0", "DataType": "FP16"}],
         "Outputs": [{"Name": "/stem/Relu_output_0", "Location": "Device", "Dimensions": [8, 32, 73, 73],
                      "Format": "Channel major format where channel % 8 == 0", "DataType": "FP16"}],
         "ParameterType": "Convolution", "Weights": {"Type": "Half", "Count": 4704},
         "TacticName": "sm90_xmma_fprop_implicit_gemm_f16f16_f16f16_f16_nhwckrsc_nhwc", "StreamId": 0,
         "Metadata": "[ONNX Layer: /stem/Conv]\u001e[ONNX Layer: /stem/Relu]"},
        {"Name": "/fc/MatMul", "LayerType": "CaskGemmMatrixMultiply",
         "Inputs": [{"Name": "/Flatten_output_0", "Location": "Device", "Dimensions": [8, 256],
                     "Format": "Row major linear", "DataType": "FP32"}],
         "Outputs": [{"Name": "output", "Location": "Device", "Dimensions": [8, 128],
                      "Format": "Row major linear", "DataType": "FP32"}],
         "ParameterType": "MatrixMultiply", "StreamId": 0, "Metadata": "[ONNX Layer: /fc/MatMul]"},
    ],
    "I/O Tensors": [
        {"Name": "input", "IOMode": "Input", "DataType": "FP32", "Dimensions": [-1, 3, 150, 150],
         "Location": "Device", "IsShapeInferenceIO": False,
         "ProfileInfo": [{"MinShape": [1, 3, 150, 150], "OptShape": [8, 3, 150, 150], "MaxShape": [32, 3, 150, 150],
                          "Format": "Row major linear"}]},
        {"Name": "output", "IOMode": "Output", "DataType": "FP32", "Dimensions": [-1, 128], "Location": "Device",
         "IsShapeInferenceIO": False, "ProfileInfo": []},
    ],
}


# ----------------------------------------------------------------------------------------------- availability
def test_importing_the_targets_imports_no_tensorrt():
    """In a fresh process (TensorRT installed or not): the registry and the tensorrt target's module load without
    even trying to import TensorRT (a finder records every attempt), which only a probe, a compile or a load does."""
    import subprocess

    record = ("import sys\nclass Seen:\n    tried = []\n    def find_spec(self, name, path=None, target=None):\n"
              "        if name.partition('.')[0] == 'tensorrt': Seen.tried.append(name)\n"
              "sys.meta_path.insert(0, Seen())\n"
              "from pipeline import targets\nfrom pipeline.targets import tensorrt\nt = targets.get('tensorrt')\n"
              "print(Seen.tried)\n")
    r = subprocess.run([sys.executable, "-c", record], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_probe_without_tensorrt(without_tensorrt):
    tc = targets.get("tensorrt").probe()
    assert not tc.available and tc.line() == "tensorrt: unavailable (no module named 'tensorrt')"


def test_toolchain_stage_records_unavailable(tmp_path):
    """The real stage, in a fresh process on a host without TensorRT: the file says unavailable and why, and
    holds no rebuild keys."""
    import shutil
    import subprocess

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    run = f"import runpy; runpy.run_module({toolchain_stage.__name__!r}, run_name='__main__', alter_sys=True)"
    r = subprocess.run(without_tensorrt_cmd(run), cwd=tmp_path, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert "tensorrt: unavailable (no module named 'tensorrt')" in r.stdout
    doc = yaml.safe_load((tmp_path / "artifacts/toolchain/tensorrt.yaml").read_text())
    assert doc == {"target": "tensorrt", "available": False, "reason": "no module named 'tensorrt'", "rebuild_on": {}}
    record = json.loads((tmp_path / "artifacts/records/toolchain.json").read_text())
    assert record["stage"] == "toolchain" and "git" in record and record["host"]


def _gpu_cfg(tmp_path: Path) -> config.Config:
    """params.yaml with profiles/gpu.yaml merged over it (what `kiln profile gpu` writes)."""
    from pipeline.dagtools import profiles

    p = tmp_path / "params.yaml"
    p.write_text((REPO / "params.yaml").read_text())
    assert profiles.apply("gpu", p, REPO)
    return config.load(p)


def test_gpu_profile_is_a_valid_configuration(tmp_path):
    cfg = _gpu_cfg(tmp_path)
    assert cfg.targets["tensorrt"].enabled
    fp16, int8 = cfg.engine("embedder-tensorrt-fp16"), cfg.engine("embedder-tensorrt-int8")
    assert (fp16.precision, fp16.recipe) == ("fp16", None) and (int8.precision, int8.recipe) == ("int8", "symmetric")
    assert not config.load(REPO / "params.yaml").targets["tensorrt"].enabled


def test_asking_for_tensorrt_here_fails_clearly_and_builds_nothing(built, tmp_path, without_tensorrt):
    cfg = _gpu_cfg(tmp_path)
    toolchain_stage.run(cfg, built)
    for name in ("embedder-tensorrt-fp16", "embedder-tensorrt-int8"):
        with pytest.raises(KilnError, match=r"tensorrt: unavailable \(no module named 'tensorrt'\)"):
            compile_stage.run(cfg, name, built)
        out = paths.engine(name, built)
        assert not out.exists() and not list(out.parent.glob(f".{name}.*"))   # no partial or temporary dir


# ----------------------------------------------------------------------------------------------- options → plan
def test_params_map_to_builder_plan(cfg):
    opts = TrtOptions.parse(cfg.targets["tensorrt"].options)
    plan = build_plan(opts, "input", (3, 150, 150))
    assert plan.network_flags == ("STRONGLY_TYPED",)
    assert plan.profiles == [{"input": {"min": [1, 3, 150, 150], "opt": [8, 3, 150, 150], "max": [32, 3, 150, 150]}}]
    assert plan.builder_optimization_level == 3 and plan.workspace_bytes == 2048 << 20
    assert plan.profiling_verbosity == "DETAILED" and plan.hardware_compatibility_level == "NONE"
    # strongly typed: no precision flag is ever set (they are removed in TensorRT 11)
    forbidden = {"FP16", "INT8", "BF16", "FP8", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS",
                 "EXPLICIT_BATCH"}
    for mode, flag in (("reuse", None), ("strict", "ERROR_ON_TIMING_CACHE_MISS"), ("off", "DISABLE_TIMING_CACHE")):
        p = build_plan(dataclasses.replace(opts, timing_cache_mode=mode, version_compatible=True), "x", (3, 8, 8))
        assert not forbidden & set(p.builder_flags + p.network_flags)
        assert "VERSION_COMPATIBLE" in p.builder_flags and (flag is None or flag in p.builder_flags)


@pytest.mark.parametrize("options, key", [
    ({"profile": {"min_batch": 4, "opt_batch": 2, "max_batch": 8}}, "targets.tensorrt.profile"),
    ({"profile": {"min_batch": 0}}, "targets.tensorrt.profile.min_batch"),
    ({"builder_optimization_level": 6}, "targets.tensorrt.builder_optimization_level"),
    ({"timing_cache": {"mode": "always"}}, "targets.tensorrt.timing_cache.mode"),
    ({"hardware_compatibility": "hopper"}, "targets.tensorrt.hardware_compatibility"),
    ({"fp16": True}, "targets.tensorrt.fp16"),
])
def test_bad_options_name_the_key(options, key):
    with pytest.raises(KilnError, match=key.replace(".", r"\.")):
        TrtOptions.parse(options)


# ----------------------------------------------------------------------------------------------- fingerprint
FP = make_fingerprint("10.16.1.11", "tensorrt-cu13-libs 10.16.1.11", "9.0", "NVIDIA H200", "580.95.05", "13.0",
                      "linux-x86_64-glibc-2.35")


def _manifest(fp: dict, **options) -> dict:
    return {"toolchain": {**fp, "onnx": "1.23.2"}, "build": {"options": options}}


def test_same_fingerprint_is_loadable_any_difference_rebuilds():
    assert check_loadable(_manifest(FP), FP)
    assert check_loadable(_manifest(FP), {"available": True, "rebuild_on": FP, "reason": ""})
    changes = {"tensorrt": "10.16.1.12", "tensorrt_package": "tensorrt-cu12-libs 10.16.1.11",
               "compute_capability": "8.6",      # NVIDIA/TensorRT#564: "expecting compute 6.1 got compute 7.5"
               "gpu_name": "NVIDIA H100 80GB HBM3", "driver": "575.57.08",   # NVIDIA/TensorRT#3911: driver alone
               "cuda": "12.9", "platform": "win32-AMD64"}
    for key, value in changes.items():
        d = check_loadable(_manifest(FP), {**FP, key: value})
        assert not d and len(d.reasons) == 1 and d.reasons[0].startswith(f"{key}:"), (key, d)
    d = check_loadable({"toolchain": {}}, FP)
    assert not d and all("not recorded" in r for r in d.reasons)
    d = check_loadable(_manifest(FP), {"available": False, "reason": "no module named 'tensorrt'"})
    assert not d and "unavailable" in d.reasons[0]


def test_compatibility_options_relax_only_what_they_document():
    vc = _manifest(FP, version_compatible=True)
    assert check_loadable(vc, {**FP, "tensorrt": "10.17.0.3"})          # newer, same major
    assert check_loadable(vc, {**FP, "tensorrt": "11.4.0.106", "tensorrt_package": "tensorrt-cu13-libs 11.4"})
    assert not check_loadable(vc, {**FP, "tensorrt": "10.15.1.29"})     # never an older runtime
    assert not check_loadable(vc, {**FP, "driver": "575.57.08"})        # still strict elsewhere
    amp = _manifest({**FP, "compute_capability": "8.6", "gpu_name": "NVIDIA A10"}, hardware_compatibility="ampere_plus")
    assert check_loadable(amp, FP)
    assert not check_loadable(amp, {**FP, "compute_capability": "7.5", "gpu_name": "Tesla T4"})


# ----------------------------------------------------------------------------------------------- ONNX preparation
def _tiny(opset: int = 17, batch: int | str = 1) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4, 6, 6])
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                           helper.make_node("Relu", ["c"], ["y"], name="relu")], "tiny", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_prepare_makes_batch_dynamic_and_checks_opset_and_precision(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(_tiny(), p)
    m = prepare_onnx(p, "fp32")
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    with pytest.raises(KilnError, match="needs a QDQ ONNX"):
        prepare_onnx(p, "int8")
    onnx.save(_tiny(opset=8), p)
    with pytest.raises(KilnError, match=r"opset 8 is outside .* \(9\.\.24\)"):
        prepare_onnx(p, "fp32")


def test_fp16_keeps_fp32_io_and_is_deterministic(built):
    src = paths.export("embedder", built) / "model.onnx"
    a, b = prepare_onnx(src, "fp16"), prepare_onnx(src, "fp16")
    assert trt_target.onnx_bytes(a) == trt_target.onnx_bytes(b)
    assert [i.type.tensor_type.elem_type for i in a.graph.input] == [TensorProto.FLOAT]
    assert [o.type.tensor_type.elem_type for o in a.graph.output] == [TensorProto.FLOAT]
    conv_w = {n.input[1] for n in a.graph.node if n.op_type == "Conv"}
    assert {i.data_type for i in a.graph.initializer if i.name in conv_w} == {TensorProto.FLOAT16}
    audit = TensorRT().audit(src, "fp16")                    # no TensorRT here → the static rules
    assert audit.ok and audit.native["Conv"] == 29


# ----------------------------------------------------------------------------------------------- inspector
def test_inspector_10x_schema():
    s = parse_inspector(json.dumps(INSPECTOR_10X))
    assert s["schema"] == "10.x" and s["detailed"] and s["num_layers"] == 3
    assert [x["name"] for x in s["io_tensors"]] == ["input", "output"]
    assert s["layers"][0]["inputs"] == ["int8"] and s["layers"][0]["onnx"] == ["/stem/Conv", "/stem/Relu"]
    assert s["layer_output_precisions"] == {"float32": 2, "int8": 1}
    audit = inspector_audit(s, "int8")
    assert audit.native == {"CaskConvolution": 1}
    assert audit.fallback == [{"node": "/fc/MatMul", "op": "CaskGemmMatrixMultiply", "runs_as": "float32"}]
    assert audit.other == {"Reformat": 1}


def test_inspector_11x_schema():
    s = parse_inspector(INSPECTOR_11X)
    assert s["schema"] == "11.x" and s["num_layers"] == 2
    assert s["io_tensors"][0] == {"name": "input", "mode": "input", "dtype": "float32", "shape": [-1, 3, 150, 150]}
    assert [x["outputs"] for x in s["layers"]] == [["float16"], ["float32"]]
    audit = inspector_audit(s, "fp16")
    assert audit.native == {"CaskConvolution": 1} and audit.fallback[0]["runs_as"] == "float32"


def test_inspector_names_only_and_per_layer_documents():
    """LAYER_NAMES_ONLY engines list names; per-layer get_layer_information() JSON strings fill the detail in."""
    names = {"Layers": ["/stem/Conv + /stem/Relu", "/fc/MatMul"], "Bindings": ["input", "output"]}
    s = parse_inspector(names)
    assert not s["detailed"] and [x["type"] for x in s["layers"]] == ["unknown", "unknown"]
    s2 = parse_inspector(names, [json.dumps(x) for x in INSPECTOR_10X["Layers"][:2]])
    assert s2["detailed"] and s2["layers"][1]["inputs"] == ["float32"]
    # equivalence is the layer list: same layers → same signature, any change → a different one
    assert parse_inspector(INSPECTOR_10X)["layer_signature"] == parse_inspector(INSPECTOR_10X)["layer_signature"]
    assert s2["layer_signature"] != parse_inspector(INSPECTOR_10X)["layer_signature"]


@pytest.mark.parametrize("text, want", [("Row major linear FP32", "float32"), ("Int8", "int8"), ("FP16", "float16"),
                                        ("Channel major FP16 format where channel % 8 == 0", "float16"),
                                        ("DataType.HALF", "float16"), ("kINT8", "int8"), ("BF16", "bfloat16"),
                                        (None, "unknown")])
def test_norm_dtype(text, want):
    assert norm_dtype(text) == want


def test_manifest_extras_carry_the_build_plan_and_inspector(tmp_path):
    plan = build_plan(TrtOptions(), "input", (3, 150, 150))
    (tmp_path / "build.json").write_text(json.dumps({
        "plan": plan.record(), "onnx_parsed_sha256": "0" * 64, "precision_source": "QDQ (explicit quantization)",
        "timing_cache": {"file": "trt10.16-sm9.0.timing", "mode": "reuse", "sha256_before": None,
                         "sha256_after": "1" * 64}}))
    (tmp_path / "inspector.json").write_text(json.dumps(parse_inspector(INSPECTOR_11X)))
    extras = TensorRT().manifest_extras(tmp_path)
    assert extras["build"]["plan"] == json.loads(json.dumps(plan.record()))           # what build.json holds
    assert extras["build"]["builder_optimization_level"] == 3
    assert extras["results"]["timing_cache"]["sha256_after"] == "1" * 64
    assert extras["results"]["inspector"]["schema"] == "11.x"
    assert TensorRT().audit(tmp_path, "fp16").native == {"CaskConvolution": 1}   # a built engine: its inspector
