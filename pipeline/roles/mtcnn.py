"""The MTCNN roles (`samples: pnet | rnet | onet`): the three nets of the cascade, one role object each.

Feeds: exactly what that net sees when the reference (PyTorch) detector runs on the photos — every pyramid level for
P-Net, the candidate crops for R- and O-Net — captured by wrapping the reference nets; the calibration set adds
deterministic darker, brighter and mirrored variants of each photo. Captured photo by photo (memory: one photo's
inputs); R-/O-Net crops are re-batched. P-Net is fully convolutional: its outputs' spatial axes are dynamic.
The gate swaps the net's engine into the reference cascade: do the same faces come out (pipeline/gates/detection.py),
against params.yaml `validate.detector`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.roles.base import DetectorRole, Feed, by_name

if TYPE_CHECKING:
    from pipeline.config import Config


def _rebatch(per_photo: Iterator[list[Feed]], batch: int) -> Iterator[Feed]:
    """R-/O-Net crops (same shape) joined or split into feeds of `batch` samples, photo by photo."""
    for feeds in per_photo:
        if not feeds:
            continue
        x = np.concatenate([f["input"] for f in feeds])
        for i in range(0, len(x), batch):
            yield {"input": x[i:i + batch]}


class MtcnnNet(DetectorRole):
    task = "cascade"
    metrics = "pipeline.gates.detection:detector_metrics"     # (cfg, net, runner, root, role)

    def __init__(self, name: str, index: int, crop: int | None) -> None:
        self.name = name
        self.index = index          # its place in the cascade (the reference detector's nets)
        self.crop = crop            # R-/O-Net: the side of the square crops it classifies; P-Net: None (pyramid)
        self.crop_fed = crop is not None

    # ------------------------------------------------------------------ feeds: the reference detector on the photos
    def deps(self, cfg: Config, model: str, set_name: str) -> list[str]:
        from pipeline.roles import inputs

        return inputs.reference_deps(cfg)

    def params(self, cfg: Config, model: str) -> list[str]:
        from pipeline.roles import inputs

        return list(inputs.REFERENCE_PARAMS)

    def manifest_inputs(self, cfg: Config, model: str, set_name: str, root: Path) -> list[dict]:
        from pipeline.roles import inputs

        return inputs.reference_inputs(cfg, root)

    def captured(self, cfg: Config, set_name: str, root: Path) -> Iterator[list[Feed]]:
        """Per photo variant: every input this net receives while the reference detector runs on it."""
        from pipeline.roles import inputs
        from pipeline.models import mtcnn

        nets, det_cfg = inputs.reference_detector(cfg, root)
        k = self.index
        for rgb in inputs.photo_variants(cfg, set_name, root):
            captured: list[Feed] = []
            run = mtcnn.torch_runner(nets[k])

            def record(x: np.ndarray, run=run, captured=captured):
                captured.append({"input": np.ascontiguousarray(x, np.float32)})
                return run(x)

            runners = list(nets)
            runners[k] = record
            mtcnn.detect(rgb, *runners, det_cfg)
            yield captured

    def stream(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Iterator[Feed]:
        if not self.crop_fed:               # P-Net: one feed per pyramid level (their sizes differ)
            for feeds in self.captured(cfg, set_name, root):
                yield from feeds
        else:
            yield from _rebatch(self.captured(cfg, set_name, root), batch)

    # ------------------------------------------------------------------ export
    def output_axes(self) -> dict[int, str]:
        if self.crop_fed:
            return super().output_axes()
        return {0: "batch", 2: "out_h", 3: "out_w"}   # fully convolutional: every output follows the input's size

    # ------------------------------------------------------------------ gate
    def measure(self, cfg: Config, model: str, runner, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        return by_name(self.metrics)(cfg, self.name, runner, root, self), {}


PNET = MtcnnNet("pnet", 0, None)
RNET = MtcnnNet("rnet", 1, 24)
ONET = MtcnnNet("onet", 2, 48)
