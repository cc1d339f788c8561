"""The frames sysbench@ feeds: kiln_runtime/frames.py's (what `kiln-run bench` feeds a release) of the pinned photos
(data.photos) at params `sysbench.resolution`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln_runtime.frames import GREY, digest, frames, pick  # noqa: F401

if TYPE_CHECKING:
    from pipeline.config import Config


def load(cfg: Config, root: Path = Path(".")) -> list[np.ndarray]:
    """The frames of params `sysbench.resolution` from the pinned photos (data.photos)."""
    from pipeline.data import list_photos, load_rgb

    return frames([load_rgb(p.path) for p in list_photos(Path(root) / cfg.data.photos)], cfg.sysbench.resolution)
