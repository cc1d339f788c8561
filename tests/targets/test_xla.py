"""xla (profiles/xla.yaml, lockfiles/xla.txt; `setup.sh --test` installs it): the StableHLO artifact from the
torch.export program (jax.export through torchax, lowered for cpu, cuda and tpu), run by jax's XLA CPU backend; the
torchax compatibility shim, path-free MLIR locations, the audit of custom calls, the face-task gate, the bench side
by side with ORT, registration, a fresh-process rebuild, and the refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from pipeline import engines, paths
from pipeline.dagtools import dag, rebuild
from pipeline.errors import KilnError
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.stages import compile as compile_stage
from pipeline.stages import toolchain as toolchain_stage, golden, program, validate
from pipeline.targets.base import CompileOptions
from pipeline.targets.xla import EXPORT_FILE, OPTIONS_FILE, Xla
from conftest import REPO, bench_beside_ort, load_in_fresh_process, profile_cfg, versus_ort

EMB, ONET = "embedder-xla-fp32", "onet-xla-fp32"


@pytest.fixture(scope="module")
def xcfg(tmp_path_factory, cfg):
    """params.yaml with the xla profile merged (the target is opt-in: disabled in the default DAG)."""
    return profile_cfg(tmp_path_factory.mktemp("xla-params"), cfg, "xla")


@pytest.fixture(scope="module")
def built_xla(built, xcfg):
    """The embedder and O-Net engines, built by compile@ (with its fresh-process rebuild) from their programs."""
    toolchain_stage.run(xcfg, built)
    for model in ("embedder", "onet"):
        if not (paths.golden(model, built) / f"{model}.manifest.json").is_file():
            golden.run(xcfg, model, built)
        if not (paths.program(model, built) / f"{model}.manifest.json").is_file():
            program.run(xcfg, model, built, check_reproducible=False)
    return {n: compile_stage.run(xcfg, n, built) for n in (EMB, ONET)}


def _program(model, built):
    return torch.export.load(str(paths.program(model, built) / program.PROGRAM_FILE)).module()


def test_the_toolchain_is_installed_by_test_setup_and_fingerprinted():
    tc = Xla().probe()
    assert tc.available, tc.line()
    assert tc.rebuild_on["jax"] == "0.10.2" and tc.rebuild_on["torchax"] == "0.0.13"
    assert set(tc.rebuild_on) == {"jax", "jaxlib", "torchax", "torch", "isa", "machine"}
    assert tc.line().startswith("xla: available (jax 0.10.2")


def test_torchax_needs_the_shim_on_this_torch_and_the_shim_leaves_torch_unchanged():
    """Plain `import torchax` fails on torch 2.13 (named-tensor overloads removed): when it stops failing, the shim can
    go. Through the shim it imports, and torch's overload lookup is strict again afterwards."""
    plain = subprocess.run([sys.executable, "-c", "import torchax"], capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0 and "has no overload name" in plain.stderr, plain.stderr[-500:]
    probe = ("import torch; from pipeline.targets.xla import import_torchax; _, d, used = import_torchax()\n"
             "try: torch.ops.aten.prod.dim_Dimname; print('lenient')\n"
             "except AttributeError: print('strict', len(used), len(d.DECOMPOSITIONS) > 100)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n = int(out.stdout.split()[1])
    assert out.stdout.split()[0] == "strict" and n > 0 and out.stdout.split()[2] == "True", out.stdout


def test_the_profile_adds_the_engines_and_compile_tracks_this_targets_toolchain(xcfg, cfg):
    assert not cfg.targets["xla"].enabled and xcfg.targets["xla"].enabled
    doc = yaml.safe_load(dag.render(xcfg)["dag/compile/dvc.yaml"])["stages"]["compile"]
    items = doc["foreach"]
    assert {items[n]["target"] for n in (EMB, ONET, "rnet-xla-fp32")} == {"xla"}
    assert {"artifacts/toolchain/${item.target}.yaml": ["rebuild_on"]} in doc["do"]["params"]
    assert "artifacts/data/calibration" not in items[EMB].values()
    assert "pipeline/targets/xla.py" in dag.deps_of(dag.find("compile"), xcfg, EMB)


def test_engines_are_checked_reproducible_carry_no_paths_and_audit_clean(built_xla, built):
    for name, r in built_xla.items():
        engine = paths.engine(name, built)
        manifest = engine / f"{name}.manifest.json"
        assert verify_manifest(manifest, root=built) == []
        m = read_manifest(manifest)
        assert [i["role"] for i in m["inputs"]] == ["program"]
        assert m["toolchain"]["target.xla"]["jax"] == "0.10.2"
        assert m["build"]["platforms"] == ["cpu", "cuda", "tpu"]
        assert m["build"]["reproducibility"]["checked"].endswith("bit-identical"), m["build"]["reproducibility"]
        assert m["build"]["inputs"][0].startswith("float32[s") and m["build"]["torchax_placeholders"]
        blob = (engine / EXPORT_FILE).read_bytes()
        for where in (str(REPO), sys.prefix, "site-packages", "torchax/", "pipeline/targets"):
            assert where.encode() not in blob, where                      # MLIR locations without source paths
        assert r.audit.ok and r.audit.fallback == []
        assert r.audit.other["custom_call.shape_assertion"] >= 1          # jax's own check of the symbolic batch
    emb = built_xla[EMB].audit.native
    assert emb == {"stablehlo.convolution": 3 * 29, "stablehlo.dot_general": 3}, emb    # 29 convs, 1 fc: per platform
    assert len(read_manifest(paths.engine(ONET, built) / f"{ONET}.manifest.json")["build"]["outputs"]) == 3
    assert (paths.engine(EMB, built) / EXPORT_FILE).stat().st_size > 20e6                    # the weights are inside


def test_the_runner_matches_the_program_at_any_batch(built_xla, built):
    r = engines.load("xla", paths.engine(EMB, built))
    x = np.random.default_rng(0).uniform(0, 255, (33, 3, 150, 150)).astype(np.float32)
    ref = _program("embedder", built)(torch.from_numpy(x)).detach().numpy()
    for n in (1, 2, 8, 33):
        assert float(np.abs(r.run(x[:n]) - ref[:n]).max()) < 1e-4, n
    onet = engines.load("xla", paths.engine(ONET, built))
    crops = np.random.default_rng(1).uniform(-1, 1, (5, 3, 48, 48)).astype(np.float32)
    outs = onet.run_all({"input": crops})
    refs = [t.detach().numpy() for t in _program("onet", built)(torch.from_numpy(crops))]
    assert [o.shape for o in outs] == [(5, 4), (5, 10), (5, 2)]
    assert all(float(np.abs(o - e).max()) < 1e-4 for o, e in zip(outs, refs))


def test_the_runner_needs_jax_only(built_xla, built):
    """A fresh process: the verified load imports jax, not torch or torchax, and gives the in-process outputs."""
    engine = paths.engine(EMB, built)
    y, heavy = load_in_fresh_process("xla", engine, (3, 3, 150, 150), ("torch", "torchax"), built / "xla-probe.npy")
    assert heavy == []
    assert np.allclose(y, engines.load("xla", engine).run(np.full((3, 3, 150, 150), 100, np.float32)), atol=1e-6)


@pytest.mark.parametrize("name", [EMB, ONET])
def test_engines_pass_the_face_task_gate(built_xla, built, xcfg, name):
    v = validate.run(xcfg, name, built)
    assert v.verdict == "pass", v.failures
    if name == EMB:
        assert v.metrics["cosine_min"] >= 0.99999, v.metrics


def test_bench_times_xla_beside_ort_in_one_process(built_xla, built, xcfg, tmp_path, capsys):
    """The embedder's ORT FP32 and XLA engines measured side by side; the ratio printed, no timing asserted."""
    report = bench_beside_ort(xcfg, built, (EMB,), tmp_path)
    with capsys.disabled():
        print(versus_ort(report, (EMB,)))


def test_registers_and_rebuilds_bit_identically_in_a_fresh_process(built_xla, built, xcfg, registry_env):
    from pipeline import registry
    from pipeline.stages import register as register_stage

    validate.run(xcfg, EMB, built)
    receipt = register_stage.run(xcfg, EMB, built)
    assert receipt.verdict == "pass" and receipt.new
    assert registry.Registry(xcfg, built).aliases(receipt.name) == {"candidate": receipt.version}
    r = rebuild.classify(xcfg, f"compile@{EMB}", built)
    assert r["class"] == "bit-identical" and r["meets_claim"], r


def _write_export(directory, fn, *avals, platforms=("cpu",)):
    import jax

    exported = jax.export.export(jax.jit(fn), platforms=platforms)(*avals)
    (directory / EXPORT_FILE).write_bytes(exported.serialize())
    (directory / OPTIONS_FILE).write_text(json.dumps({"platforms": list(platforms)}))


def test_audit_catches_a_platform_library_call_and_check_package_refuses_garbage(tmp_path):
    """A Cholesky lowers, on cpu, to a LAPACK custom call: code outside StableHLO, which another XLA host may not
    have — the fallback. (A Python host callback cannot be serialized at all: jax refuses it at export.)"""
    import jax

    _write_export(tmp_path, jax.lax.linalg.cholesky, jax.ShapeDtypeStruct((4, 4), np.float32))
    audit = Xla().audit(tmp_path, "fp32")
    assert not audit.ok and audit.native == {}
    assert [f["runs_as"] for f in audit.fallback] == ["code outside StableHLO"]
    assert "lapack" in audit.fallback[0]["op"], audit.fallback
    Xla().check_package(tmp_path)                                    # a real export: readable
    (tmp_path / EXPORT_FILE).write_bytes(b"PK\x03\x04 not a flatbuffer" * 4)
    with pytest.raises(KilnError, match="not a jax.export artifact"):
        Xla().check_package(tmp_path)


def test_an_artifact_without_a_cpu_lowering_is_not_run_here(tmp_path):
    import jax

    _write_export(tmp_path, lambda x: x * 2, jax.ShapeDtypeStruct((4,), np.float32), platforms=("cuda", "tpu"))
    ok, why = Xla().runnable(tmp_path)
    assert not ok and why == "lowered for cuda, tpu only; this host's XLA backend is cpu"
    with pytest.raises(KilnError, match="not cpu"):
        Xla().check_package(tmp_path)


def test_fp16_and_an_undecidable_dynamic_shape_are_refused(tmp_path, built):
    t = Xla()
    src = paths.program("embedder", built) / program.PROGRAM_FILE
    with pytest.raises(KilnError, match="not built by this target"):
        t.compile(src, CompileOptions("fp16", t.parse_options({})), tmp_path, tmp_path)

    class Pool(torch.nn.Module):        # P-Net's shape: H×W dynamic, pooled with ceil_mode
        def forward(self, x):
            return torch.nn.functional.max_pool2d(x, 2, 2, ceil_mode=True)

    dyn = torch.export.Dim.DYNAMIC
    ep = torch.export.export(Pool(), (torch.zeros(2, 3, 20, 20),), dynamic_shapes=({0: dyn, 2: dyn, 3: dyn},))
    torch.export.save(ep, str(tmp_path / "pool.pt2"))
    (tmp_path / "out").mkdir()
    with pytest.raises(KilnError, match=r"cannot be lowered to StableHLO: InconclusiveDimensionOperation"):
        t.compile(tmp_path / "pool.pt2", CompileOptions("fp32", t.parse_options({})), tmp_path / "out", tmp_path)
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("raw, match", [({"platforms": ["gpu"]}, "platforms"), ({"platforms": []}, "platforms"),
                                        ({"platforms": ["cpu", "cpu"]}, "repeat"), ({"platform": ["cpu"]}, "unknown")])
def test_options_are_validated_by_name(raw, match):
    with pytest.raises(KilnError, match=match):
        Xla().parse_options(raw)


def test_default_options():
    assert Xla().parse_options({}).model_dump() == {"platforms": ("cpu", "cuda", "tpu")}
