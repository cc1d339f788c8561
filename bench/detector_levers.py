"""What the levers left on the MTCNN detector buy — each measured side by side with what ships, from ONE run.

Issue 34 asks for the glue ≤ 3 ms and the best system ≥ 3× PyTorch eager; P-Net and the area pyramid own most of a
one-face frame. This prints, on bench/e2e.py's scenarios, with interleaved rounds after a warm-up:

1. pyramid: the shipped exact area pyramid (integral image + gathers, bit-for-bit torch's area resampling) against
   OpenCV's INTER_AREA from the photo and chained level to level (not bit-exact: the largest P-Net input change);
2. P-Net precision on OpenVINO over a frame's whole pyramid: the built FP32 engine against INT8 (the calibrated
   `ort` QDQ model) and, where the CPU has it, BF16 — both compiled here for the comparison, not engines;
3. R-/O-Net across frames: one call on the crops of 4 frames against 4 calls (what batching detection across
   streams in sysbench@ would buy), per built engine, and whether each row's output is bit-identical.

Usage (after `bash scripts/run.sh`):  .venv/bin/python bench/detector_levers.py [--repeats 30]
Writes nothing; every figure is this host's (the host line names its class).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/e2e.py's scenarios

from e2e import scenarios  # noqa: E402

from pipeline import config, engines, paths, tables, toolchain  # noqa: E402
from pipeline.manifest import verify_manifest  # noqa: E402
from kiln_runtime import mtcnn  # noqa: E402 — the glue (the torch nets are not used here)


def p50_ms(fns: dict, repeats: int) -> dict[str, float]:
    """p50 wall ms of each callable, interleaved round by round after 2 warm-up rounds."""
    samples = {k: [] for k in fns}
    for r in range(repeats + 2):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            if r >= 2:
                samples[k].append((time.perf_counter() - t) * 1e3)
    return {k: float(np.median(v)) for k, v in samples.items()}


def pyramid_inputs(rgb: np.ndarray, det: mtcnn.DetectorConfig) -> tuple[list, dict]:
    h, w = rgb.shape[:2]
    sizes = [(int(h * sc + 1), int(w * sc + 1)) for sc in mtcnn.pyramid_scales(h, w, det)]

    def exact():
        return list(mtcnn.area_levels(mtcnn.integral_image(rgb), sizes))

    def net_input(level_hwc: np.ndarray) -> np.ndarray:
        x = np.empty((1, 3, *level_hwc.shape[:2]), np.float32)
        np.subtract(level_hwc.transpose(2, 0, 1), np.float32(127.5), out=x[0], dtype=np.float32)
        return x * np.float32(1 / 128)

    def cv2_area():
        return [net_input(cv2.resize(rgb, (ow, oh), interpolation=cv2.INTER_AREA)) for oh, ow in sizes]

    def cv2_chained():
        out, src = [], rgb
        for oh, ow in sizes:
            src = cv2.resize(src, (ow, oh), interpolation=cv2.INTER_AREA)
            out.append(net_input(src))
        return out

    return exact(), {"exact (shipped)": exact, "cv2 INTER_AREA": cv2_area, "cv2 chained": cv2_chained}


def openvino_pnet(precision: str):
    """P-Net compiled by OpenVINO here from the verified export (fp32/bf16) or `ort` QDQ model (int8)."""
    import openvino as ov

    d = Path("artifacts/quantized/pnet-ort") if precision == "int8" else paths.export("pnet")
    manifests = list(d.glob("*.manifest.json"))
    if not manifests or (problems := verify_manifest(manifests[0])):
        raise SystemExit(f"{d}: not built or does not verify "
                         f"({'; '.join(problems) if manifests else 'no manifest'}): bash scripts/run.sh")
    hint = {"fp32": "f32", "int8": "f32", "bf16": "bf16"}[precision]
    compiled = ov.Core().compile_model(str(d / "model.onnx"), "CPU", {
        "INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1})
    req = compiled.create_infer_request()
    return lambda x: req.infer({0: x})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30, help="measured rounds (after 2 warm-up rounds)")
    args = ap.parse_args()
    cfg = config.load(Path("params.yaml"))
    det = mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)
    scen = scenarios(cfg)
    print(f"host: {toolchain.cpu()['cpu']} ({toolchain.host_class()}, {os.cpu_count()} CPUs); "
          f"{args.repeats} interleaved rounds; p50 ms")

    print("\n1. pyramid (all levels of one frame, P-Net inputs)")
    rows = []
    for name, rgb in scen.items():
        ref, fns = pyramid_inputs(np.ascontiguousarray(rgb), det)
        t = p50_ms(fns, args.repeats)
        for k, f in fns.items():
            diff = max(float(np.abs(a - b).max()) for a, b in zip(ref, f()))
            rows.append([name, k, f"{t[k]:.2f}", f"{t['exact (shipped)'] / t[k]:.2f}x", f"{diff:.3g}"])
    print(tables.markdown(["scenario", "pyramid", "ms", "speed vs shipped", "max |input change|"], rows))

    print("\n2. P-Net on OpenVINO over a frame's pyramid (sum of its levels)")
    import openvino as ov

    precisions = ["fp32", "int8"] + (["bf16"] if "BF16" in ov.Core().get_property(
        "CPU", "OPTIMIZATION_CAPABILITIES") else [])
    built = engines.load("openvino-cpu", paths.engine("pnet-openvino-cpu-fp32"), "pnet-openvino-cpu-fp32")
    nets = {"fp32 (built engine)": lambda x: built.run_all({"input": x})}
    nets |= {p: openvino_pnet(p) for p in precisions if p != "fp32"}
    rows = []
    for name, rgb in scen.items():
        levels, _ = pyramid_inputs(np.ascontiguousarray(rgb), det)
        t = p50_ms({k: (lambda n=n: [n(x) for x in levels]) for k, n in nets.items()}, args.repeats)
        for k in nets:
            rows.append([name, len(levels), k, f"{t[k]:.2f}", f"{t['fp32 (built engine)'] / t[k]:.2f}x"])
    print(tables.markdown(["scenario", "levels", "P-Net", "ms", "speed vs fp32"], rows))
    if "bf16" not in precisions:
        print("bf16: not measured (this CPU has no BF16 in OpenVINO's OPTIMIZATION_CAPABILITIES)")

    print("\n3. R-/O-Net: one call on the crops of 4 frames vs 4 calls (one-face scenario's crop counts)")
    crops = {}
    orig = mtcnn.area_crops

    def capture(s, y0, y1, x0, x1, size):
        out = orig(s, y0, y1, x0, x1, size)
        crops[size] = out
        return out

    mtcnn.area_crops = capture
    try:
        fp32 = {n: engines.load("ort-cpu", paths.engine(f"{n}-ort-cpu-fp32"), f"{n}-ort-cpu-fp32")
                for n in ("pnet", "rnet", "onet")}
        mtcnn.detect(scen["one face"], *(lambda x, r=r: tuple(r.run_all({"input": x})) for r in fp32.values()), det)
    finally:
        mtcnn.area_crops = orig
    rows = []
    for net, size in (("rnet", 24), ("onet", 48)):
        one = crops[size]
        four = np.concatenate([one] * 4)
        for e in cfg.engines_of(net):
            if not paths.engine(e.name).is_dir():
                continue
            r = engines.load(e.target, paths.engine(e.name), e.name)
            t = p50_ms({"4 calls": lambda: [r.run_all({"input": one}) for _ in range(4)],
                        "1 call": lambda: r.run_all({"input": four})}, args.repeats)
            same = all(np.array_equal(a, b[:len(one)]) for a, b in zip(r.run_all({"input": one}),
                                                                        r.run_all({"input": four})))
            rows.append([e.name, f"4 x {len(one)}", f"{t['4 calls']:.2f}", f"{t['1 call']:.2f}",
                         f"{t['4 calls'] / t['1 call']:.2f}x", "yes" if same else "no"])
    print(tables.markdown(["engine", "crops", "4 calls ms", "1 call ms", "batching buys", "rows bit-identical"],
                          rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
