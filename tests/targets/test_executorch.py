"""executorch-xnnpack (profiles/edge.yaml, lockfiles/edge.txt; `setup.sh --test` installs it): the .pte from the
torch.export program, FP32 and INT8 (PT2E with the XNNPACK quantizer, observed on the stored calibration chips), the
audit read from the .pte's own execution plan, the planned batch bound, the face-task gate, the bench side by side
with ORT, registration, a fresh-process rebuild, and the refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from pipeline import config, engines, paths, targets
from pipeline.dagtools import dag, rebuild
from pipeline.errors import KilnError
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.stages import toolchain as toolchain_stage, program, validate
from pipeline.targets.base import CompileOptions
from pipeline.targets.executorch import PTE_FILE, ExecuTorchXnnpack, _export_bounded
from conftest import REPO, bench_beside_ort, profile_cfg, versus_ort

FP32, INT8 = "embedder-executorch-xnnpack-fp32", "embedder-executorch-xnnpack-int8"


@pytest.fixture(scope="module")
def ecfg(tmp_path_factory, cfg):
    """params.yaml with the edge profile merged (the target is opt-in: disabled in the default DAG)."""
    return profile_cfg(tmp_path_factory.mktemp("edge-params"), cfg, "edge")


@pytest.fixture(scope="module")
def built_et(built, ecfg):
    """Both embedder engines, built by compile@ from the program (program@ first where no other test built it)."""
    toolchain_stage.run(ecfg, built)
    if not (paths.program("embedder", built) / "embedder.manifest.json").is_file():
        program.run(ecfg, "embedder", built, check_reproducible=False)
    return {n: compile_stage.run(ecfg, n, built) for n in (FP32, INT8)}


def test_the_toolchain_is_installed_by_test_setup_and_fingerprinted():
    tc = ExecuTorchXnnpack().probe()
    assert tc.available, tc.line()
    assert tc.rebuild_on["executorch"] == "1.5.1" and tc.rebuild_on["torch"] == torch.__version__
    assert set(tc.rebuild_on) == {"executorch", "torch", "torchao", "isa", "machine"}
    assert tc.line().startswith("executorch-xnnpack: available (executorch 1.5.1")


def test_the_profile_adds_both_engines_and_compile_tracks_this_targets_toolchain(ecfg, cfg):
    assert not cfg.targets["executorch-xnnpack"].enabled and ecfg.targets["executorch-xnnpack"].enabled
    compile_stage_doc = yaml.safe_load(dag.render(ecfg)["dag/compile/dvc.yaml"])["stages"]["compile"]
    items = compile_stage_doc["foreach"]
    assert items[FP32]["target"] == items[INT8]["target"] == "executorch-xnnpack"
    assert {"artifacts/toolchain/${item.target}.yaml": ["rebuild_on"]} in compile_stage_doc["do"]["params"]
    # INT8 is calibrated at compile: it depends on the calibration chips, FP32 does not
    assert "artifacts/data/calibration" in items[INT8].values()
    assert "artifacts/data/calibration" not in items[FP32].values()
    # … and on the code that streams them (pipeline.samples, loaded by name): no other compile stage does
    code = {k: dag.deps_of(dag.find("compile"), ecfg, k) for k in ecfg.engines}
    assert [k for k, d in code.items() if "pipeline/samples.py" in d] == [INT8]


def test_engines_plan_the_bound_batch_and_audit_from_the_pte(built_et, built, ecfg):
    for name, r in built_et.items():
        manifest = paths.engine(name, built) / f"{name}.manifest.json"
        assert verify_manifest(manifest, root=built) == []
        m = read_manifest(manifest)
        assert [i["role"] for i in m["inputs"]] == ["program"]
        assert m["toolchain"]["target.executorch-xnnpack"]["executorch"] == "1.5.1"
        assert m["build"]["max_batch"] == m["build"]["planned_batch"] == 32        # not 15: traced at the bound
        assert m["build"]["calibration_samples"] == (0 if name == FP32 else 144)
        assert "rebuild-check" in m["build"]["reproducibility"]["checked"]
        # two XNNPACK subgraphs; the final mean runs as a portable kernel, outside the delegate (not a compute op)
        assert r.audit.ok and r.audit.native == {"delegate.XnnpackBackend": 2}, r.audit.native
        assert r.audit.other == {"outside_delegate.aten::mean.out": 1}, r.audit.other
        calls = m["results"]["execution_plan"]["calls"]
        assert calls.count({"kernel": "aten::mean.out"}) == 1 and len(calls) == 3, calls
    assert (paths.engine(INT8, built) / PTE_FILE).stat().st_size < 0.4 * (paths.engine(FP32, built) / PTE_FILE).stat(
        ).st_size                                                              # int8 weights inside


def test_audit_catches_a_convolution_outside_the_delegate(tmp_path):
    """A program lowered without the XNNPACK partitioner: its convolution runs as a portable kernel — the fallback."""
    from executorch.exir import to_edge

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    ep = torch.export.export(conv, (torch.zeros(1, 3, 8, 8),))
    (tmp_path / PTE_FILE).write_bytes(to_edge(ep).to_executorch().buffer)
    audit = ExecuTorchXnnpack().audit(tmp_path, "fp32")
    assert not audit.ok and audit.native == {}
    assert [(f["op"], f["runs_as"]) for f in audit.fallback] == [("aten::convolution.out", "portable kernel")]
    ExecuTorchXnnpack().check_package(tmp_path)                     # a real .pte: readable
    (tmp_path / PTE_FILE).write_bytes(b"PK\x03\x04 not a flatbuffer")
    with pytest.raises(KilnError, match="not an ExecuTorch program"):
        ExecuTorchXnnpack().check_package(tmp_path)


def test_the_runner_cuts_batches_above_the_plan_and_matches_the_program(built_et, built):
    r = engines.load("executorch-xnnpack", paths.engine(FP32, built))
    assert r.max_batch == 32
    x = np.random.default_rng(0).uniform(0, 255, (40, 3, 150, 150)).astype(np.float32)
    whole = r.run(x)                                                   # 32 + 8
    assert whole.shape == (40, 128)
    assert np.allclose(whole, np.concatenate([r.run(x[:32]), r.run(x[32:])]), atol=1e-6)
    assert np.array_equal(r.run(x[:1]), r.run_all({"input": x[:1]})[0])
    ref = torch.export.load(str(paths.program("embedder", built) / program.PROGRAM_FILE)).module()(
        torch.from_numpy(x)).detach().numpy()
    assert float(np.abs(whole - ref).max()) < 1e-4


def test_the_runner_loads_without_the_compiler_and_leaves_it_importable(built_et, built):
    """A fresh process: the verified load imports ExecuTorch's runtime bindings, not its compiler (exir pulls
    torch._dynamo, torch._inductor and torchao: ≈ 2 s of the cold start), gives the in-process runner's outputs, and
    a later `import executorch.exir` in that process is the real package."""
    engine = paths.engine(INT8, built)
    HEAVY = ("executorch.exir", "torch._dynamo", "torch._inductor", "torchao")
    probe = (f"import sys, numpy as np; from pipeline import engines; r = engines.load('executorch-xnnpack', "
             f"{str(engine)!r}); y = r.run(np.full((3, 3, 150, 150), 100, np.float32)); "
             f"heavy = [m for m in {HEAVY!r} if m in sys.modules]; "
             f"from executorch.exir import to_edge; np.save(sys.argv[1], y); print('heavy', heavy, to_edge.__module__)")
    out = subprocess.run([sys.executable, "-c", probe, str(built / "et-probe.npy")], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "heavy [] executorch.exir.program._program" in out.stdout, out.stdout
    here = engines.load("executorch-xnnpack", engine).run(np.full((3, 3, 150, 150), 100, np.float32))
    assert np.array_equal(np.load(built / "et-probe.npy"), here)


@pytest.mark.parametrize("name, cos_min", [(FP32, 0.99999), (INT8, 0.998)])   # INT8 0.99826 on an AVX-512 Xeon
def test_engines_pass_the_face_task_gate(built_et, built, ecfg, name, cos_min):
    v = validate.run(ecfg, name, built)
    assert v.verdict == "pass", v.failures
    assert v.metrics["cosine_min"] >= cos_min, v.metrics


def test_bench_times_executorch_beside_ort_in_one_process(built_et, built, ecfg, tmp_path, capsys):
    """The embedder's ORT FP32 and both .pte engines measured side by side; ratios printed, no timing asserted."""
    report = bench_beside_ort(ecfg, built, (FP32, INT8), tmp_path)
    assert f"{INT8}/{FP32}@b1" in report["ratios"]
    with capsys.disabled():
        print(versus_ort(report, (FP32, INT8)))


