"""Image sets (golden, calibration): aligned face chips with identity labels, built deterministically.

Photos come from `<root>/<identity>/<image>`. Each photo's five landmarks come from the caller (`Landmarker`):
the pipeline passes the system's own MTCNN detector. Chip k = 0 of a photo is the
plain aligned face; chips k ≥ 1 are jittered (rotation, zoom/crop, shift, horizontal flip, brightness) from a
generator seeded by (set seed, photo index, k), so a set is a pure function of photos + landmarks + parameters.

A set is a directory: `chips.npy` (N, S, S, 3) uint8 RGB and `index.json` (identities, labels, per-chip source
and augmentation, per-photo landmarks, content hash).

An identity's name is its folder's, and it is printed (`kiln identify`) and shipped (a system release's labels), so
it must be an identity slug (pipeline/paths.py `is_identity`): a folder named otherwise is refused at enrolment, a
set holding one when it is read.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

# photos decode as a deployment host decodes them
from kiln_runtime.images import MAX_PIXELS, MAX_SIDE, load_rgb  # noqa: F401
from pipeline import paths
from pipeline.errors import KilnError
from pipeline.manifest import canonical_json, write_bytes_atomic, write_json_atomic, xxh3_128_hex
from pipeline.dvcfiles import address

if TYPE_CHECKING:
    from pipeline.config import Augment, DataConfig, SetSpec

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
Landmarker = Callable[[np.ndarray, Path], np.ndarray]   # (rgb HWC uint8, path for messages) → (5, 2) landmarks


@dataclass(frozen=True)
class Photo:
    identity: str
    path: Path


@dataclass(frozen=True)
class ImageSet:
    chips: np.ndarray            # (N, S, S, 3) uint8
    labels: np.ndarray           # (N,) int64 index into identities
    identities: tuple[str, ...]
    index: dict                  # everything in index.json

    @property
    def content_hash(self) -> str:
        return self.index["content_xxh3_128"]


def list_photos(root: Path) -> list[Photo]:
    root = Path(root)
    if not root.is_dir():
        raise KilnError(f"{root}: photo folder not found",
                        "set data.photos in params.yaml to <root>/<identity>/<image>")
    photos = [Photo(d.name, f) for d in sorted(root.iterdir()) if d.is_dir()
              for f in sorted(d.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
    odd = next((p.path for p in photos if not p.path.is_file()), None)
    if odd is not None:   # a FIFO would hang the decode, a device never end it
        raise KilnError(f"{odd}: not a regular file (a folder, FIFO, device or broken link named like an image)",
                        "remove it from the photo folder")
    if not photos:
        raise KilnError(f"{root}: no images found in <root>/<identity>/<image> layout",
                        f"put photos ({', '.join(IMAGE_SUFFIXES)}) in one sub-folder per identity")
    for name in sorted({p.identity for p in photos}):
        paths.identity(name, f"{root}: photo folder")
    return photos


def augmentation(spec: Augment, size: int, rng: np.random.Generator) -> dict:
    return {"rotation_deg": float(rng.uniform(-spec.max_rotation_deg, spec.max_rotation_deg)),
            "scale": float(rng.uniform(-spec.max_scale, spec.max_scale)),
            "shift_x": float(rng.uniform(-spec.max_shift, spec.max_shift) * size),
            "shift_y": float(rng.uniform(-spec.max_shift, spec.max_shift) * size),
            "flip": bool(spec.flip and rng.random() < 0.5),
            "brightness": float(rng.uniform(*spec.brightness))}


def build_set(photos: list[Photo], landmarker: Landmarker, cfg: DataConfig, spec: SetSpec) -> ImageSet:
    from pipeline.models.align import Aligner, align, chip_transform, jitter     # torch: only a set's build needs it

    size = cfg.chip_size
    template = np.asarray(cfg.template, np.float64)
    aligner = Aligner(size)
    identities = tuple(sorted({p.identity for p in photos}))
    chips, labels, samples, photo_index = [], [], [], []
    for i, photo in enumerate(photos):
        rgb = load_rgb(photo.path)
        marks = np.asarray(landmarker(rgb, photo.path), np.float64)
        rel = photo.path.name if photo.path.parent.name != photo.identity else f"{photo.identity}/{photo.path.name}"
        photo_index.append({"photo": rel, "landmarks": np.round(marks, 3).tolist()})
        augs = [None] + [augmentation(cfg.augment, size, np.random.default_rng([spec.seed, i, k]))
                         for k in range(1, spec.per_photo)]
        thetas = np.stack([chip_transform(marks, template, None if a is None else
                                          jitter(size, a["rotation_deg"], a["scale"], a["shift_x"], a["shift_y"]))
                           for a in augs])
        warped = align(rgb, thetas, size, aligner)
        for a, chip in zip(augs, warped):
            if a is not None:
                chip = chip * a["brightness"]
                if a["flip"]:
                    chip = chip[:, ::-1]
            chips.append(np.clip(np.rint(chip), 0, 255).astype(np.uint8))
            labels.append(identities.index(photo.identity))
            samples.append({"photo": rel, "identity": photo.identity, "augmentation": a})
    arr = np.ascontiguousarray(np.stack(chips))
    lab = np.asarray(labels, np.int64)
    index = {"set": spec.name, "chip_size": size, "identities": list(identities), "labels": lab.tolist(),
             "samples": samples, "photos": photo_index,
             "content_xxh3_128": xxh3_128_hex(arr.tobytes() + canonical_json([list(identities), lab.tolist()]))}
    return ImageSet(arr, lab, identities, index)


def save_set(image_set: ImageSet, out: Path) -> list[Path]:
    """Write chips.npy + index.json atomically (each file renamed into place when complete)."""
    out = Path(out)
    chips_path, index_path = out / "chips.npy", out / "index.json"
    buf = io.BytesIO()
    np.save(buf, image_set.chips, allow_pickle=False)
    write_bytes_atomic(chips_path, buf.getvalue())
    write_json_atomic(index_path, image_set.index)
    return [chips_path, index_path]


def load_set(directory: Path) -> ImageSet:
    directory = Path(directory)
    try:
        index = json.loads((directory / "index.json").read_text(encoding="utf-8"))
        chips = np.load(directory / "chips.npy", allow_pickle=False)
    except FileNotFoundError as e:
        raise KilnError(f"{directory}: image set incomplete ({Path(e.filename).name} missing)",
                        f"rebuild it: dvc repro {address('dataset')}") from None
    for name in index["identities"]:
        paths.identity(name, f"{directory}/index.json")
    labels = np.asarray(index["labels"], np.int64)
    digest = xxh3_128_hex(chips.tobytes() + canonical_json([index["identities"], labels.tolist()]))
    if digest != index["content_xxh3_128"]:
        raise KilnError(f"{directory}: chips do not match the content hash in index.json",
                        f"the set was modified; rebuild it: dvc repro -f {address('dataset')}")
    return ImageSet(chips, labels, tuple(index["identities"]), index)


def to_nchw(chips: np.ndarray) -> np.ndarray:
    """(N, S, S, 3) uint8 → (N, 3, S, S) float32 in 0..255, the embedder's input."""
    return np.ascontiguousarray(chips.transpose(0, 3, 1, 2), dtype=np.float32)
