"""Model inputs ("feeds") for export parity, golden references, calibration and validation, per model role.

Each graph of the face system sees different inputs, so each model names its role in params.yaml (`samples`), and
its role builds them (pipeline/roles/): chips for an embedder, what each MTCNN net sees while the reference detector
runs on the photos, one photo per feed for the aligner and for a single-shot detector. This module dispatches to
the role and holds what roles share: the image sets of chips models, the reference (PyTorch MTCNN) detector and the
photos with the calibration set's variants.

Feeds are a pure function of the photos, the reference detector's weights and parameters, so stages regenerate
them instead of storing them; `deps()` and `params()` say exactly what they read (dvc.yaml tracks those), and
manifests record their digest. `stream()` yields them without holding a set in memory: chips are converted batch by
batch; detector feeds are captured photo by photo (memory: one photo's inputs) and R-/O-Net crops re-batched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from kiln_runtime.system import Preprocess
from kiln_runtime.system import chip_input as chip_input_of
from pipeline.data import list_photos, load_rgb
from pipeline.errors import KilnError
from pipeline.manifest import file_input, xxh3_128_hex
from pipeline.roles import registry

Feed = dict[str, np.ndarray]
CHIP_BATCH = 8
NETS = ("pnet", "rnet", "onet")       # the reference detector's models (params.yaml models:)


# ---------------------------------------------------------------------------------------------- chip sets
SETS = ("golden", "calibration")


def chip_set(cfg, model: str | None, set_name: str) -> str:
    """The image set a chips model reads: `<set>` (data.chip_size / data.template), or `<set>-<model>` for a
    model with its own preprocess geometry."""
    if model is None or cfg.model(model).preprocess is None:
        return set_name
    return f"{set_name}-{model}"


def chip_sets(cfg) -> dict[str, tuple[str, str | None]]:
    """Every image set the DAG builds: {key: (golden|calibration, the model whose geometry it has, or None)}."""
    out: dict[str, tuple[str, str | None]] = {s: (s, None) for s in SETS}
    for name, m in cfg.models.items():
        if m.preprocess is not None:            # config.py: only an embedder (its role's task) takes a preprocess
            out.update({chip_set(cfg, name, s): (s, name) for s in SETS})
    return out


def chip_input(mcfg, chips: np.ndarray) -> np.ndarray:
    """(N, S, S, 3) uint8 RGB chips → the model's (N, 3, S, S) float32 input: channel order, then (x - mean) / std
    (kiln_runtime.system.chip_input: the deployment host's)."""
    pre = mcfg.preprocess
    return chip_input_of(chips, None if pre is None else Preprocess(pre.channels, tuple(pre.mean), tuple(pre.std)))


# ---------------------------------------------------------------------------------------------- what feeds read
def reference_weights(cfg) -> list[Path]:
    """The reference detector's weights: models.pnet/rnet/onet.weights (relative to the project root)."""
    missing = [n for n in NETS if n not in cfg.models or cfg.models[n].weights is None]
    if missing:
        raise KilnError(f"{cfg.source}: models: the reference detector needs {', '.join(missing)} with weights",
                        "keep the MTCNN nets in params.yaml models: (they landmark the image sets)")
    return [Path(cfg.models[n].weights) for n in NETS]


def photo_deps(cfg) -> list[str]:
    return [Path(cfg.data.photos).as_posix()]


def reference_deps(cfg) -> list[str]:
    """The photos and the reference detector's weights: what its feeds (and the image sets) read."""
    return [*photo_deps(cfg), *(w.as_posix() for w in reference_weights(cfg))]


PHOTO_PARAMS = ["data.photos"]
REFERENCE_PARAMS = ["data.photos", "data.min_face_size"]


def photo_inputs(cfg, root: Path) -> list[dict]:
    return [file_input("photo", p.path, root) for p in list_photos(root / cfg.data.photos)]


def reference_inputs(cfg, root: Path) -> list[dict]:
    return photo_inputs(cfg, root) + [file_input("detector_weights", root / w, root) for w in reference_weights(cfg)]


def role(cfg, model: str):
    """The role of `model` (its params.yaml `samples`), pipeline/roles/."""
    return registry.get(cfg.model(model).samples)


def deps(cfg, model: str | None, set_name: str) -> list[str]:
    """Paths the feeds of `model` on `set_name` read (None: the reference detector on the photos)."""
    if model is None:
        return reference_deps(cfg)
    return role(cfg, model).deps(cfg, model, set_name)


def params(cfg, model: str | None) -> list[str]:
    """params.yaml keys the feeds depend on (chips: none here — the image set's own stage tracks them)."""
    if model is None:
        return list(REFERENCE_PARAMS)
    return role(cfg, model).params(cfg, model)


def inputs(cfg, model: str, set_name: str, root: Path) -> list[dict]:
    """Manifest input references for the feeds: the image set's manifest, or the photos and detector weights."""
    return role(cfg, model).manifest_inputs(cfg, model, set_name, root)


# ---------------------------------------------------------------------------------------------- feeds
def photo_variants(cfg, set_name: str, root: Path) -> Iterator[np.ndarray]:
    """Every photo; the calibration set adds it darker, brighter and mirrored."""
    for p in list_photos(root / cfg.data.photos):
        img = load_rgb(p.path)
        yield img
        if set_name == "calibration":   # the photo, darker, brighter, mirrored
            f = img.astype(np.float32)
            yield np.clip(f * 0.7, 0, 255).astype(np.uint8)
            yield np.clip(f * 1.25, 0, 255).astype(np.uint8)
            yield np.ascontiguousarray(img[:, ::-1])


def reference_detector(cfg, root: Path):
    """The reference (PyTorch) MTCNN nets and their detector config."""
    from pipeline.models import mtcnn

    return mtcnn.load_nets(*(root / w for w in reference_weights(cfg))), \
        mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)


