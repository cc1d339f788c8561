"""What the roles share to make their feeds (pipeline/roles/*): the image sets of chips models, the reference (PyTorch
MTCNN) detector and its weights, the photos with the calibration set's variants, and what each of those reads (deps,
params, manifest inputs). Nothing here dispatches to a role — pipeline/samples.py does — so a role's module and the
gates it names import this, never the dispatch (no cycle through the roles registry).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln_runtime.system import Preprocess
from kiln_runtime.system import chip_input as chip_input_of
from pipeline.data import list_photos, load_rgb
from pipeline.errors import KilnError
from pipeline.manifest import file_input

if TYPE_CHECKING:
    from pipeline.config import Config, ModelConfig


Feed = dict[str, np.ndarray]
CHIP_BATCH = 8
NETS = ("pnet", "rnet", "onet")       # the reference detector's models (params.yaml models:)


# ---------------------------------------------------------------------------------------------- chip sets
SETS = ("golden", "calibration")


def chip_set(cfg: Config, model: str | None, set_name: str) -> str:
    """The image set a chips model reads: `<set>` (data.chip_size / data.template), or `<set>-<model>` for a
    model with its own preprocess geometry."""
    if model is None or cfg.model(model).preprocess is None:
        return set_name
    return f"{set_name}-{model}"


def chip_sets(cfg: Config) -> dict[str, tuple[str, str | None]]:
    """Every image set the DAG builds: {key: (golden|calibration, the model whose geometry it has, or None)}."""
    out: dict[str, tuple[str, str | None]] = {s: (s, None) for s in SETS}
    for name, m in cfg.models.items():
        if m.preprocess is not None:            # config.py: only an embedder (its role's task) takes a preprocess
            out.update({chip_set(cfg, name, s): (s, name) for s in SETS})
    return out


def chip_input(mcfg: ModelConfig, chips: np.ndarray) -> np.ndarray:
    """(N, S, S, 3) uint8 RGB chips → the model's (N, 3, S, S) float32 input: channel order, then (x - mean) / std
    (kiln_runtime.system.chip_input: the deployment host's)."""
    pre = mcfg.preprocess
    return chip_input_of(chips, None if pre is None else Preprocess(pre.channels, tuple(pre.mean), tuple(pre.std)))


# ---------------------------------------------------------------------------------------------- what feeds read
def reference_weights(cfg: Config) -> list[Path]:
    """The reference detector's weights: models.pnet/rnet/onet.weights (relative to the project root)."""
    missing = [n for n in NETS if n not in cfg.models or cfg.models[n].weights is None]
    if missing:
        raise KilnError(f"{cfg.source}: models: the reference detector needs {', '.join(missing)} with weights",
                        "keep the MTCNN nets in params.yaml models: (they landmark the image sets)")
    return [Path(cfg.models[n].weights) for n in NETS]


def photo_deps(cfg: Config) -> list[str]:
    return [Path(cfg.data.photos).as_posix()]


def reference_deps(cfg: Config) -> list[str]:
    """The photos and the reference detector's weights: what its feeds (and the image sets) read."""
    return [*photo_deps(cfg), *(w.as_posix() for w in reference_weights(cfg))]


PHOTO_PARAMS = ["data.photos"]
REFERENCE_PARAMS = ["data.photos", "data.min_face_size"]


def photo_inputs(cfg: Config, root: Path) -> list[dict]:
    return [file_input("photo", p.path, root) for p in list_photos(root / cfg.data.photos)]


def reference_inputs(cfg: Config, root: Path) -> list[dict]:
    return photo_inputs(cfg, root) + [file_input("detector_weights", root / w, root) for w in reference_weights(cfg)]


# ---------------------------------------------------------------------------------------------- feeds
def photo_variants(cfg: Config, set_name: str, root: Path) -> Iterator[np.ndarray]:
    """Every photo; the calibration set adds it darker, brighter and mirrored."""
    for p in list_photos(root / cfg.data.photos):
        img = load_rgb(p.path)
        yield img
        if set_name == "calibration":   # the photo, darker, brighter, mirrored
            f = img.astype(np.float32)
            yield np.clip(f * 0.7, 0, 255).astype(np.uint8)
            yield np.clip(f * 1.25, 0, 255).astype(np.uint8)
            yield np.ascontiguousarray(img[:, ::-1])


def reference_detector(cfg: Config, root: Path):
    """The reference (PyTorch) MTCNN nets and their detector config."""
    from pipeline.models import mtcnn

    return mtcnn.load_nets(*(root / w for w in reference_weights(cfg))), \
        mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)


def held(model: str, set_name: str, feeds_: Iterator[Feed]) -> list[Feed]:
    """Feeds held as a list; none is an error (the reference detector found no face, or no photo was read)."""
    out = list(feeds_)
    if not out:
        raise KilnError(f"{model}: the {set_name} photos gave no inputs for this graph",
                        "check data.photos: the reference detector must find faces in them")
    return out
