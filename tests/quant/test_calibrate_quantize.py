"""Calibration (streamed ranges: minmax / percentile / entropy) and INT8 QDQ quantization (ort / symmetric recipes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from pipeline import paths
from pipeline.data import load_set
from pipeline.errors import KilnError
from pipeline.manifest import identity_digest, read_manifest, verify_manifest
from pipeline.quant import calibration, qdq, selection
from pipeline.stages import calibrate, quantize

SUBSET = 32   # chips for the tests that compare calibration variants (the point holds on any subset)


def _quiet(_: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------- entropy / percentile
def _kl_reference(hist: np.ndarray, levels: int = 128, eps: float | None = 1e-4) -> np.ndarray:
    """TensorRT's KL search, written as the plain loop of the GTC 2017 slides (Q floored at eps where P > 0 = Q)."""
    hist = np.asarray(hist, float)
    out = []
    for i in range(levels, hist.size + 1):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()
        nz = p != 0
        w = i // levels
        q = np.zeros(i)
        for j in range(levels):
            s, e = j * w, (i if j == levels - 1 else j * w + w)
            if nz[s:e].sum():
                q[s:e] = np.where(nz[s:e], hist[s:e].sum() / nz[s:e].sum(), 0)
        pn, qn = p / p.sum(), q / q.sum()
        m = pn > 0
        qn = np.where(m & (qn == 0), eps or 0.0, qn)
        out.append(np.inf if np.any(qn[m] == 0) else float(np.sum(pn[m] * np.log(pn[m] / qn[m]))))
    return np.array(out)


def _abs_hist(x: np.ndarray, bins: int) -> tuple[np.ndarray, float]:
    a = np.abs(x)
    amax = float(a.max())
    return np.bincount(np.minimum((a * (bins / amax)).astype(int), bins - 1), minlength=bins), amax


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_threshold_ignores_outliers_of_a_gaussian(seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(0, 1, 200_000), rng.choice([-1, 1], 40) * rng.uniform(20, 40, 40)])
    hist, amax = _abs_hist(x, 2048)
    t = calibration.entropy_threshold(hist, amax)
    assert 3.5 < t < 0.2 * amax, (t, amax)            # keeps the bulk (max |N(0,1)| ≈ 4.5), drops the outliers
    # outliers are 0.02 %: percentile keeps them
    assert calibration.percentile_threshold(hist, amax, 99.99) > 0.5 * amax


def test_entropy_keeps_the_range_of_a_uniform_distribution():
    x = np.random.default_rng(1).uniform(-5, 5, 100_000)
    hist, amax = _abs_hist(x, 2048)
    assert calibration.entropy_threshold(hist, amax) > 0.9 * amax


def test_entropy_ignores_the_zeros_of_a_relu(cfg):
    """Half the values exactly 0 (post-ReLU): as a spike in bin 0 they would drag the threshold into the bulk."""
    rng = np.random.default_rng(4)
    x = np.maximum(rng.normal(0, 1, 200_000), 0)
    hist, amax = _abs_hist(x, 2048)
    # σ = 1: keeps all but the far tail
    assert calibration.threshold("entropy", hist, int(np.sum(x == 0)), amax) > 3.0
    # the failure the exclusion avoids: with the zeros in, KL clips ~5 % of the positive values
    assert calibration.entropy_threshold(hist, amax, max_clipped=None) < 2.5


def test_entropy_does_not_clip_a_distribution_away_from_zero():
    """A global-average-pool output: all values in ~[0.4, 2.3]. KL alone would clip almost all of them."""
    x = np.random.default_rng(5).gamma(8, 0.14, 100_000) + 0.3
    hist, amax = _abs_hist(x, 2048)
    t = calibration.entropy_threshold(hist, amax)
    assert np.mean(x > t) <= calibration.MAX_CLIPPED + 1e-4, (t, amax)
    assert calibration.entropy_threshold(hist, amax, max_clipped=None) < np.percentile(x, 50)   # without the guard


