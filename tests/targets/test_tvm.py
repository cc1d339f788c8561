"""tvm (profiles/tvm.yaml, lockfiles/tvm.txt; `setup.sh --test` installs it): Relax from the folded ONNX, one LLVM
shared library per batch bucket, the MetaSchedule tune@ stage whose database compile applies, the op audit, the
face-task gate, the bench side by side with ORT, registration, a fresh-process rebuild, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper

from pipeline import engines, paths
from pipeline.dagtools import dag, rebuild
from pipeline.errors import KilnError
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.stages import export, toolchain as toolchain_stage, golden, tune, validate
from pipeline.targets.base import CompileOptions
from pipeline.targets.tvm import DB_FILES, META_FILE, Tvm
from conftest import REPO, bench_beside_ort, load_in_fresh_process, profile_cfg, versus_ort

EMB, ONET, TUNED = "embedder-tvm-fp32", "onet-tvm-fp32", "embedder-tvm-tuned-fp32"
ONET_ENGINE = {ONET: {"model": "onet", "target": "tvm", "precision": "fp32", "source": "artifacts/export/onet"}}
TUNED_ENGINE = {TUNED: {"model": "embedder", "target": "tvm", "precision": "fp32",
                        "source": "artifacts/export/embedder"}}
UNTUNED = {"targets": {"tvm": {"tuning": {"trials": 0}, "buckets": [1, 8]}}}      # two buckets: chunking
# one round of 8 candidates: the smallest budget that tunes (and so exercises) a kernel, ~40 s on 2 cores
TINY = {"targets": {"tvm": {"tuning": {"trials": 8, "per_iteration": 8, "cost_model": "random"}}}}


@pytest.fixture(scope="module")
def tcfgs(tmp_path_factory, cfg):
    """The tvm profile merged, untuned with buckets 1 and 8 (embedder, O-Net), and with the profile's one bucket and
    a tiny tuning budget (a third engine)."""
    untuned = profile_cfg(tmp_path_factory.mktemp("tvm-params"), cfg, "tvm", ONET_ENGINE, UNTUNED)
    tiny = profile_cfg(tmp_path_factory.mktemp("tvm-tuned-params"), cfg, "tvm", TUNED_ENGINE, TINY)
    return untuned, tiny


@pytest.fixture(scope="module")
def built_tvm(built, tcfgs):
    """The untuned embedder and O-Net engines, built by compile@ (with its fresh-process rebuild) from the ONNX."""
    ucfg = tcfgs[0]
    toolchain_stage.run(ucfg, built)
    for model in ("embedder", "onet"):
        if not (paths.golden(model, built) / f"{model}.manifest.json").is_file():
            golden.run(ucfg, model, built)
        if not (paths.export(model, built) / f"{model}.manifest.json").is_file():
            export.run(ucfg, model, built)
    return {n: compile_stage.run(ucfg, n, built) for n in (EMB, ONET)}


def _ort(model, built, x):
    s = ort.InferenceSession(str(paths.export(model, built) / paths.ONNX_FILE), providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x})


def test_the_toolchain_is_installed_by_test_setup_and_fingerprinted():
    tc = Tvm().probe()
    assert tc.available, tc.line()
    assert tc.rebuild_on["apache-tvm"] == "0.27.0.post1" and tc.rebuild_on["apache-tvm-ffi"] == "0.1.14.post0"
    assert set(tc.rebuild_on) == {"apache-tvm", "apache-tvm-ffi", "llvm", "triple", "host_cpu", "cxx_version", "isa",
                                  "machine"}
    assert tc.line().startswith("tvm: available (apache-tvm 0.27.0.post1")


def test_the_profile_adds_tune_and_compile_stages_keyed_by_the_toolchain(tcfgs, cfg):
    ucfg, tiny = tcfgs
    assert not cfg.targets["tvm"].enabled and ucfg.targets["tvm"].enabled
    untuned = dag.render(ucfg)
    assert "dag/tune/dvc.yaml" not in untuned                                  # trials 0: no tune stage
    assert "artifacts/tuning/" not in untuned["dag/compile/dvc.yaml"]
    docs = dag.render(tiny)
    t = yaml.safe_load(docs["dag/tune/dvc.yaml"])["stages"]["tune"]
    assert set(t["foreach"]) == {EMB, TUNED}
    assert {"artifacts/toolchain/${item.target}.yaml": ["rebuild_on"]} in t["do"]["params"]
    assert "pipeline/targets/tvm.py" in dag.deps_of(dag.find("tune"), tiny, TUNED)
    assert "artifacts/export/embedder" in dag.deps_of(dag.find("tune"), tiny, TUNED)
    assert t["do"]["outs"] == ["artifacts/tuning/${key}"]
    assert "artifacts/tuning/" + TUNED in dag.deps_of(dag.find("compile"), tiny, TUNED)


def test_engines_are_checked_reproducible_and_audit_clean(built_tvm, built):
    for name, r in built_tvm.items():
        engine = paths.engine(name, built)
        manifest = engine / f"{name}.manifest.json"
        assert verify_manifest(manifest, root=built) == []
        m = read_manifest(manifest)
        assert [i["role"] for i in m["inputs"]] == ["onnx"]
        assert m["toolchain"]["target.tvm"]["apache-tvm"] == "0.27.0.post1"
        assert m["build"]["buckets"] == {"1": "model.b1.so", "8": "model.b8.so"} and not m["build"]["tuned"]
        assert m["build"]["target"]["kind"] == "llvm" and m["build"]["target"]["num-cores"] == 2
        assert m["build"]["reproducibility"]["checked"].endswith("bit-identical"), m["build"]["reproducibility"]
        assert all(k["tuned"] == 0 and k["kernels"] > 0 for k in m["results"]["kernels"].values())
        for so in m["build"]["buckets"].values():
            blob = (engine / so).read_bytes()
            assert blob[:4] == b"\x7fELF"
            for where in (str(REPO), str(built), "/tmp/"):
                assert where.encode() not in blob, (so, where)              # nothing of the checkout or the build dir
        assert r.audit.ok and r.audit.fallback == []
    assert built_tvm[EMB].audit.native == {"relax.nn.conv2d": 29, "relax.matmul": 1}, built_tvm[EMB].audit.native
    assert (paths.engine(EMB, built) / "model.b1.so").stat().st_size > 20e6                # the weights are inside


def test_the_runner_matches_onnx_runtime_at_any_batch_in_bucket_chunks(built_tvm, built):
    r = engines.load("tvm", paths.engine(EMB, built))
    x = np.random.default_rng(0).uniform(0, 255, (19, 3, 150, 150)).astype(np.float32)
    ref = _ort("embedder", built, x)[0]
    for n in (1, 2, 8, 19):                      # 19 = 8 + 8 + 1 + 1 + 1
        assert float(np.abs(r.run(x[:n]) - ref[:n]).max()) < 1e-4, n
    onet = engines.load("tvm", paths.engine(ONET, built))
    crops = np.random.default_rng(1).uniform(-1, 1, (9, 3, 48, 48)).astype(np.float32)
    outs, refs = onet.run_all({"input": crops}), _ort("onet", built, crops)
    assert [o.shape for o in outs] == [e.shape for e in refs] and len(outs) == 3
    assert all(float(np.abs(o - e).max()) < 1e-4 for o, e in zip(outs, refs))


def test_the_runner_needs_tvm_only(built_tvm, built):
    """A fresh process: the verified load imports TVM, not torch or ONNX Runtime, and gives the in-process outputs."""
    engine = paths.engine(EMB, built)
    y, heavy = load_in_fresh_process("tvm", engine, (3, 3, 150, 150), ("torch", "onnxruntime"), built / "tvm-probe.npy")
    assert heavy == []
    assert np.allclose(y, engines.load("tvm", engine).run(np.full((3, 3, 150, 150), 100, np.float32)), atol=1e-6)


@pytest.mark.parametrize("name", [EMB, ONET])
def test_engines_pass_the_face_task_gate(built_tvm, built, tcfgs, name):
    v = validate.run(tcfgs[0], name, built)
    assert v.verdict == "pass", v.failures
    if name == EMB:
        assert v.metrics["cosine_min"] >= 0.99999, v.metrics


def test_bench_times_tvm_beside_ort_in_one_process(built_tvm, built, tcfgs, tmp_path, capsys):
    """The untuned embedder beside ORT FP32 in one run: the ratio printed (tens of × slower), no timing asserted."""
    report = bench_beside_ort(tcfgs[0], built, (EMB,), tmp_path)
    with capsys.disabled():
        print(versus_ort(report, (EMB,)))


def test_registers_and_rebuilds_bit_identically_in_a_fresh_process(built_tvm, built, tcfgs, registry_env):
    from pipeline import registry
    from pipeline.stages import register as register_stage

    validate.run(tcfgs[0], EMB, built)
    receipt = register_stage.run(tcfgs[0], EMB, built)
    assert receipt.verdict == "pass" and receipt.new
    assert registry.Registry(tcfgs[0], built).aliases(receipt.name) == {"candidate": receipt.version}
    r = rebuild.classify(tcfgs[0], f"compile@{EMB}", built)
    assert r["class"] == "bit-identical" and r["meets_claim"], r


def test_tune_stage_writes_a_database_that_compile_applies(built_tvm, built, tcfgs):
    """tune@ with a tiny budget: MetaSchedule's database beside its manifest (no paths inside); compile@ of the same
    engine lists it as an input, applies it to the kernel it covers, and still matches ONNX Runtime."""
    tiny = tcfgs[1]
    out, summary = tune.run(tiny, TUNED, built)
    assert summary["tasks"] == 25 and summary["trials"] == 8 and summary["records"] >= 1, summary
    m = read_manifest(out / f"{TUNED}.manifest.json")
    assert verify_manifest(out / f"{TUNED}.manifest.json", root=built) == []
    assert m["kind"] == "tuning" and sorted(f["path"] for f in m["files"]) == sorted(DB_FILES)
    assert m["toolchain"]["target.tvm"]["llvm"] == Tvm().probe().rebuild_on["llvm"]
    for f in DB_FILES:
        text = (out / f).read_text()
        assert str(built) not in text and "/tmp/" not in text and str(REPO) not in text, f
    r = compile_stage.run(tiny, TUNED, built)
    em = read_manifest(r.directory / f"{TUNED}.manifest.json")
    assert [i["role"] for i in em["inputs"]] == ["onnx", "tuning"] and em["build"]["tuned"]
    assert sum(k["tuned"] for k in em["results"]["kernels"].values()) >= 1, em["results"]["kernels"]
    assert em["build"]["reproducibility"]["checked"].endswith("bit-identical")
    x = np.random.default_rng(2).uniform(0, 255, (9, 3, 150, 150)).astype(np.float32)
    y = engines.load("tvm", r.directory).run(x)
    assert float(np.abs(y - _ort("embedder", built, x)[0]).max()) < 1e-4
    with pytest.raises(KilnError, match="nothing to tune"):
        tune.run(tcfgs[0], EMB, built)                         # trials 0 (untuned): no tune stage, a clear refusal


def test_a_packed_call_is_the_fallback_and_check_package_refuses_what_is_not_the_engine(built_tvm, built, tmp_path):
    import shutil

    engine = tmp_path / "e"
    shutil.copytree(paths.engine(EMB, built), engine)
    meta = json.loads((engine / META_FILE).read_text())
    meta["ops"]["relax.call_dps_packed"] = 2
    meta["packed_calls"] = ["relax.call_dps_packed"]
    (engine / META_FILE).write_text(json.dumps(meta))
    audit = Tvm().audit(engine, "fp32")
    assert not audit.ok and [f["runs_as"] for f in audit.fallback] == ["a packed function outside TVM's codegen"] * 2
    Tvm().check_package(engine)                                          # the real libraries pass
    (engine / "extra.so").write_bytes((engine / "model.b1.so").read_bytes()[:64])
    with pytest.raises(KilnError, match="libraries not in tvm.json: extra.so"):
        Tvm().check_package(engine)
    (engine / "extra.so").unlink()
    (engine / "model.b8.so").write_bytes(b"#!/bin/sh\necho not a library\n")
    with pytest.raises(KilnError, match="not an ELF shared object"):
        Tvm().check_package(engine)
    meta["buckets"]["8"] = "../model.b8.so"
    (engine / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(KilnError, match="escapes the engine directory"):
        Tvm().check_package(engine)


def _onnx(path, inputs):
    """A one-node graph (Relu) with the given inputs [(name, shape)]."""
    nodes = [helper.make_node("Relu", [inputs[0][0]], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, inputs[0][1])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_fp16_other_dynamic_dims_and_two_inputs_are_refused(tmp_path):
    t = Tvm()
    opts = t.parse_options({})
    (tmp_path / "out").mkdir()
    one = _onnx(tmp_path / "one.onnx", [("x", ["n", 3, 8, 8])])
    with pytest.raises(KilnError, match="not built by this target"):
        t.compile(one, CompileOptions("fp16", opts), tmp_path / "out", tmp_path)
    hw = _onnx(tmp_path / "hw.onnx", [("x", ["n", 3, "h", "w"])])              # P-Net's input
    with pytest.raises(KilnError, match="dynamic dimensions beside the batch"):
        t.compile(hw, CompileOptions("fp32", opts), tmp_path / "out", tmp_path)
    two = _onnx(tmp_path / "two.onnx", [("x", ["n", 3, 8, 8]), ("theta", ["m", 2, 3])])   # the aligner's inputs
    with pytest.raises(KilnError, match="2 graph inputs"):
        t.compile(two, CompileOptions("fp32", opts), tmp_path / "out", tmp_path)
    assert not list((tmp_path / "out").iterdir())
    files = t.compile(one, CompileOptions("fp32", t.parse_options({"buckets": [1, 4]})), tmp_path / "out", tmp_path)
    assert sorted(f.name for f in files) == ["model.b1.so", "model.b4.so", META_FILE]
    x = np.random.default_rng(0).normal(size=(6, 3, 8, 8)).astype(np.float32)
    assert np.array_equal(t.load(tmp_path / "out").run(x), np.maximum(x, 0))              # 6 = 4 + 1 + 1


@pytest.mark.parametrize("raw, match", [({"buckets": [8]}, "including 1"), ({"buckets": [1, 1]}, "distinct"),
                                        ({"buckets": []}, "buckets"), ({"threads": 0}, "threads"),
                                        ({"mcpu": "Zen 4"}, "mcpu"), ({"tuning": {"trials": -1}}, "tuning.trials"),
                                        ({"tuning": {"cost_model": "gbm"}}, "cost_model"),
                                        ({"bucket": [1]}, "unknown")])
def test_options_are_validated_by_name(raw, match):
    with pytest.raises(KilnError, match=match):
        Tvm().parse_options(raw)


def test_an_unknown_llvm_cpu_is_refused_at_compile(tmp_path):
    t = Tvm()
    one = _onnx(tmp_path / "one.onnx", [("x", ["n", 3, 8, 8])])
    with pytest.raises(KilnError, match="LLVM does not know the CPU 'notacpu'"):
        t.compile(one, CompileOptions("fp32", t.parse_options({"mcpu": "notacpu"})), tmp_path, tmp_path)


def test_default_options():
    assert Tvm().parse_options({}).model_dump() == {
        "mcpu": "host", "threads": 2, "buckets": (1, 8),
        "tuning": {"trials": 0, "per_iteration": 16, "cost_model": "xgb", "seed": 0}}
