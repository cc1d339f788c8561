"""Cold start of one engine, measured in the fresh process this module runs as:

    python -m pipeline.coldstart TARGET ENGINE_DIR SHAPE_JSON MAX_BATCH SAMPLES_KIND

Import time, verified load (pipeline/engines.py: private copy + checksums + session creation), first inference,
and the resident memory the engine adds after max-batch inferences; prints one JSON line. bench@ runs it per engine.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path


def rss_mb() -> float:
    """Current resident set; ru_maxrss is a high-water mark that the imports already set."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(target: str, engine_dir: str, shape: str, max_batch: str, kind: str) -> None:
    t0 = time.perf_counter()
    import onnx  # noqa: F401  (runtime imports count as baseline, not as the engine's memory)
    import onnxruntime  # noqa: F401

    from pipeline import engines
    from pipeline.targets.base import synthetic_feed
    t_import = time.perf_counter()
    rss_base = rss_mb()
    runner = engines.load(target, Path(engine_dir))
    t_load = time.perf_counter()
    dims = tuple(json.loads(shape))
    runner.run_all(synthetic_feed(kind, dims, 1))
    t_first = time.perf_counter()
    big = synthetic_feed(kind, dims, int(max_batch))
    for _ in range(5):
        runner.run_all(big)
    print(json.dumps({"import_ms": (t_import - t0) * 1e3, "load_ms": (t_load - t_import) * 1e3,
                      "first_inference_ms": (t_first - t_load) * 1e3,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "engine_rss_mb": rss_mb() - rss_base}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
