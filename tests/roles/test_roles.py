"""The role contract (pipeline/roles/): every registered role, on the repository's params with a model of every role
(the sface-retinaface profile merged). Fast: no DAG, no model run; the feeds' bytes are what golden@ and calibrate@
tests check."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import yaml

from pipeline import config, samples
from pipeline.dagtools import profiles
from pipeline.errors import KilnError
from pipeline.roles import base, registry
from conftest import REPO, write_params

ATTRS = ("name", "task", "feed_names", "feed_range", "outputs", "crop_fed", "onnx_only", "key_metric", "direction",
         "accuracy_label", "metrics", "limits_section", "checks", "fixed_limits")
METHODS = ("deps", "params", "manifest_inputs", "stream", "feeds", "random_feed", "golden", "check_outputs",
           "check_graph", "output_axes", "detect", "measure", "gate", "gate_checks", "gate_inputs", "gate_code")


@pytest.fixture(scope="module")
def byo(tmp_path_factory) -> config.Config:
    raw = profiles.merged(config.read_yaml(REPO / "params.yaml", ""), profiles.load("sface-retinaface", REPO))
    p = tmp_path_factory.mktemp("byo") / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    return config.load(p)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, byo):
    """A project root with two tiny photos and placeholder detector weights where params name them."""
    from PIL import Image

    root = tmp_path_factory.mktemp("scratch")
    for who, shade in (("ada", 60), ("bo", 200)):
        d = root / byo.data.photos / who
        d.mkdir(parents=True)
        Image.fromarray(np.full((40, 30, 3), shade, np.uint8)).save(d / "one.png")
    for w in samples.reference_weights(byo):
        (root / w).parent.mkdir(parents=True, exist_ok=True)
        (root / w).write_bytes(b"weights")
    return root


def _models(cfg, name: str) -> list[str]:
    return [m for m, c in cfg.models.items() if c.samples == name]


def _under(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def test_the_registry_is_what_config_accepts():
    names = registry.names()
    assert len(set(names)) == len(names) and config.SAMPLE_KINDS == names
    for name in names:
        e = registry.entry(name)
        assert e.module.startswith("pipeline.roles.") and registry.get(name).name == name
        assert registry.modules(name)[0] == e.module
        role = registry.get(name)                      # the facts params checks read without loading the role
        assert (e.task, e.onnx_only) == (role.task, role.onnx_only), name


def test_config_refuses_an_unknown_role_naming_the_registered_ones(tmp_path):
    p = write_params(tmp_path, lambda r: r["models"]["pnet"].update(samples="yunet"))
    with pytest.raises(KilnError) as e:
        config.load(p)
    assert str(p) in e.value.message and "models.pnet.samples" in e.value.message and "'yunet'" in e.value.message
    assert all(f"'{n}'" in e.value.message for n in registry.names()), e.value.message
    with pytest.raises(KilnError) as e:
        registry.get("yunet")
    assert all(n in e.value.hint for n in registry.names())


def test_every_model_of_the_params_has_a_role(byo):
    kinds = {c.samples for c in byo.models.values()}
    assert kinds == set(registry.names()), "the params fixture should hold a model of every role"


@pytest.mark.parametrize("name", registry.names())
def test_every_role_meets_the_contract(name, byo, scratch):
    r = registry.get(name)
    assert isinstance(r, base.Role)
    missing = [a for a in ATTRS if not hasattr(r, a)] + [m for m in METHODS if not callable(getattr(r, m, None))]
    assert not missing, f"{name} lacks {missing}"
    assert type(r).stream is not base.Role.stream, f"{name}: no feed builder"
    assert r.task in base.TASKS and (r.task != "detect" or type(r).detect is not base.Role.detect)
    assert r.feed_names and all(isinstance(n, str) for n in r.feed_names)

    # gate: key metric and direction, its metric code resolves, (failures, limits) on its own metrics
    checks = r.gate_checks()
    gate_metrics = [c[0] for c in checks]
    assert r.direction in (1, -1) and r.key_metric in gate_metrics and r.accuracy_label
    assert callable(base.by_name(r.metrics)) and callable(base.by_name(base.CHECK))
    assert all(importlib.import_module(m) for m in r.gate_code())
    assert registry.modules(name, gate=True)[1:] == r.gate_code()
    failures, limits = r.gate(byo, {k: float("nan") for k in gate_metrics})     # a NaN metric never passes
    assert isinstance(limits, dict) and limits and len(failures) == len(checks)
    assert all(f.startswith(k) for f, k in zip(failures, gate_metrics))

    # export / import facts
    assert r.output_axes()[0] == "batch"
    if r.outputs is not None:
        good = [r.outputs.rank] * (r.outputs.count or 1)
        assert r.check_outputs(good) is None and r.check_outputs([]) == r.outputs.what
        assert r.check_outputs([r.outputs.rank + 1] * len(good))
    else:
        assert r.check_outputs([]) is None

    # random feeds: the declared inputs, float32, in range, reproducible
    shape = next(byo.model(m).input_shape for m in _models(byo, name))
    f = r.random_feed(shape, 3)
    assert list(f) == list(r.feed_names) and all(v.dtype == np.float32 for v in f.values())
    assert all(np.array_equal(f[k], v) for k, v in r.random_feed(shape, 3).items())
    if list(f) == ["input"]:
        low, high = r.feed_range
        assert f["input"].shape == (3, *shape) and low <= f["input"].min() and f["input"].max() <= high

    # feeds: what they read, the params they track and the manifest inputs agree, and samples dispatches to it
    for model in _models(byo, name):
        for set_name in samples.SETS:
            deps, keys = r.deps(byo, model, set_name), r.params(byo, model)
            assert samples.deps(byo, model, set_name) == deps and samples.params(byo, model) == keys
            assert deps and all(isinstance(d, str) for d in deps)
            for key in keys:                                   # every tracked key is a params.yaml key
                node = byo.raw
                for part in key.split("."):
                    node = node[part]
            assert ("data.photos" in keys) == (byo.data.photos in deps)
            inputs = _inputs(r, byo, model, set_name, scratch)
            assert inputs and all(_under(i.get("path") or i["manifest"], deps) for i in inputs), (inputs, deps)


def _inputs(r, cfg, model, set_name, root) -> list[dict]:
    """The role's manifest inputs; an image set's manifest (not built here) is referenced without reading it."""
    import pipeline.manifest as manifest

    real = manifest.input_ref
    manifest.input_ref = lambda role, path, root_: {"role": role, "manifest": path.relative_to(root_).as_posix()}
    try:
        return r.manifest_inputs(cfg, model, set_name, root)
    finally:
        manifest.input_ref = real


def test_the_reference_detector_reads_the_photos_and_weights(byo):
    assert samples.deps(byo, None, "golden") == samples.reference_deps(byo)
    assert samples.params(byo, None) == ["data.photos", "data.min_face_size"]
    assert [registry.get(n).crop_fed for n in samples.NETS] == [False, True, True]
    assert registry.get("pnet").output_axes() == {0: "batch", 2: "out_h", 3: "out_w"}


def test_photo_feeds_are_one_per_photo_and_variant(byo, scratch):
    """A single-shot detector's feeds on the scratch photos: one per photo; the calibration set adds 3 variants."""
    r = registry.get("retinaface")
    golden = samples.feeds(byo, "retinaface", "golden", scratch)
    calib = list(samples.stream(byo, "retinaface", "calibration", scratch))
    assert len(golden) == 2 and len(calib) == 8 and samples.sample_count(calib) == 8
    assert all(list(f) == list(r.feed_names) and f["input"].shape == (1, 3, 40, 30) for f in golden)
    assert samples.digest(golden) == samples.digest(calib[::4])
    # a declared head's feeds: its own channels and mean, padded to its multiple (YuNet: 32)
    yunet = samples.feeds(byo, "yunet", "golden", scratch)
    assert len(yunet) == 2 and all(f["input"].shape == (1, 3, 64, 32) for f in yunet)
    assert (yunet[0]["input"][0, :, 40:] == 0).all() and (yunet[0]["input"][0, :, :40, :30] == 60).all()
