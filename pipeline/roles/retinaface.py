"""The single-shot detector role (`samples: retinaface`): one whole photo → every face's box, score and landmarks.

Feeds: one per photo (the calibration set's variants too), preprocessed as the family wants (BGR minus its mean,
kiln_runtime/retinaface.py) — no reference detector involved. It comes as an ONNX file, whose three outputs
(loc, conf, landmarks) import@ checks; its reference and gate run that original on ONNX Runtime. The gate decodes
the engine's and the reference's outputs on every photo and compares the faces, and the face / non-face decisions on
skimage's lfw_subset (pipeline/gates/detection.py), against params.yaml `validate.detector`. A face system decodes
it with the model's `decode:` thresholds (`detect`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.roles.base import DetectorRole, Feed, Outputs

if TYPE_CHECKING:
    from pipeline.config import Config, ModelConfig


class RetinaFace(DetectorRole):
    name = "retinaface"
    task = "detect"
    feed_range = (-127.0, 151.0)          # BGR pixels minus its mean
    outputs = Outputs(3, 3, "a RetinaFace detector has 3 outputs of rank 3: loc (batch, anchors, 4), conf "
                            "(…, 2), landmarks (…, 10)")
    onnx_only = True
    metrics = "pipeline.gates.detection:retinaface_metrics"

    def stream(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Iterator[Feed]:
        from pipeline.roles import inputs
        from kiln_runtime import retinaface

        for rgb in inputs.photo_variants(cfg, set_name, root):
            yield {"input": retinaface.preprocess(rgb)}

    def detect(self, rgb: np.ndarray, run: Callable, mcfg: ModelConfig) -> list:
        """Faces in one RGB photo; `run` maps the preprocessed input to (loc, conf, landmarks)."""
        from kiln_runtime import retinaface

        decode = mcfg.decode
        return retinaface.detect(rgb, run, retinaface.DecodeConfig(**({} if decode is None else {
            "score_threshold": decode.score_threshold, "nms_threshold": decode.nms_threshold})))


RETINAFACE = RetinaFace()