@pytest.mark.parametrize("eps", [1e-4, None])
def test_closed_form_kl_equals_the_reference_loop(eps):
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(0, 1, 20_000), rng.exponential(6, 30), rng.uniform(20, 40, 10)])
    hist, _ = _abs_hist(x, 400)
    fast, slow = calibration.entropy_divergences(hist, eps=eps, max_clipped=None), _kl_reference(hist, eps=eps)
    assert np.array_equal(np.isfinite(fast), np.isfinite(slow))
    finite = np.isfinite(slow)
    np.testing.assert_allclose(fast[finite], slow[finite], rtol=0, atol=1e-9)
    assert int(np.argmin(fast)) == int(np.argmin(slow))


def test_percentile_range_of_a_non_negative_tensor_starts_at_zero():
    x = np.random.default_rng(3).exponential(1, 50_000)
    hist, amax = _abs_hist(x, 2048)
    t = calibration.percentile_threshold(hist, amax, 99.0)
    lo, hi = calibration.clip_range(0.0, amax, t)
    assert lo == 0.0 and hi == pytest.approx(np.percentile(x, 99.0), rel=0.01)


# ---------------------------------------------------------------------------------------------- calibrate stage
@pytest.fixture(scope="module")
def calibrated(built, cfg):
    return calibrate.run(cfg, "embedder", built, progress=_quiet)


@pytest.fixture(scope="module")
def preprocessed(built, tmp_path_factory):
    pre = tmp_path_factory.mktemp("pre") / "pre.onnx"
    calibration.preprocess(paths.export("embedder", built) / "model.onnx", pre)
    return pre


@pytest.fixture(scope="module")
def subset(built):
    return load_set(paths.data_set("calibration", built)).chips[:SUBSET]


def test_calibration_artifact_records_ranges_and_provenance(calibrated, built, cfg):
    d = paths.calibration("embedder", built)
    manifest = d / "embedder.manifest.json"
    assert verify_manifest(manifest, root=built) == []
    m = read_manifest(manifest)
    ranges = json.loads((d / "ranges.json").read_text())
    assert m["kind"] == "calibration"
    assert {i["role"] for i in m["inputs"]} == {"onnx", "calibration_set", "golden", "golden_set"}
    assert ranges["method"] == calibrated.method == m["results"]["method"] in cfg.calibrate.candidates
    assert set(ranges["candidates"]) == set(cfg.calibrate.candidates)
    assert ranges["tensors"] == ranges["candidates"][ranges["method"]]
    assert set(ranges["tensors"]) == set(ranges["minmax"]) and len(ranges["tensors"]) == calibrated.tensors > 50
    assert calibrated.samples == m["results"]["samples"] == len(load_set(paths.data_set("calibration", built)).chips)
    for method, cand in ranges["candidates"].items():
        for name, r in cand.items():                 # a clipped range lies inside min/max
            mm = ranges["minmax"][name]
            assert mm["min"] <= r["min"] <= r["max"] <= mm["max"], (method, name)
        # a histogram method really moves ranges: not silently min/max
        assert (calibration.differs(cand, ranges["minmax"]) / len(cand) > 0.5) == (method != "minmax"), method


def test_the_calibration_is_chosen_by_the_face_task_gate_and_every_result_is_kept(calibrated, built, cfg):
    """Every candidate is judged and recorded; the chosen one is the rule's best; its numbers are the gate's own
    numbers for the INT8 model quantize@ builds from it (the same ranges, the same recipe), run as the judge runs
    it: QDQ arithmetic in float, the same on every CPU (pipeline/portable.py)."""
    from pipeline.gates.evaluate import OnnxRunner, evaluate_model
    from pipeline.roles import registry as roles

    d = paths.calibration("embedder", built)
    sel = json.loads((d / "selection.json").read_text())
    assert [t["method"] for t in sel["trials"]] == list(cfg.calibrate.candidates) == [t.method for t in
                                                                                       calibrated.trials]
    metric, sign = roles.get("chips").key_metric, roles.get("chips").direction   # the gate's key metric (its role's)
    assert sel["metric"] == metric and sel["recipe"] == cfg.calibrate.select_recipe
    assert sel["chosen"] == calibrated.method == selection.choose(calibrated.trials, metric, sign).method
    values = {t["method"]: t["metrics"][metric] for t in sel["trials"]}
    passing = [m for t in sel["trials"] if t["passed"] for m in [t["method"]]]
    assert sel["chosen"] in passing and values[sel["chosen"]] == max(values[m] for m in passing)
    assert len(set(values.values())) > 1                 # the candidates really differ on the gate
    q = quantize.run(cfg, "embedder", cfg.calibrate.select_recipe, built)
    metrics, failures, _, _ = evaluate_model(cfg, "embedder", OnnxRunner(q.onnx_path, portable=True), built)
    chosen = next(t for t in sel["trials"] if t["method"] == sel["chosen"])
    assert round(metrics[metric], 6) == chosen["metrics"][metric] and failures == chosen["failures"]