def test_registers_and_rebuilds_bit_identically_in_a_fresh_process(built_et, built, ecfg, registry_env):
    from pipeline import registry
    from pipeline.stages import register as register_stage

    validate.run(ecfg, FP32, built)
    receipt = register_stage.run(ecfg, FP32, built)
    assert receipt.verdict == "pass" and receipt.new
    assert registry.Registry(ecfg, built).aliases(receipt.name) == {"candidate": receipt.version}
    r = rebuild.classify(ecfg, f"compile@{FP32}", built)
    assert r["class"] == "bit-identical" and r["meets_claim"], r


def test_int8_without_calibration_and_other_dynamic_dims_are_refused(tmp_path, built):
    t = ExecuTorchXnnpack()
    src = paths.program("embedder", built) / program.PROGRAM_FILE
    with pytest.raises(KilnError, match="needs the calibration chips"):
        t.compile(src, CompileOptions("int8", t.parse_options({})), tmp_path, tmp_path)
    with pytest.raises(KilnError, match="not built by this target"):
        t.compile(src, CompileOptions("fp16", t.parse_options({})), tmp_path, tmp_path)
    assert not (tmp_path / PTE_FILE).exists()

    class Pnet(torch.nn.Module):        # P-Net's shape: H×W dynamic
        def forward(self, x):
            return x.mean(dim=(2, 3))

    hw = torch.export.Dim("h", min=12, max=64)
    ep = torch.export.export(Pnet(), (torch.zeros(2, 3, 20, 20),),
                             dynamic_shapes=({0: torch.export.Dim("b", min=1, max=8), 2: hw, 3: hw},))
    with pytest.raises(KilnError, match=r"dynamic non-batch dimensions \(2, 3\)"):
        _export_bounded(ep, 8)


@pytest.mark.parametrize("engine, change, key", [
    (INT8, {"recipe": "ort"}, "recipe"),                                 # int8 from a program: no ONNX recipe
    (FP32, {"source": "artifacts/export/embedder"}, "source"),           # a program target, fed ONNX
])
def test_config_refusals_name_the_key(engine, change, key, ecfg, tmp_path):
    raw = yaml.safe_load(ecfg.source.read_text())
    raw["engines"][engine].update(change)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(KilnError, match=f"engines.{engine}.{key}"):
        targets.check(config.load(p))


def test_options_are_validated_by_name():
    with pytest.raises(KilnError, match="max_batch"):
        ExecuTorchXnnpack().parse_options({"max_batch": 1})
    with pytest.raises(KilnError, match="thread"):
        ExecuTorchXnnpack().parse_options({"thread": 2})
    assert json.dumps(ExecuTorchXnnpack().parse_options({}).model_dump()) == \
        '{"threads": 0, "max_batch": 32, "per_channel": true}'
