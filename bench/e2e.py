"""End-to-end latency per stage, from ONE run: ORT FP32 / INT8-where-built, AOTInductor, OpenVINO, the leaderboard's
fastest engine per graph, and PyTorch eager — or, with --systems, face systems side by side on each --targets.

Scenarios: a portrait with one face, a large photo (the portrait upscaled to ~1000 px on its long side), and a
frame with several faces (three portraits side by side). Per stage p50/p95 over interleaved repeats, total per
photo and per face. Usage (after `bash scripts/run.sh`):  .venv/bin/python bench/e2e.py [--repeats N]
Systems (after `kiln profile sface-retinaface` and `bash scripts/run.sh`):
  .venv/bin/python bench/e2e.py --systems dlib-mtcnn,sface-mtcnn,dlib-retinaface,sface-retinaface
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from pipeline import config, tables
from pipeline.data import list_photos, load_rgb
from pipeline.config import MTCNN
from pipeline.e2e import NETS, STAGES, System

if TYPE_CHECKING:
    from pipeline.config import Config


def scenarios(cfg: Config) -> dict[str, np.ndarray]:
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
    ap.add_argument("--systems", help="comma-separated params.yaml systems to compare (FP32 engines of each target)")
    ap.add_argument("--targets", default="ort-cpu,openvino-cpu", help="with --systems: the targets, comma-separated")
    args = ap.parse_args()
    cfg = config.load(Path("params.yaml"))
    if args.systems:
        systems = []
        for name in args.systems.split(","):
            for target in args.targets.split(","):
                systems.append(System.from_engines(cfg, target, "fp32", system=name))
                systems[-1].name = f"{name} {target}"
    else:
        systems = [System.from_engines(cfg, "ort-cpu", "fp32"), System.from_engines(cfg, "ort-cpu", "int8"),
                   System.from_engines(cfg, "aoti-cpu", "fp32"), System.from_engines(cfg, "openvino-cpu", "int8"),
                   System.fastest(cfg), System.eager(cfg)]
    for s in systems:
        s.enroll()
    # per system, its detector's graph(s) — summed into one column when systems differ
    stages = ("detect nets", "detect_glue", "align", "embed", "match") if args.systems else STAGES

    def stage_ms(s: System, st: str) -> float:
        if st != "detect nets":
            return s.timings.get(st, 0.0)
        det = cfg.system(s.system).detector
        return sum(s.timings.get(n, 0.0) for n in (NETS if det == MTCNN else (det,)))
    scen = scenarios(cfg)
    samples = {(s.name, n): defaultdict(list) for s in systems for n in scen}
    faces = {}
    for r in range(args.repeats + 2):                 # 2 warm-up rounds, then interleaved measured rounds
        for name, rgb in scen.items():
            for s in systems:
                s.timings.clear()
                found = s.identify(rgb)
                faces[(s.name, name)] = len(found)
                if r >= 2:
                    for st in stages:
                        samples[(s.name, name)][st].append(stage_ms(s, st))
                    samples[(s.name, name)]["total"].append(sum(s.timings.values()))
        print(f"round {r + 1}/{args.repeats + 2}", file=sys.stderr)
    cols = [*stages, "total"]
    rows = []
    for (sname, scen_name), st in samples.items():
        p50 = {c: np.percentile(st[c], 50) for c in cols}
        n = faces[(sname, scen_name)]
        rows.append([sname, scen_name, n, *(f"{p50[c]:.1f}" for c in cols),
                     f"{np.percentile(st['total'], 95):.1f}", f"{p50['total'] / max(n, 1):.1f}"])
    print(tables.markdown(["system", "scenario", "faces", *(f"{c} p50" for c in cols), "total p95", "ms/face"], rows))
    engines = {s.name: s.engines for s in systems}
    print("\nengines:", engines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