def test_choice_rule_pass_first_then_key_metric_then_order():
    T = selection.Trial
    trials = [T("minmax", {"m": 0.99}, ["fails"], 0), T("entropy", {"m": 0.95}, [], 5),
              T("percentile-99.9", {"m": 0.97}, [], 5), T("percentile-99.99", {"m": 0.97}, [], 5)]
    assert selection.choose(trials, "m", 1).method == "percentile-99.9"       # passing first; tie → listed first
    assert selection.choose(trials, "m", -1).method == "entropy"              # lower is better
    failing = [T("a", {"m": float("nan")}, ["x"], 0), T("b", {"m": 0.5}, ["x"], 0), T("c", {}, ["x"], 0)]
    assert selection.choose(failing, "m", 1).method == "b"                     # none pass: best metric, NaN last
    assert selection.choose(failing, "m", -1).method == "b"


def test_a_method_that_breaks_the_gate_is_not_chosen_even_listed_first(built, cfg, tmp_path):
    """percentile-90 clips a tenth of every tensor: its INT8 embedder fails the gate, so minmax wins."""
    (tmp_path / "artifacts").mkdir()
    for sub in ("export", "data", "golden"):
        (tmp_path / "artifacts" / sub).symlink_to(built / "artifacts" / sub)
    two = cfg.replace(calibrate=dataclasses.replace(cfg.calibrate, candidates=("percentile-90", "minmax")))
    r = calibrate.run(two, "embedder", tmp_path, progress=_quiet)
    bad, good = r.trials
    assert bad.method == "percentile-90" and not bad.passed and good.passed and r.method == "minmax"
    sel = json.loads((paths.calibration("embedder", tmp_path) / "selection.json").read_text())
    assert sel["chosen"] == "minmax" and not sel["trials"][0]["passed"] and sel["trials"][0]["failures"]


def test_batch_size_does_not_change_ranges(preprocessed, subset, cfg):
    """Streaming: only running min/max and fixed-bin counts are kept, so the batch size changes nothing."""
    got = {}
    for batch in (4, 16):
        ccfg = dataclasses.replace(cfg.calibrate, candidates=("percentile-99.999", "entropy"), batch=batch)
        got[batch], _ = calibration.compute_ranges(preprocessed, subset, ccfg, progress=_quiet)
    assert got[4]["minmax"] == got[16]["minmax"]
    assert got[4]["candidates"] == got[16]["candidates"]


def test_session_never_sees_more_than_one_batch(preprocessed, subset, cfg, monkeypatch):
    seen = []
    real = calibration._batches

    def spy(chips, batch):
        for x in real(chips, batch):
            seen.append(len(next(iter(x.values()))))
            yield x

    monkeypatch.setattr(calibration, "_batches", spy)
    calibration.compute_ranges(preprocessed, subset[:10],
                               dataclasses.replace(cfg.calibrate, candidates=("entropy",), batch=4), progress=_quiet)
    assert seen == [4, 4, 2] * 2                         # two passes, each streamed in batches of ≤ 4


