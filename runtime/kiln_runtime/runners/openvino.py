"""openvino-cpu engines on OpenVINO (an extra: `pip install 'kiln-runtime[openvino]'`): the IR (model.xml + .bin)
and the compile properties it was built with (config.json). The build's openvino-cpu target loads with `OvRunner`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kiln_runtime.errors import KilnError

XML, BIN, CONFIG = "model.xml", "model.bin", "config.json"


class OvRunner:
    """Runner over an openvino-cpu engine: the IR compiled for this CPU with the engine's recorded properties."""

    def __init__(self, engine_dir: Path, threads: int | None = None) -> None:
        try:
            import openvino as ov
        except ImportError:
            raise KilnError("this engine runs on OpenVINO, which is not installed",
                            "pip install 'kiln-runtime[openvino]' (or release the system's ort-cpu engines)") from None
        config = json.loads((engine_dir / CONFIG).read_text(encoding="utf-8"))
        props = config["properties"]
        if threads is not None:
            # A caller that picks the threads shares the cores (sysbench@ runs one worker process per core). OpenVINO
            # pins each stream's threads to cores from the first one on, in every process alike: two 1-thread
            # workers then share core 0 and the second core idles (measured: 2.9 → 6.5 ms a call with two processes
            # at once, 2.9 unpinned). The OS places unpinned threads.
            props = {**props, "INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False}
        self.threads = props.get("INFERENCE_NUM_THREADS", 0)        # 0: the plugin's default
        core = ov.Core()
        model = core.read_model(str(engine_dir / XML))
        self.compiled = core.compile_model(model, "CPU", props)
        self.request = self.compiled.create_infer_request()
        self.input_names = [i.get_any_name() for i in self.compiled.inputs]
        # run_all's order, each output by the name the IR gives it: the compiled output also carries the names of
        # the tensors the plugin fused into it ('291' beside YuNet's 'cls_8'), and get_any_name may pick one of those
        ir_names = {n for o in model.outputs for n in o.get_names()}
        self.output_names = []
        for o in self.compiled.outputs:
            own = sorted(set(o.get_names()) & ir_names)
            self.output_names.append(own[0] if own else o.get_any_name())

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({self.input_names[0]: batch})[0]

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        res = self.request.infer({k: np.ascontiguousarray(v, np.float32) for k, v in feed.items()})
        return [np.array(res[o]) for o in self.compiled.outputs]
