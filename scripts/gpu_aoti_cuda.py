"""Build, validate and time an `aoti-cuda` embedder engine on a GPU machine, in one short run.

Meant for the lent GPU machine (PyTorch with CUDA, no TensorRT, no network, none of Kiln's venv): it needs only
torch + numpy and the files it is given, which `bash scripts/run.sh` has built here:

    python scripts/gpu_aoti_cuda.py --out OUT \
        --dat artifacts/assets/dlib_face_recognition_resnet_model_v1.dat \
        --golden artifacts/golden/embedder/embeddings.npy --set artifacts/data/golden

It torch.exports the dlib embedder with a dynamic batch, compiles it with AOTInductor for the device, loads the
package, validates it against the golden (CPU FP32 PyTorch) embeddings with the same face-task metrics and the same
limits as `validate@` (params.yaml `validate:`, read here), and times batch 1 and 8 against eager PyTorch on the
same device. Writes OUT/report.json and OUT/report.md. Needs torch, numpy, pyyaml and tabulate (carry the last two
as wheels if the machine lacks them). Without a CUDA device it says so in one line and exits 3, building nothing
(`--device cpu` runs the same flow on the CPU, which is how CI tests this script).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import tables  # noqa: E402  (tabulate)
from pipeline.gates import facemetrics  # noqa: E402  (numpy)


def device_info(torch, device: str) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "platform": platform.platform(), "device": device}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, compute_capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
        try:
            import subprocess
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20, encoding="utf-8",
                                            errors="replace").stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    return info


def timeit(torch, fn, x, device: str, warmup: int = 10, runs: int = 100) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn(x)
    sync()
    t = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(x)
        sync()
        t.append((time.perf_counter() - t0) * 1e3)
    p50, p99 = np.percentile(t, [50, 99])
    return {"p50_ms": round(float(p50), 4), "p99_ms": round(float(p99), 4)}


def markdown(report: dict) -> str:
    i, lat = report["device"], report["latency"]
    lines = [f"aoti-{i['device']} embedder, {i.get('gpu', 'cpu')} (cc {i.get('compute_capability', '-')}, driver "
             f"{i.get('driver', '-')}), torch {i['torch']}, CUDA {i['cuda']}, {report['date']}", "",
             tables.markdown(["variant", "b1 p50 ms", "b1 p99 ms", "b8 p50 ms", "b8 p99 ms"],
                             [[name, v["b1"]["p50_ms"], v["b1"]["p99_ms"], v["b8"]["p50_ms"], v["b8"]["p99_ms"]]
                              for name, v in lat.items()])]
    m = report["metrics"]
    lines += ["", f"golden gate: {report['verdict']} — cosine min {m['cosine_min']:.6f}, L2 max {m['l2_max']:.2e}, "
              f"top-1 agreement {m['top1_agreement']:.3f}, decisions {m['decision_agreement']:.4f}; "
              f"compile {report['compile_s']} s, package {report['package_mb']} MB"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build + validate + time an AOTInductor engine on a GPU.")
    ap.add_argument("--dat", type=Path, required=True)
    ap.add_argument("--golden", type=Path, required=True, help="golden embeddings.npy (CPU FP32 PyTorch)")
    ap.add_argument("--set", type=Path, required=True, help="golden image set dir (chips.npy + index.json)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--params", type=Path, default=Path(__file__).resolve().parents[1] / "params.yaml",
                    help="params.yaml: the gate's limits (validate:) and the verification threshold")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"aoti-cuda: unavailable (torch {torch.__version__}: torch.cuda.is_available() is False)")
        return 3
    for p in (args.dat, args.golden, args.set / "chips.npy", args.set / "index.json", args.params):
        if not p.is_file():
            print(f"gpu_aoti_cuda: error: {p} not found (hint: run `bash scripts/run.sh` first and pass its artifacts)")
            return 2
    import yaml

    from pipeline.models.dlib_resnet import build_embedder

    params = yaml.safe_load(args.params.read_text(encoding="utf-8"))
    limits, threshold = params["validate"], params["models"]["embedder"]["verify_threshold"]

    chips = np.load(args.set / "chips.npy")
    index = json.loads((args.set / "index.json").read_text(encoding="utf-8"))
    labels = np.asarray(index["labels"])
    gallery = np.array([i for i, s in enumerate(index["samples"]) if s["augmentation"] is None])
    ref = np.load(args.golden)
    x = torch.from_numpy(np.ascontiguousarray(chips.transpose(0, 3, 1, 2), dtype=np.float32)).to(args.device)
    model = build_embedder(args.dat).to(args.device).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.inference_mode(False), torch.no_grad():
        ep = torch.export.export(model, (x[:2],), dynamic_shapes=({0: batch},))
        args.out.mkdir(parents=True, exist_ok=True)
        package = args.out / f"embedder-aoti-{args.device}.pt2"
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            import os
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
            torch._inductor.aoti_compile_and_package(ep, package_path=str(package))
        compile_s = round(time.perf_counter() - t0, 1)
        engine = torch._inductor.aoti_load_package(str(package))
        got = np.concatenate([engine(x[i:i + 8]).float().cpu().numpy() for i in range(0, len(x), 8)])
        metrics = facemetrics.face_metrics(got, ref, labels, gallery, threshold)
        latency = {}
        for name, fn in (("aoti", engine), ("eager", model)):
            latency[name] = {f"b{b}": timeit(torch, fn, x[:b], args.device, runs=args.runs) for b in (1, 8)}
    failures = facemetrics.gate(metrics, limits)
    report = {"date": time.strftime("%Y-%m-%d"), "device": device_info(torch, args.device), "compile_s": compile_s,
              "package_mb": round(package.stat().st_size / 1e6, 1), "metrics": metrics, "latency": latency,
              "verdict": "fail" if failures else "pass", "failures": failures}
    (args.out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    (args.out / "report.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