@pytest.mark.parametrize("method", ["percentile-99.999", "entropy"])
def test_histogram_methods_differ_from_minmax(preprocessed, subset, cfg, method):
    ccfg = dataclasses.replace(cfg.calibrate, candidates=(method,))
    ranges, _ = calibration.compute_ranges(preprocessed, subset, ccfg, progress=_quiet)
    assert list(ranges["candidates"]) == [method]
    changed = calibration.differs(ranges["candidates"][method], ranges["minmax"])
    assert changed / len(ranges["minmax"]) > 0.5, (method, changed)
    plain, _ = calibration.compute_ranges(preprocessed, subset, dataclasses.replace(ccfg, candidates=("minmax",)),
                                        progress=_quiet)
    assert plain["candidates"]["minmax"] == plain["minmax"] == ranges["minmax"]


# ---------------------------------------------------------------------------------------------- quantize stage
@pytest.fixture(scope="module")
def quantized(calibrated, built, cfg):
    return {r: quantize.run(cfg, "embedder", r, built) for r in ("ort", "symmetric")}


def _graph(built, recipe):
    return onnx.load(str(paths.quantized("embedder", recipe, built) / "model.onnx"))


def _activation_zero_points(model):
    inits = {i.name: i for i in model.graph.initializer}
    return [inits[n.input[2]] for n in model.graph.node
            if n.op_type == "QuantizeLinear" or (n.op_type == "DequantizeLinear" and n.input[0] not in inits)]


