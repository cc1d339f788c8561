"""Cold start of one engine, measured in the fresh process this module runs as:

    python -m pipeline.coldstart TARGET ENGINE_DIR SHAPE_JSON MAX_BATCH SAMPLES_KIND [SPAWNED_AT]

From process start to the first output, in phases: the interpreter's own start (SPAWNED_AT, the parent's wall clock
just before it started this process, to this module's first line), Kiln's loader (pipeline.engines and the target
module), the target's runtime (`Target.runtime`: onnxruntime, openvino, torch, …), the verified load (private copy +
checksums + session creation) and the first inference. Then the resident memory the engine adds after max-batch
inferences. Prints one JSON line; bench@ runs it per engine. Nothing but what the engine needs is imported.
"""

from __future__ import annotations

import time

T0_WALL, T0 = time.time(), time.perf_counter()

import importlib  # noqa: E402  (timed from the first line)
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def rss_mb() -> float:
    """Current resident set; ru_maxrss is a high-water mark that the imports already set."""
    return int(open("/proc/self/statm", encoding="utf-8").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(target: str, engine_dir: str, shape: str, max_batch: str, kind: str, spawned_at: str | None = None) -> dict:
    from pipeline import engines, targets
    from pipeline.roles.registry import synthetic_feed
    t = targets.get(target)
    t_kiln = time.perf_counter()
    for module in t.runtime:
        importlib.import_module(module)
    t_runtime = time.perf_counter()
    rss_base = rss_mb()
    runner = engines.load(target, Path(engine_dir))
    t_load = time.perf_counter()
    dims = tuple(json.loads(shape))
    runner.run_all(synthetic_feed(kind, dims, 1))
    t_first = time.perf_counter()
    big = synthetic_feed(kind, dims, int(max_batch))
    for _ in range(5):
        runner.run_all(big)
    interpreter_ms = max(0.0, (T0_WALL - float(spawned_at)) * 1e3) if spawned_at else 0.0
    out = {"interpreter_ms": interpreter_ms, "kiln_import_ms": (t_kiln - T0) * 1e3,
           "runtime_import_ms": (t_runtime - t_kiln) * 1e3, "load_ms": (t_load - t_runtime) * 1e3,
           "first_inference_ms": (t_first - t_load) * 1e3,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "engine_rss_mb": rss_mb() - rss_base}
    out["cold_start_ms"] = interpreter_ms + (t_first - T0) * 1e3      # process start → first output
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:7])))
