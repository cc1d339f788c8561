"""End-to-end latency per stage, from ONE run: ORT FP32 / INT8-where-built, AOTInductor, OpenVINO, the leaderboard's
fastest engine per graph, and PyTorch eager.

Scenarios: a portrait with one face, a large photo (the portrait upscaled to ~1000 px on its long side), and a
frame with several faces (three portraits side by side). Per stage p50/p95 over interleaved repeats, total per
photo and per face. Usage (after `bash scripts/run.sh`):  .venv/bin/python bench/e2e.py [--repeats N]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline import config, tables
from pipeline.data import list_photos, load_rgb
from pipeline.e2e import STAGES, System


def scenarios(cfg) -> dict[str, np.ndarray]:
    photos = {p.path.stem: load_rgb(p.path) for p in list_photos(cfg.data.photos)}
    one = photos["person_b_1"]
    h, w = one.shape[:2]
    k = 1000 / max(h, w)
    large = np.asarray(Image.fromarray(one).resize((round(w * k), round(h * k)), Image.BILINEAR))
    tiles = [np.asarray(Image.fromarray(photos[n]).resize((300, 380), Image.BILINEAR))
             for n in ("person_a_2", "person_b_2", "impostor_1")]
    return {"one face": one, "large ~1000px": large, "three faces": np.concatenate(tiles, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    cfg = config.load(Path("params.yaml"))
    systems = [System.from_engines(cfg, "ort-cpu", "fp32"), System.from_engines(cfg, "ort-cpu", "int8"),
               System.from_engines(cfg, "aoti-cpu", "fp32"), System.from_engines(cfg, "openvino-cpu", "int8"),
               System.fastest(cfg), System.eager(cfg)]
    for s in systems:
        s.enroll()
    scen = scenarios(cfg)
    samples = {(s.name, n): defaultdict(list) for s in systems for n in scen}
    faces = {}
    for r in range(args.repeats + 2):                 # 2 warm-up rounds, then interleaved measured rounds
        for name, rgb in scen.items():
            for s in systems:
                s.timings.clear()
                found = s.identify(rgb)
                faces[name] = len(found)
                if r >= 2:
                    for st in STAGES:
                        samples[(s.name, name)][st].append(s.timings.get(st, 0.0))
                    samples[(s.name, name)]["total"].append(sum(s.timings.values()))
        print(f"round {r + 1}/{args.repeats + 2}", file=sys.stderr)
    cols = [*STAGES, "total"]
    rows = []
    for (sname, scen_name), st in samples.items():
        p50 = {c: np.percentile(st[c], 50) for c in cols}
        rows.append([sname, scen_name, faces[scen_name], *(f"{p50[c]:.1f}" for c in cols),
                     f"{np.percentile(st['total'], 95):.1f}", f"{p50['total'] / max(faces[scen_name], 1):.1f}"])
    print(tables.markdown(["system", "scenario", "faces", *(f"{c} p50" for c in cols), "total p95", "ms/face"], rows))
    engines = {s.name: s.engines for s in systems}
    print("\nengines:", engines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
