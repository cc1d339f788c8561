"""The aligner role (`samples: aligner`): one photo and the similarity transforms of its faces → their chips.

Feeds: one per photo (the calibration set's variants too): the image as (1, 3, H, W) float32 and the chip transforms
(`theta`) of the faces the reference detector finds on it, fitted to `data.template`; a photo without a face gives
no feed. The gate compares the engine's chips with golden@'s pixel by pixel (pipeline/gates/alignment.py), against
params.yaml `validate.aligner`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.roles.base import Feed, Role

if TYPE_CHECKING:
    from pipeline.config import Config


class Aligner(Role):
    name = "aligner"
    task = "align"
    feed_names = ("image", "theta")
    key_metric, direction, accuracy_label = "pixel_mae", -1, "pixel MAE"
    metrics = "pipeline.gates.alignment:aligner_metrics"
    limits_section = "aligner"
    checks = (("pixel_mae", "<=", "pixel_mae_max"), ("pixel_max_abs", "<=", "pixel_max_abs_max"))

    def deps(self, cfg: Config, model: str, set_name: str) -> list[str]:
        from pipeline.roles import inputs

        return inputs.reference_deps(cfg)

    def params(self, cfg: Config, model: str) -> list[str]:
        from pipeline.roles import inputs

        return [*inputs.REFERENCE_PARAMS, "data.template"]

    def manifest_inputs(self, cfg: Config, model: str, set_name: str, root: Path) -> list[dict]:
        from pipeline.roles import inputs

        return inputs.reference_inputs(cfg, root)

    def stream(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Iterator[Feed]:
        """One feed per photo with faces, whatever `batch` (the faces of a photo are its batch)."""
        from pipeline.roles import inputs
        from pipeline.models import mtcnn
        from pipeline.models.align import chip_transform

        nets, det_cfg = inputs.reference_detector(cfg, root)
        template = np.asarray(cfg.data.template)
        for rgb in inputs.photo_variants(cfg, set_name, root):
            faces = mtcnn.detect(rgb, *nets, det_cfg)
            if faces:
                theta = np.stack([chip_transform(f.landmarks, template) for f in faces])
                yield {"image": np.ascontiguousarray(rgb.transpose(2, 0, 1)[None], np.float32), "theta": theta}

    def random_feed(self, input_shape: tuple[int, ...], batch: int, seed: int = 0) -> Feed:
        """One image of input_shape, `batch` faces to cut out of it."""
        rng = np.random.default_rng(seed)
        theta = np.tile(np.array([[[1.0, 0.0, 20.0], [0.0, 1.0, 20.0]]], np.float32), (batch, 1, 1))
        return {"image": rng.uniform(0, 255, (1, *input_shape)).astype(np.float32), "theta": theta}


ALIGNER = Aligner()