class Stream:
    """Re-iterable feeds of one model on one set, `batch` samples at a time where the graph allows it (P-Net
    levels differ in size and the aligner takes one photo per feed, so those stay one feed per level / photo)."""

    def __init__(self, cfg, model: str, set_name: str, root: Path, batch: int) -> None:
        self.cfg, self.kind, self.set_name, self.root, self.batch = cfg, cfg.model(model).samples, set_name, root, batch
        self.model = model

    def __iter__(self) -> Iterator[Feed]:
        yield from registry.get(self.kind).stream(self.cfg, self.model, self.set_name, self.root, self.batch)


def stream(cfg, model: str, set_name: str, root: Path = Path("."), batch: int = CHIP_BATCH) -> Stream:
    return Stream(cfg, model, set_name, root, batch)


def feeds(cfg, model: str, set_name: str, root: Path = Path("."), batch: int = CHIP_BATCH) -> Sequence[Feed]:
    """The feeds as a sequence (chips stay lazy; detector feeds of the small golden photo set are held)."""
    return role(cfg, model).feeds(cfg, model, set_name, root, batch)


def held(model: str, set_name: str, feeds_: Iterator[Feed]) -> list[Feed]:
    """Feeds held as a list; none is an error (the reference detector found no face, or no photo was read)."""
    out = list(feeds_)
    if not out:
        raise KilnError(f"{model}: the {set_name} photos gave no inputs for this graph",
                        "check data.photos: the reference detector must find faces in them")
    return out


def digest(feeds_) -> str:
    """One content hash over every feed, for manifests."""
    h = []
    for f in feeds_:
        for name in sorted(f):
            h.append(name.encode() + str(f[name].shape).encode() + f[name].tobytes())
    return xxh3_128_hex(b"".join(h))


def sample_count(feeds_) -> int:
    return int(sum(next(iter(f.values())).shape[0] for f in feeds_))
