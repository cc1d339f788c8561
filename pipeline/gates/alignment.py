"""Aligner gate metrics: the engine's aligned chips against the reference's (golden@) on the golden feeds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import paths
from pipeline.roles import inputs

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.roles.aligner import Aligner


def aligner_metrics(cfg: Config, model: str, runner, root: Path, role: Aligner) -> dict[str, float]:
    from pipeline.gates.reference import load_reference

    _, reference = load_reference(paths.golden(model, root))
    diffs = [np.abs(runner.run_all(feed)[0] - ref[0]) for feed, ref in
             zip(role.feeds(cfg, model, "golden", root, inputs.CHIP_BATCH), reference)]
    return {"pixel_mae": float(np.mean([d.mean() for d in diffs])), "pixel_max_abs": float(max(d.max() for d in diffs)),
            "chips": int(sum(len(d) for d in diffs))}
