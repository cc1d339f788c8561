"""openvino-cpu: probe, FP32 with the precision pinned, bf16, INT8 from the recipe's QDQ model, the runtime-precision
audit and the per-device op-support query (CPU, and NPU whose compiler is absent here), and the face-task gate."""

from __future__ import annotations

import json

import openvino as ov
import pytest
import yaml

from pipeline import config, paths, targets
from pipeline.errors import KilnError
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.stages import toolchain as toolchain_stage, validate
from pipeline.targets.openvino import CONFIG_FILE, XML_FILE, OpenVinoCpu, _reason
from conftest import REPO
from conftest import write_params as _write

BF16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
BF16_ENGINE = "embedder-openvino-cpu-bf16"            # profiles/bf16.yaml


@pytest.fixture(scope="module")
def cfg16(tmp_path_factory):
    """params.yaml with the bf16 profile merged (its engine is opt-in: only CPUs with bf16 build it)."""
    from pipeline.dagtools import profiles

    overlay = profiles.load("bf16", REPO)
    return config.load(_write(tmp_path_factory.mktemp("bf16"), lambda raw: profiles.merge(raw, overlay)))


@pytest.fixture(scope="module")
def engines(built, cfg16):
    """The embedder's openvino-cpu engines, built by the compile stage (INT8 from the real `ort-float-fc` recipe)."""
    from pipeline.stages import calibrate, quantize

    toolchain_stage.run(cfg16, built)
    if not (paths.calibration("embedder", built) / "ranges.json").is_file():
        calibrate.run(cfg16, "embedder", built, progress=lambda _: None)
    if not (paths.quantized("embedder", "ort-float-fc", built) / "embedder-ort-float-fc.manifest.json").is_file():
        quantize.run(cfg16, "embedder", "ort-float-fc", built)
    names = ["embedder-openvino-cpu-fp32", "embedder-openvino-cpu-int8"] + ([BF16_ENGINE] * BF16)
    return {n: compile_stage.run(cfg16, n, built) for n in names}


def test_bf16_on_a_cpu_without_it_is_refused_in_one_line(built, cfg16):
    if BF16:
        pytest.skip("this CPU has bf16: the engine builds (tests below); the refusal runs on AVX2-only CPUs")
    toolchain_stage.run(cfg16, built)             # the refusal, not a missing fingerprint, whatever ran before
    with pytest.raises(KilnError, match="no bf16 support") as e:
        compile_stage.run(cfg16, BF16_ENGINE, built)
    assert "profile" in e.value.hint or "drop the bf16 engine" in e.value.hint
    assert not paths.engine(BF16_ENGINE, built).exists()


def test_probe_records_version_plugin_capabilities_and_devices(built, cfg):
    tc, path, _ = toolchain_stage.run(cfg, built)["openvino-cpu"]
    doc = yaml.safe_load(path.read_text())
    assert tc.available and doc["available"] is True
    assert set(doc["rebuild_on"]) == {"openvino", "cpu_plugin", "capabilities", "devices", "isa", "machine"}
    assert doc["rebuild_on"]["openvino"] == ov.get_version() and "CPU" in doc["rebuild_on"]["devices"]
    assert tc.line().startswith("openvino-cpu: available (openvino 20")


def test_engines_are_reproducible_native_and_verify(engines, built):
    for name, r in engines.items():
        assert r.reproducibility["checked"] == "compile: second build in a fresh process, scratch project: " \
                                               "bit-identical", name
        if name.endswith("int8"):      # the recipe leaves the final MatMul in float: the audit says so, as a fallback
            assert r.audit.native == {"Convolution": 29}, r.audit.native
            assert [(f["op"], f["runs_as"]) for f in r.audit.fallback] == [("FullyConnected", "f32")]
        else:
            assert r.audit.ok and r.audit.native == {"Convolution": 29, "FullyConnected": 1}, (name, r.audit.native)
        assert verify_manifest(paths.engine(name, built) / f"{name}.manifest.json", root=built) == []


def test_precision_is_pinned_in_the_engine(engines, built):
    """The CPU plugin's default hint is bf16 on CPUs that have it: an FP32 engine must say f32 itself."""
    hints = {n: json.loads((paths.engine(n, built) / CONFIG_FILE).read_text())["properties"]["INFERENCE_PRECISION_HINT"]
             for n in engines}
    assert hints["embedder-openvino-cpu-fp32"] == "f32" and hints["embedder-openvino-cpu-int8"] == "f32"
    if BF16:
        assert hints["embedder-openvino-cpu-bf16"] == "bf16"