def test_ort_recipe_quantizes_compute_nodes_with_u8_activations(quantized, built):
    model = _graph(built, "ort")
    onnx.checker.check_model(model, full_check=True)
    producer = {o: n for n in model.graph.node for o in n.output}
    compute = [n for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Add")]
    assert len(compute) == 29 + 1 + 14
    for n in compute:
        ins = [producer.get(i) for i in n.input[:2]]
        assert all(p is not None and p.op_type == "DequantizeLinear" for p in ins), n.name
    zps = _activation_zero_points(model)
    assert zps and {z.data_type for z in zps} == {onnx.TensorProto.UINT8}
    assert any(numpy_helper.to_array(z).item() != 0 for z in zps)       # asymmetric: some zero points move
    m = read_manifest(paths.quantized("embedder", "ort", built) / "embedder-ort.manifest.json")
    assert m["precision"] == "int8" and {i["role"] for i in m["inputs"]} == {"onnx", "calibration"}
    assert m["results"]["bias_types"] == {"int32": 29}
    assert m["results"]["ranges"]["with_range"] == m["results"]["ranges"]["graph_tensors"] > 50
    assert verify_manifest(paths.quantized("embedder", "ort", built) / "embedder-ort.manifest.json", root=built) == []


def test_symmetric_recipe_has_zero_points_0_int8_and_float_biases(quantized, built):
    model = _graph(built, "symmetric")
    inits = {i.name: i for i in model.graph.initializer}
    zps = _activation_zero_points(model)
    assert zps and all(z.data_type == onnx.TensorProto.INT8 and not numpy_helper.to_array(z).any() for z in zps)
    weights = [inits[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weights and {w.data_type for w in weights} == {onnx.TensorProto.INT8}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 29
    for n in convs:
        assert inits[n.input[2]].data_type == onnx.TensorProto.FLOAT, n.name
    r = quantized["symmetric"]
    assert r.quantized_ops["Conv"] == 29 and r.float_nodes == ["Sub /Sub", "Div /Div"]


def test_quantize_is_byte_identical_across_runs(quantized, built, cfg):
    path = paths.quantized("embedder", "ort", built) / "model.onnx"
    manifest = path.parent / "embedder-ort.manifest.json"
    first, digest = path.read_bytes(), identity_digest(read_manifest(manifest))
    quantize.run(cfg, "embedder", "ort", built)
    assert path.read_bytes() == first
    assert identity_digest(read_manifest(manifest)) == digest


def test_ort_recipe_keeps_golden_cosine(quantized):
    g = quantized["ort"].golden
    assert g["samples"] == 48 and g["cosine_min"] >= 0.99 and g["cosine_mean"] >= 0.995


def test_ranges_must_cover_the_graph(preprocessed, built, cfg, tmp_path, calibrated):
    ranges = json.loads((paths.calibration("embedder", built) / "ranges.json").read_text())["tensors"]
    dropped = dict(sorted(ranges.items())[1:])
    with pytest.raises(KilnError, match="no range for 1 of the graph's"):
        qdq.quantize_graph(preprocessed, dropped, cfg.recipes["ort"], tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_unknown_recipe_is_a_user_error(cfg, built):
    with pytest.raises(KilnError, match="no recipe named 'fp4'"):
        quantize.run(cfg, "embedder", "fp4", built)


def test_ranges_of_another_graph_are_refused(quantized, built, cfg, tmp_path):
    root = tmp_path
    (root / "artifacts").mkdir()
    for sub in ("export", "data", "golden"):
        (root / "artifacts" / sub).symlink_to(built / "artifacts" / sub)
    cal = paths.calibration("embedder", root)
    cal.mkdir(parents=True)
    src = paths.calibration("embedder", built)
    for f in ("embedder.manifest.json", "selection.json"):
        (cal / f).write_bytes((src / f).read_bytes())
    ranges = json.loads((src / "ranges.json").read_text())
    ranges["graph_xxh3_128"] = "0" * 32
    (cal / "ranges.json").write_text(json.dumps(ranges))
    with pytest.raises(KilnError, match="files do not match their manifest"):     # an edited input: refused first
        quantize.run(cfg, "embedder", "ort", root)
    from pipeline.manifest import file_digests

    m = json.loads((cal / "embedder.manifest.json").read_text())                  # a consistent but foreign one
    m["files"] = [{**f, **file_digests(cal / Path(f["path"]).name)} for f in m["files"]]
    (cal / "embedder.manifest.json").write_text(json.dumps(m))
    with pytest.raises(KilnError, match="ranges were computed on pre-processed graph"):
        quantize.run(cfg, "embedder", "ort", root)
    assert not paths.quantized("embedder", "ort", root).exists()


def test_qdq_quantizer_signature_is_the_one_we_call():
    """quantize.py drives ORT's QDQQuantizer (no public entry point takes precomputed ranges) by keyword: a changed
    signature in a new onnxruntime must fail here, loudly, not quantize differently."""
    import inspect

    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    assert list(inspect.signature(QDQQuantizer.__init__).parameters) == [
        "self", "model", "per_channel", "reduce_range", "weight_qType", "activation_qType", "tensors_range",
        "nodes_to_quantize", "nodes_to_exclude", "op_types_to_quantize", "extra_options"]


def test_detector_calibration_is_streamed_in_batches_and_cites_what_it_read(built, cfg, monkeypatch):
    """R-Net's calibration inputs (crops the reference detector makes) are captured photo by photo and re-batched
    to calibrate.batch, never all held; the manifest cites the photos and detector weights, not the chip set."""
    from pipeline import samples
    from pipeline.stages import export, golden

    golden.run(cfg, "rnet", built)
    export.run(cfg, "rnet", built)
    small = cfg.replace(calibrate=dataclasses.replace(cfg.calibrate, batch=16))
    sizes = [len(f["input"]) for f in samples.stream(small, "rnet", "calibration", built, batch=16)]
    assert max(sizes) <= 16 and sum(sizes) > 100
    r = calibrate.run(small, "rnet", built, progress=_quiet)
    assert r.samples == sum(sizes)
    m = read_manifest(paths.calibration("rnet", built) / "rnet.manifest.json")
    roles = {i["role"] for i in m["inputs"]}
    assert roles == {"onnx", "photo", "detector_weights", "golden"} and m["build"]["batch"] == 16
    assert m["results"]["selection"]["metric"] == "box_iou_min"


def test_a_failing_ort_optimizer_is_not_swallowed(built, tmp_path, monkeypatch):
    """quant_pre_process logs an optimizer failure and carries on; preprocess must turn it into an error."""
    import onnxruntime

    def broken(*args, **kwargs):
        raise RuntimeError("optimizer exploded")

    monkeypatch.setattr(onnxruntime, "InferenceSession", broken)
    with pytest.raises(KilnError, match="pre-processing failed"):
        calibration.preprocess(paths.export("embedder", built) / "model.onnx", tmp_path / "pre.onnx")
