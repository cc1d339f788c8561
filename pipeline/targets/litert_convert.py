"""The LiteRT converter step of the `litert` target, run as a script by the converter's own interpreter
(`.venv-litert/bin/python`, lockfiles/litert-convert.txt): litert-torch and ai-edge-quantizer pin packages the main
environment cannot hold (xdsl needs typing-extensions < 4.13), so they live in their own venv and this file imports
nothing from Kiln. pipeline/targets/litert.py writes the request and reads what this writes.

    python litert_convert.py REQUEST.json

REQUEST: {"program": .pt2, "out": .tflite to write, "precision": fp32|int8, "channel_last": [input indices],
          "calibration": .npz of NCHW float32 arrays (int8 only), "recipe": "static_wi8_ai8",
          "scratch": a directory for the intermediate FP32 model of an int8 build}

fp32: litert_torch.convert of the program's module at batch 1, with `to_channel_last_io` wrapping the 4-D inputs
(NHWC, the layout edge compilers take). int8: that FP32 model quantized by ai-edge-quantizer's full-integer recipe
(int8 weights and activations, int8 input and output), calibrated on the stored chips one at a time (batch 1).
"""

from __future__ import annotations

import json
import os
import sys


def convert(req: dict) -> dict:
    import numpy as np
    import torch

    import litert_torch

    ep = torch.export.load(req["program"])
    inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    shapes = [[1 if not isinstance(s, int) else s for s in n.meta["val"].shape] for n in inputs]
    last = req["channel_last"]
    module = litert_torch.to_channel_last_io(ep.module(), args=last) if last else ep.module()
    example = tuple(torch.zeros(*(s[:1] + s[2:] + s[1:2] if i in last else s)) for i, s in enumerate(shapes))
    fp32 = os.path.join(req["scratch"], "fp32.tflite") if req["precision"] == "int8" else req["out"]
    litert_torch.convert(module, example).export(fp32)
    if req["precision"] == "fp32":
        return {"samples": 0}
    from ai_edge_litert.interpreter import Interpreter
    from ai_edge_quantizer import quantizer, recipe

    signature = Interpreter(model_path=fp32).get_signature_list()
    (key, sig), = signature.items()
    data = np.load(req["calibration"])
    arrays = [data[f"input{i}"] for i in range(len(shapes))]
    feeds = []
    for j in range(arrays[0].shape[0]):
        one = [a[j:j + 1].transpose(0, 2, 3, 1) if i in last else a[j:j + 1] for i, a in enumerate(arrays)]
        feeds.append({name: np.ascontiguousarray(v, np.float32) for name, v in zip(sig["inputs"], one)})
    qt = quantizer.Quantizer(fp32, getattr(recipe, req["recipe"])())
    result = qt.quantize(qt.calibrate({key: feeds}, num_threads=1), enable_progress_bar=False,
                         enable_progress_report=False)
    with open(req["out"], "wb") as f:
        f.write(result.quantized_model)
    return {"samples": len(feeds)}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        request = json.load(f)
    print(json.dumps(convert(request)))         # for a run by hand; the target reads the files
