"""Each engine's runtime requirement (kiln_runtime/requirements.py) and the golden check's arithmetic
(kiln_runtime/golden.py), on real engine manifests and this host's real packages. The refusal and the
`--allow-runtime-drift` golden check against a real second ONNX Runtime are in tests/release/test_system_release.py."""

from __future__ import annotations

import numpy as np
import pytest

from kiln_runtime import golden, requirements


def manifest(target: str, fingerprint: dict) -> dict:
    return {"kind": "engine", "target": target, "toolchain": {f"target.{target}": fingerprint}}


AVX512 = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"]


def test_each_targets_rule_names_its_package_range_and_host_class():
    ort = requirements.of_engine(manifest("ort-cpu", {"onnxruntime": "1.32.0", "isa": AVX512, "machine": "x86_64"}))
    assert ort == {"target": "ort-cpu", "package": "onnxruntime", "version": "1.32.0", "allowed": "==1.32.0",
                   "host_class": "x86-64-avx512-vnni"}
    ov = requirements.of_engine(manifest("openvino-cpu", {"openvino": "2026.4.1-22982-e213a147257-releases/2026/4",
                                                          "isa": AVX512, "machine": "x86_64"}))
    assert (ov["version"], ov["allowed"], ov["host_class"]) == ("2026.4.1", "==2026.4.*", None)
    trt = requirements.of_engine(manifest("tensorrt", {"tensorrt": "10.9.0.34", "isa": [], "machine": "x86_64"}))
    assert trt["allowed"] == "==10.9.0.34"                 # a plan loads only on the TensorRT that built it
    assert requirements.of_engine(manifest("unknown", {}))["allowed"] is None


@pytest.mark.parametrize("version, spec, ok", [("1.32.0", "==1.32.0", True), ("1.32.1", "==1.32.0", False),
                                               ("2026.4.0", "==2026.4.*", True), ("2026.40.1", "==2026.4.*", False),
                                               ("2026.5.0", "==2026.4.*", False)])
def test_a_range_holds_what_its_rule_allows(version, spec, ok):
    assert requirements.satisfies(version, spec) is ok


def test_this_hosts_own_runtime_satisfies_what_it_would_record():
    import onnxruntime

    from kiln_runtime.host import cpu

    here = requirements.of_engine(manifest("ort-cpu", {"onnxruntime": onnxruntime.__version__, **cpu()}))
    assert requirements.drifts(here) == []
    other = {**here, "version": "1.0.0", "allowed": "==1.0.0", "host_class": "x86-64-sse4"}
    found = requirements.drifts(other)
    assert found[0] == (f"gated with onnxruntime 1.0.0 (the release allows ==1.0.0), this host has onnxruntime "
                        f"{onnxruntime.__version__}") and found[1].startswith("built for host class x86-64-sse4")
    gone = requirements.drifts({**here, "package": "no-such-runtime"})
    assert gone == [f"no-such-runtime is not installed here (gated with no-such-runtime {here['version']})"]


def test_the_golden_comparison_names_the_worst_sample():
    rng = np.random.default_rng(0)
    y = rng.normal(size=(4, 128)).astype(np.float32)
    assert golden.compare([y], [y.copy()]) == (pytest.approx(1.0), 0.0)
    off = y.copy()
    off[2] = -off[2]                                          # one sample's output flipped: cosine -1
    cos, rel = golden.compare([y], [off])
    assert cos == pytest.approx(-1.0) and rel > 1.0
    assert golden.compare([y], [y[:2]]) == (-1.0, float("inf"))      # another shape: never a pass
    small = y + np.float32(1e-4)
    cos, rel = golden.compare([y], [small])
    assert cos > golden.LIMITS["cosine_min"] and rel < golden.LIMITS["max_abs_rel"]


def test_the_picked_samples_are_few_and_small():
    feeds = [{"x": np.zeros((16, 3, 40 + i, 40), np.float32)} for i in range(20)]
    picked = golden.pick(feeds)
    assert len(picked) == golden.MAX_FEEDS and all(f["x"].shape[0] == golden.MAX_SAMPLES for f in picked)
    assert [f["x"].shape[2] for f in picked] == [40, 41]       # the smallest of the first 16


@pytest.mark.parametrize("name", ["../x.npy", "a/b.npy", "", "..", 3, None])
def test_a_golden_file_is_a_plain_name_in_its_engines_folder(name):
    from kiln_runtime.errors import GateFailed

    with pytest.raises(GateFailed):
        golden.file_name(name)
    assert golden.file_name("0.in.0.npy") == "0.in.0.npy"
