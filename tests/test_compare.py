"""`kiln compare`: layer-wise FP32 vs INT8 on the real embedder — a deliberately broken layer is found as the first
bad one, the numbers do not depend on the batch size, bad input is a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from pipeline import paths, samples
from pipeline.compare import EXACT_DB, compare, resolve
from pipeline.errors import KilnError


@pytest.fixture(scope="module")
def qdq(built, cfg):
    from pipeline.stages import calibrate, quantize

    if not (paths.calibration("embedder", built) / "ranges.json").is_file():
        calibrate.run(cfg, "embedder", built, progress=lambda _: None)
    if not (paths.quantized("embedder", "ort", built) / "embedder-ort.manifest.json").is_file():
        quantize.run(cfg, "embedder", "ort", built)
    return paths.quantized("embedder", "ort", built) / paths.ONNX_FILE


def _feeds(cfg, built, batch=16):
    return samples.stream(cfg, "embedder", "golden", built, batch)


def _break_one_conv(src, dest, conv_index=12):
    """The QDQ model with one convolution's weight scale ×10: that layer alone is wrong. Returns the Conv's output."""
    m = onnx.load(str(src))
    convs = [n for n in m.graph.node if n.op_type == "Conv"]
    conv = convs[conv_index]
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == conv.input[1])
    init = next(i for i in m.graph.initializer if i.name == dq.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(10), init.name))
    onnx.save(m, str(dest))
    return conv.output[0]


def test_fp32_vs_int8_lines_up_through_the_qdq_pairs(built, cfg, qdq):
    c = compare(paths.export("embedder", built) / paths.ONNX_FILE, qdq, _feeds(cfg, built))
    assert c.samples == 48 and len(c.layers) >= 50
    assert all(r.cosine > 0.99 for r in c.layers), [r for r in c.layers if r.cosine <= 0.99][:3]   # same tensors
    assert c.first_bad is None and all(r.snr_db > 20 for r in c.layers)
    out = c.outputs[0]
    assert out.name == "output" and 0.999 < out.cosine < 1.0 and 25 < out.snr_db < 45
    assert [r.depth for r in c.layers] == sorted(r.depth for r in c.layers)
    assert c.worst(3)[0].own_snr_db <= c.worst(3)[-1].own_snr_db


def test_a_broken_layer_is_the_first_bad_layer(built, cfg, qdq, tmp_path):
    broken = tmp_path / "broken.onnx"
    name = _break_one_conv(qdq, broken)
    same = compare(qdq, broken, _feeds(cfg, built))        # the same QDQ model but for one weight scale
    assert same.first_bad is not None and same.first_bad.name == name, same.first_bad
    before = [r for r in same.layers if r.depth < same.first_bad.depth]
    assert before and all(r.snr_db == EXACT_DB for r in before)             # bit-exact up to the broken layer
    assert same.worst(1)[0].name == name                                     # and it adds the most error itself
    vs_fp32 = compare(paths.export("embedder", built) / paths.ONNX_FILE, broken, _feeds(cfg, built))
    assert vs_fp32.first_bad.name == name


def test_results_do_not_depend_on_the_batch(built, cfg, qdq):
    a = compare(paths.export("embedder", built) / paths.ONNX_FILE, qdq, _feeds(cfg, built, 16))
    b = compare(paths.export("embedder", built) / paths.ONNX_FILE, qdq, _feeds(cfg, built, 5))
    assert [r.name for r in a.layers] == [r.name for r in b.layers]
    assert np.allclose([r.snr_db for r in a.layers], [r.snr_db for r in b.layers], atol=1e-3)


def test_bad_input_is_a_clear_error(built, cfg, qdq, tmp_path):
    with pytest.raises(KilnError, match="no model.onnx"):
        resolve(tmp_path)
    with pytest.raises(KilnError, match="no such file"):
        resolve(tmp_path / "missing.onnx")
    other = onnx.load(str(paths.export("embedder", built) / paths.ONNX_FILE))      # another model's outputs
    for n in other.graph.node:
        n.output[:] = ["features" if o == "output" else o for o in n.output]
    other.graph.output[0].name = "features"
    onnx.save(other, str(tmp_path / "other.onnx"))
    with pytest.raises(KilnError, match="differ from"):
        compare(qdq, tmp_path / "other.onnx", _feeds(cfg, built))
    tampered = tmp_path / "embedder"
    tampered.mkdir()
    for f in paths.export("embedder", built).iterdir():
        (tampered / f.name).write_bytes(f.read_bytes())
    (tampered / "model.onnx").write_bytes((tampered / "model.onnx").read_bytes()[:-1] + b"\0")
    with pytest.raises(KilnError):
        resolve(tampered)                                   # a directory's manifest is verified before use


def test_cli_prints_the_report_and_writes_json(built, qdq, tmp_path):
    out = tmp_path / "cmp.json"
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "compare", "artifacts/export/embedder",
                        "artifacts/quantized/embedder-ort", "--batch", "8", "--json", str(out)],
                       cwd=built, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "worst 10 layers" in r.stdout and "no layer below 20 dB SNR" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["model"] == "embedder" and doc["samples"] == 48 and len(doc["layers"]) >= 50
    bad = subprocess.run([sys.executable, "-m", "pipeline.cli", "compare", str(tmp_path), "x.onnx"], cwd=built,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no model.onnx" in bad.stderr


def test_debug_precision_stage_stores_the_report_with_a_manifest(built, cfg, qdq):
    from pipeline.manifest import read_manifest, verify_manifest
    from pipeline.stages import debug_precision

    r = debug_precision.run(cfg, "embedder-ort", built)
    rows = json.loads((r.directory / debug_precision.LAYERS_FILE).read_text())
    assert isinstance(rows, list) and len(rows) >= 50 and {"depth", "snr_db", "own_snr_db", "cosine"} <= set(rows[0])
    m = r.directory / "embedder-ort.manifest.json"
    assert verify_manifest(m, root=built) == []
    doc = read_manifest(m)
    assert doc["results"]["first_bad"] is None and doc["results"]["outputs"][0]["name"] == "output"
    assert [i["role"] for i in doc["inputs"]] == ["fp32", "int8"]
    again = debug_precision.run(cfg, "embedder-ort", built)                   # one thread: the same bytes
    layers = debug_precision.LAYERS_FILE
    assert (again.directory / layers).read_bytes() == (r.directory / layers).read_bytes()