def test_a_runner_told_its_threads_does_not_pin_them(engines, built):
    """sysbench@'s workers each load the engines with their share of the cores; OpenVINO would pin every process's
    threads to the same first cores. Told its threads, a runner leaves placement to the OS; left alone, it keeps
    the engine's recorded properties (the plugin's default pinning)."""
    from pipeline.targets.openvino import OvRunner

    d = paths.engine("embedder-openvino-cpu-fp32", built)
    told = OvRunner(d, threads=1).compiled
    assert told.get_property("INFERENCE_NUM_THREADS") == 1 and told.get_property("ENABLE_CPU_PINNING") is False
    assert "ENABLE_CPU_PINNING" not in json.loads((d / CONFIG_FILE).read_text())["properties"]


def test_the_ir_keeps_fp32_weights(engines, built):
    """save_model's default compresses weights to FP16; the FP32 engine's .bin holds the export's 22 MB of floats."""
    assert (paths.engine("embedder-openvino-cpu-fp32", built) / "model.bin").stat().st_size > 20e6


def test_device_query_covers_cpu_and_reports_the_npu_honestly(engines, built):
    m = read_manifest(paths.engine("embedder-openvino-cpu-int8", built) / "embedder-openvino-cpu-int8.manifest.json")
    q = m["results"]["device_query"]
    assert q["CPU"]["queried"] and q["CPU"]["supported"] == q["CPU"]["ops"] > 100
    assert q["CPU"]["unsupported_op_types"] == []
    if "NPU" not in ov.Core().available_devices:      # this host: the plugin is in the wheel, its compiler is not
        assert q["NPU"]["queried"] is False and q["NPU"]["reason"]
        assert str(built) not in q["NPU"]["reason"] and "site-packages" not in q["NPU"]["reason"]
    assert "tied to this OpenVINO build" in m["build"]["compiled_blob"]


def test_reason_strips_host_paths():
    err = RuntimeError('Exception from src/a.cpp:1:\nVCL failed\nCannot load library "/x/venv/lib/libnpu.so": '
                       '/x/venv/lib/libnpu.so: cannot open shared object file')
    assert _reason(err) == 'VCL failed Cannot load library "libnpu.so": libnpu.so: cannot open shared object file'


def test_audit_catches_float_layers_in_an_int8_engine(engines, built):
    """The FP32 engine audited as INT8: every convolution runs in f32 — the silent fallback the audit must show."""
    audit = OpenVinoCpu().audit(paths.engine("embedder-openvino-cpu-fp32", built), "int8")
    assert len(audit.fallback) == 30 and {f["runs_as"] for f in audit.fallback} == {"f32"}


@pytest.mark.parametrize("name, cos_min", [("embedder-openvino-cpu-fp32", 0.99999),
                                           # 0.99968 on an AVX-512 VNNI host, 0.99942 on a Zen 3 (7-bit weights)
                                           ("embedder-openvino-cpu-int8", 0.999),
                                           ("embedder-openvino-cpu-bf16", 0.9995)])
def test_engines_pass_the_face_task_gate(engines, built, cfg16, name, cos_min):
    if name not in engines:
        pytest.skip(f"{name}: this CPU has no BF16 in OPTIMIZATION_CAPABILITIES, so the target refuses to build it "
                    "(tested above); runs on any CPU with AVX512-BF16 or AMX")
    v = validate.run(cfg16, name, built)
    assert v.verdict == "pass", v.failures
    assert v.metrics["cosine_min"] >= cos_min, v.metrics


def test_check_package_refuses_external_entities(engines, built, tmp_path):
    src = paths.engine("embedder-openvino-cpu-fp32", built)
    t = OpenVinoCpu()
    t.check_package(src)
    (tmp_path / XML_FILE).write_text('<?xml version="1.0"?><!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]>'
                                     + (src / XML_FILE).read_text().split("?>", 1)[1])
    with pytest.raises(KilnError, match="external entities"):
        t.check_package(tmp_path)


def test_precisions_a_target_does_not_build_are_refused(tmp_path):
    def bf16_on_ort(p):
        p["engines"]["embedder-ort-cpu-bf16"] = {"model": "embedder", "target": "ort-cpu", "precision": "bf16",
                                                 "source": "artifacts/export/embedder"}

    def fp16_on_openvino(p):
        p["engines"]["embedder-openvino-cpu-fp16"] = {"model": "embedder", "target": "openvino-cpu",
                                                      "precision": "fp16", "source": "artifacts/export/embedder"}

    for mutate, msg in [(bf16_on_ort, "ort-cpu does not build bf16"),
                        (fp16_on_openvino, "openvino-cpu does not build fp16")]:
        with pytest.raises(KilnError, match=msg):
            targets.check(config.load(_write(tmp_path, mutate)))
