"""ort-cpu engines on ONNX Runtime: the offline-optimized graph (model.onnx) and the session options it was compiled
with (session.json). The build's ort-cpu target compiles with `ort_session_options` and loads with `OrtRunner`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ENGINE, SESSION = "model.onnx", "session.json"


def ort_session_options(threads: int, spin: bool, optimized_out: Path | None = None, level: str = "ORT_ENABLE_ALL"):
    """ONNX Runtime session options: a compile (`optimized_out`: optimize at `level`, save the graph there) or a load
    of an engine already optimized offline."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # Idle intra-op threads spin by default; with several sessions in one process (the e2e system runs five) on 2
    # cores they steal each other's time. Off unless the engine's session says otherwise.
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # the hardware-specific-layout warning is expected and recorded in the manifest
    if optimized_out is None:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # already optimized offline
    else:
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        so.optimized_model_filepath = str(optimized_out)
    return so


class OrtRunner:
    """Runner over a compiled ort-cpu engine, with the session options it was compiled for (`threads`: another
    intra-op thread count, e.g. one per worker when a load test runs several)."""

    def __init__(self, engine_dir: Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        session = json.loads((engine_dir / SESSION).read_text(encoding="utf-8"))
        self.threads = session["threads"] if threads is None else threads
        self.session = ort.InferenceSession(str(engine_dir / ENGINE),
                                            ort_session_options(self.threads, session.get("spin", False)),
                                            providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [o.name for o in self.session.get_outputs()]    # run_all's order

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: np.ascontiguousarray(batch, np.float32)})[0]

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, feed)
