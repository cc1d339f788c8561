"""Model inputs ("feeds") for export parity, golden references, calibration and validation, per kind of graph.

Each graph of the face system sees different inputs, so each model names its `samples` kind in params.yaml:

* `chips`   the embedder: batches of aligned 150×150 chips from the golden / calibration image set;
* `pnet`, `rnet`, `onet`: exactly what that MTCNN net sees when the reference (PyTorch) detector runs on the
  set's photos — every pyramid level for P-Net, the candidate crops for R- and O-Net — captured by wrapping the
  reference nets. The calibration set adds deterministic brightness and mirror variants of each photo;
* `aligner`: one feed per photo: the image and the chip transforms of its detected faces.

Feeds are a pure function of the photos, weights and parameters, so stages regenerate them instead of storing
them; manifests record their digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline import paths
from pipeline.config import Config
from pipeline.data import list_photos, load_rgb, load_set, to_nchw
from pipeline.errors import KilnError
from pipeline.manifest import xxh3_128_hex

Feed = dict[str, np.ndarray]
CHIP_BATCH = 8
NETS = ("pnet", "rnet", "onet")


def _photo_variants(cfg: Config, set_name: str, root: Path) -> list[np.ndarray]:
    images = [load_rgb(p.path) for p in list_photos(root / cfg.data.photos)]
    if set_name == "golden":
        return images
    out = []
    for img in images:  # calibration: the photo, darker, brighter, mirrored
        f = img.astype(np.float32)
        out += [img, np.clip(f * 0.7, 0, 255).astype(np.uint8), np.clip(f * 1.25, 0, 255).astype(np.uint8),
                np.ascontiguousarray(img[:, ::-1])]
    return out


def detector_feeds(cfg: Config, set_name: str, root: Path) -> dict[str, list[Feed]]:
    """Run the reference detector over the set's photos, recording every input each net receives."""
    from pipeline.models import mtcnn

    nets = mtcnn.load_nets(*paths.mtcnn_weights(root / cfg.assets_dir))
    captured: dict[str, list[Feed]] = {n: [] for n in NETS}

    def recorder(name, net):
        run = mtcnn.torch_runner(net)

        def record(x: np.ndarray):
            captured[name].append({"input": np.ascontiguousarray(x, np.float32)})
            return run(x)
        return record

    runners = [recorder(n, net) for n, net in zip(NETS, nets)]
    det_cfg = mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)
    for rgb in _photo_variants(cfg, set_name, root):
        mtcnn.detect(rgb, *runners, det_cfg)
    return captured


def aligner_feeds(cfg: Config, set_name: str, root: Path) -> list[Feed]:
    from pipeline.models import mtcnn
    from pipeline.models.align import chip_transform

    nets = mtcnn.load_nets(*paths.mtcnn_weights(root / cfg.assets_dir))
    det_cfg = mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)
    template = np.asarray(cfg.data.template)
    feeds = []
    for rgb in _photo_variants(cfg, set_name, root):
        faces = mtcnn.detect(rgb, *nets, det_cfg)
        if faces:
            theta = np.stack([chip_transform(f.landmarks, template) for f in faces])
            feeds.append({"image": np.ascontiguousarray(rgb.transpose(2, 0, 1)[None], np.float32), "theta": theta})
    return feeds


class ChipFeeds(Sequence):
    """Chip batches converted to float only when used, so a large set never sits in memory as float32."""

    def __init__(self, chips: np.ndarray, batch: int) -> None:
        self.chips, self.batch = chips, batch

    def __len__(self) -> int:
        return -(-len(self.chips) // self.batch)

    def __getitem__(self, i: int) -> Feed:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return {"input": to_nchw(self.chips[i * self.batch:(i + 1) * self.batch])}


def feeds(cfg: Config, model_name: str, set_name: str, root: Path = Path("."),
          batch: int = CHIP_BATCH) -> Sequence[Feed]:
    kind = cfg.model(model_name).samples
    if kind == "chips":
        return ChipFeeds(load_set(paths.data_set(set_name, root)).chips, batch)
    if kind in NETS:
        out = detector_feeds(cfg, set_name, root)[kind]
    elif kind == "aligner":
        out = aligner_feeds(cfg, set_name, root)
    else:  # config.py validates the kind; this guards a new kind added there but not here
        raise KilnError(f"models.{model_name}.samples: no feed builder for {kind!r}", "see pipeline/samples.py")
    if not out:
        raise KilnError(f"{model_name}: the {set_name} photos gave no inputs for this graph",
                        "check data.photos: the reference detector must find faces in them")
    return out


def digest(feeds_: list[Feed]) -> str:
    """One content hash over every feed, for manifests."""
    parts = []
    for f in feeds_:
        for name in sorted(f):
            parts.append(name.encode() + str(f[name].shape).encode() + f[name].tobytes())
    return xxh3_128_hex(b"".join(parts))


def sample_count(feeds_: list[Feed]) -> int:
    return int(sum(next(iter(f.values())).shape[0] for f in feeds_))

