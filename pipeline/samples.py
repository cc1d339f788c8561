"""Model inputs ("feeds") for export parity, golden references, calibration and validation, per model role.

Each graph of the face system sees different inputs, so each model names its role in params.yaml (`samples`), and
its role builds them (pipeline/roles/): chips for an embedder, what each MTCNN net sees while the reference detector
runs on the photos, one photo per feed for the aligner and for a single-shot detector. This module dispatches to
the role; what roles share (the image sets of chips models, the reference PyTorch MTCNN detector, the photos with
the calibration set's variants) is pipeline/roles/inputs.py's, re-exported here for the stages.

Feeds are a pure function of the photos, the reference detector's weights and parameters, so stages regenerate
them instead of storing them; `deps()` and `params()` say exactly what they read (dvc.yaml tracks those), and
manifests record their digest. `stream()` yields them without holding a set in memory: chips are converted batch by
batch; detector feeds are captured photo by photo (memory: one photo's inputs) and R-/O-Net crops re-batched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.manifest import xxh3_128_hex
from pipeline.roles import registry
from pipeline.roles.inputs import (CHIP_BATCH, NETS, PHOTO_PARAMS, REFERENCE_PARAMS, SETS, Feed,  # noqa: F401
                                   chip_input, chip_set, chip_sets, held, photo_deps, photo_inputs, photo_variants,
                                   reference_deps, reference_detector, reference_inputs, reference_weights)

if TYPE_CHECKING:
    from pipeline.config import Config


# ---------------------------------------------------------------------------------------------- dispatch to the role
def role(cfg: Config, model: str):
    """The role of `model` (its params.yaml `samples`), pipeline/roles/."""
    return registry.get(cfg.model(model).samples)


def deps(cfg: Config, model: str | None, set_name: str) -> list[str]:
    """Paths the feeds of `model` on `set_name` read (None: the reference detector on the photos)."""
    if model is None:
        return reference_deps(cfg)
    return role(cfg, model).deps(cfg, model, set_name)


def params(cfg: Config, model: str | None) -> list[str]:
    """params.yaml keys the feeds depend on (chips: none here — the image set's own stage tracks them)."""
    if model is None:
        return list(REFERENCE_PARAMS)
    return role(cfg, model).params(cfg, model)


def inputs(cfg: Config, model: str, set_name: str, root: Path) -> list[dict]:
    """Manifest input references for the feeds: the image set's manifest, or the photos and detector weights."""
    return role(cfg, model).manifest_inputs(cfg, model, set_name, root)


class Stream:
    """Re-iterable feeds of one model on one set, `batch` samples at a time where the graph allows it (P-Net
    levels differ in size and the aligner takes one photo per feed, so those stay one feed per level / photo)."""

    def __init__(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> None:
        self.cfg, self.kind, self.set_name, self.root, self.batch = cfg, cfg.model(model).samples, set_name, root, batch
        self.model = model

    def __iter__(self) -> Iterator[Feed]:
        yield from registry.get(self.kind).stream(self.cfg, self.model, self.set_name, self.root, self.batch)


def stream(cfg: Config, model: str, set_name: str, root: Path = Path("."), batch: int = CHIP_BATCH) -> Stream:
    return Stream(cfg, model, set_name, root, batch)


def feeds(cfg: Config, model: str, set_name: str, root: Path = Path("."), batch: int = CHIP_BATCH) -> Sequence[Feed]:
    """The feeds as a sequence (chips stay lazy; detector feeds of the small golden photo set are held)."""
    return role(cfg, model).feeds(cfg, model, set_name, root, batch)


def digest(feeds_) -> str:
    """One content hash over every feed, for manifests."""
    h = []
    for f in feeds_:
        for name in sorted(f):
            h.append(name.encode() + str(f[name].shape).encode() + f[name].tobytes())
    return xxh3_128_hex(b"".join(h))


def sample_count(feeds_) -> int:
    return int(sum(next(iter(f.values())).shape[0] for f in feeds_))
