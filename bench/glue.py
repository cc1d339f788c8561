"""MTCNN glue time — detect() minus the time spent inside its three nets — per scenario, from ONE run.

The glue is the cascade around the nets (pyramid, crops, NMS, box maths: pipeline/models/mtcnn.py); the nets are
built engines (default: the ORT CPU FP32 ones). Scenarios are bench/e2e.py's: a one-face portrait, that portrait
upscaled to ~1000 px, three portraits side by side. Rounds are interleaved (every scenario with every module in
each round), after 2 warm-up rounds. Per scenario: glue ms p50 (wall clock), glue CPU ms p50 (this thread's CPU
time outside the nets: steadier than the wall clock on a busy host) and nets ms p50 (wall).

With --before PATH that file is loaded as a second detector module (say, a copy of mtcnn.py from before a change)
and both are timed side by side with the before/after ratios, once both were checked to find the same faces bit
for bit (boxes, scores, landmarks) in every scenario.

Usage (after the engines are built):
    .venv/bin/python bench/glue.py [--repeats 30] [--before /tmp/mtcnn_before.py] [--engines ort-cpu-fp32]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/e2e.py's scenarios

from e2e import scenarios  # noqa: E402

from pipeline import config, engines, paths, tables, toolchain  # noqa: E402
from pipeline.models import mtcnn  # noqa: E402

NETS = ("pnet", "rnet", "onet")


def load_module(path: Path) -> ModuleType:
    """Another copy of the detector module, from a file, under a name of its own."""
    name = f"mtcnn_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


class Clock:
    """Runners that add the wall and this-thread CPU time spent inside them to `nets_wall` / `nets_cpu`."""

    def __init__(self, runners):
        self.nets_wall = self.nets_cpu = 0.0
        self.runners = [self._timed(r) for r in runners]

    def _timed(self, run):
        def timed(x):
            w, c = time.perf_counter(), time.thread_time()
            out = run(x)
            self.nets_cpu += time.thread_time() - c
            self.nets_wall += time.perf_counter() - w
            return out
        return timed

    def detect(self, module: ModuleType, rgb: np.ndarray, det_cfg) -> tuple[list, dict[str, float]]:
        self.nets_wall = self.nets_cpu = 0.0
        w, c = time.perf_counter(), time.thread_time()
        faces = module.detect(rgb, *self.runners, det_cfg)
        wall, cpu = time.perf_counter() - w, time.thread_time() - c
        return faces, {"glue": (wall - self.nets_wall) * 1e3, "glue cpu": (cpu - self.nets_cpu) * 1e3,
                       "nets": self.nets_wall * 1e3}


def same_faces(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.box == y.box and x.score == y.score and x.landmarks.dtype == y.landmarks.dtype
        and np.array_equal(x.landmarks, y.landmarks) for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30, help="measured rounds (after 2 warm-up rounds)")
    ap.add_argument("--before", type=Path, help="another mtcnn module file to time side by side")
    ap.add_argument("--engines", default="ort-cpu-fp32", help="engine name suffix: <net>-<suffix> (%(default)s)")
    args = ap.parse_args()
    cfg = config.load(Path("params.yaml"))
    names = [f"{net}-{args.engines}" for net in NETS]
    runners = []
    for name in names:
        r = engines.load(cfg.engine(name).target, paths.engine(name), name)
        runners.append((lambda r: lambda x: tuple(r.run_all({"input": x})))(r))
    clock = Clock(runners)
    modules = {"after": mtcnn}
    if args.before:
        modules = {"before": load_module(args.before), "after": mtcnn}
    det_cfg = {k: m.DetectorConfig(min_face_size=cfg.data.min_face_size) for k, m in modules.items()}
    scen = scenarios(cfg)

    faces = {(k, s): clock.detect(m, rgb, det_cfg[k])[0] for s, rgb in scen.items() for k, m in modules.items()}
    if args.before:
        differ = [s for s in scen if not same_faces(faces[("before", s)], faces[("after", s)])]
        if differ:
            print(f"the two modules find different faces in: {', '.join(differ)}", file=sys.stderr)
            return 1

    samples = defaultdict(list)
    for r in range(args.repeats + 2):                   # 2 warm-up rounds, then interleaved measured rounds
        for s, rgb in scen.items():
            for k, m in modules.items():
                _, t = clock.detect(m, rgb, det_cfg[k])
                if r >= 2:
                    for col, ms in t.items():
                        samples[(k, s, col)].append(ms)
        print(f"round {r + 1}/{args.repeats + 2}", file=sys.stderr)

    def p50(k, s, col):
        return float(np.percentile(samples[(k, s, col)], 50))

    facts = toolchain.cpu()
    print(f"host: {facts['cpu']} ({toolchain.host_class()}, {os.cpu_count()} CPUs); engines: {', '.join(names)}; "
          f"{args.repeats} interleaved rounds; p50 ms")
    rows = []
    for s, rgb in scen.items():
        row = [s, f"{rgb.shape[1]}x{rgb.shape[0]}", len(faces[("after", s)])]
        if args.before:
            for col in ("glue", "glue cpu"):
                b, a = p50("before", s, col), p50("after", s, col)
                row += [f"{b:.2f}", f"{a:.2f}", f"{b / a:.2f}x"]
            row += [f"{p50('before', s, 'nets'):.2f}", f"{p50('after', s, 'nets'):.2f}"]
        else:
            row += [f"{p50('after', s, c):.2f}" for c in ("glue", "glue cpu", "nets")]
        rows.append(row)
    if args.before:
        headers = ["scenario", "size", "faces", "glue before", "glue after", "ratio", "glue cpu before",
                   "glue cpu after", "ratio", "nets before", "nets after"]
    else:
        headers = ["scenario", "size", "faces", "glue", "glue cpu", "nets"]
    print(tables.markdown(headers, rows))
    if args.before:
        print("\nsame faces, bit for bit, in every scenario (boxes, scores, landmarks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
