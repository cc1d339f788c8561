"""Model inputs ("feeds") for export parity, golden references, calibration and validation, per kind of graph.

Each graph of the face system sees different inputs, so each model names its `samples` kind in params.yaml:

* `chips`   an embedder: batches of aligned chips from the golden / calibration image set (artifacts/data/<set>,
  or artifacts/data/<set>-<model> for a model with its own `preprocess` geometry), made into the model's input by
  `chip_input` (channel order, mean, std);
* `pnet`, `rnet`, `onet`: exactly what that MTCNN net sees when the reference (PyTorch) detector runs on the
  photos — every pyramid level for P-Net, the candidate crops for R- and O-Net — captured by wrapping the
  reference nets. The calibration set adds deterministic darker, brighter and mirrored variants of each photo;
* `aligner`: one feed per photo: the image and the chip transforms of its detected faces;
* `retinaface`: a single-shot detector: one feed per photo (the calibration set's variants too), preprocessed as
  the family wants (pipeline/models/retinaface.py) — no reference detector involved.

Feeds are a pure function of the photos, the reference detector's weights and parameters, so stages regenerate
them instead of storing them; `deps()` and `params()` say exactly what they read (dvc.yaml tracks those), and
manifests record their digest. `stream()` yields them without holding a set in memory: chips are converted batch by
batch; detector feeds are captured photo by photo (memory: one photo's inputs) and R-/O-Net crops re-batched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from pipeline import paths
from pipeline.data import list_photos, load_rgb, load_set, to_nchw
from pipeline.errors import KilnError
from pipeline.manifest import file_input, input_ref, manifest_path, xxh3_128_hex

Feed = dict[str, np.ndarray]
CHIP_BATCH = 8
NETS = ("pnet", "rnet", "onet")


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
        if m.samples == "chips" and m.preprocess is not None:
            out.update({chip_set(cfg, name, s): (s, name) for s in SETS})
    return out


def chip_input(mcfg, chips: np.ndarray) -> np.ndarray:
    """(N, S, S, 3) uint8 RGB chips → the model's (N, 3, S, S) float32 input: channel order, then (x - mean) / std."""
    x = to_nchw(chips)
    pre = mcfg.preprocess
    if pre is None:
        return x
    if pre.channels == "bgr":
        x = x[:, ::-1]
    mean = np.asarray(pre.mean, np.float32)[None, :, None, None]
    std = np.asarray(pre.std, np.float32)[None, :, None, None]
    if (mean != 0).any() or (std != 1).any():
        x = (x - mean) / std
    return np.ascontiguousarray(x, np.float32)


# ---------------------------------------------------------------------------------------------- what feeds read
def reference_weights(cfg) -> list[Path]:
    """The reference detector's weights: models.pnet/rnet/onet.weights (relative to the project root)."""
    missing = [n for n in NETS if n not in cfg.models or cfg.models[n].weights is None]
    if missing:
        raise KilnError(f"{cfg.source}: models: the reference detector needs {', '.join(missing)} with weights",
                        "keep the MTCNN nets in params.yaml models: (they landmark the image sets)")
    return [Path(cfg.models[n].weights) for n in NETS]


def deps(cfg, model: str | None, set_name: str) -> list[str]:
    """Paths the feeds of `model` on `set_name` read (None: the reference detector on the photos)."""
    if model is not None and cfg.model(model).samples == "chips":
        return [paths.data_set(chip_set(cfg, model, set_name)).as_posix()]
    if model is not None and cfg.model(model).samples == "retinaface":
        return [Path(cfg.data.photos).as_posix()]
    return [Path(cfg.data.photos).as_posix(), *(w.as_posix() for w in reference_weights(cfg))]


def params(cfg, model: str | None) -> list[str]:
    """params.yaml keys the feeds depend on (chips: none here — the image set's own stage tracks them)."""
    if model is not None and cfg.model(model).samples == "chips":
        return []
    if model is not None and cfg.model(model).samples == "retinaface":
        return ["data.photos"]
    keys = ["data.photos", "data.min_face_size"]
    return keys + ["data.template"] if model is not None and cfg.model(model).samples == "aligner" else keys


def inputs(cfg, model: str, set_name: str, root: Path) -> list[dict]:
    """Manifest input references for the feeds: the image set's manifest, or the photos and detector weights."""
    if cfg.model(model).samples == "chips":
        key = chip_set(cfg, model, set_name)
        return [input_ref(f"{set_name}_set", manifest_path(paths.data_set(key, root), key), root)]
    photos = [file_input("photo", p.path, root) for p in list_photos(root / cfg.data.photos)]
    if cfg.model(model).samples == "retinaface":
        return photos
    return photos + [file_input("detector_weights", root / w, root) for w in reference_weights(cfg)]


# ---------------------------------------------------------------------------------------------- feeds
def _photo_variants(cfg, set_name: str, root: Path) -> Iterator[np.ndarray]:
    for p in list_photos(root / cfg.data.photos):
        img = load_rgb(p.path)
        yield img
        if set_name == "calibration":   # the photo, darker, brighter, mirrored
            f = img.astype(np.float32)
            yield np.clip(f * 0.7, 0, 255).astype(np.uint8)
            yield np.clip(f * 1.25, 0, 255).astype(np.uint8)
            yield np.ascontiguousarray(img[:, ::-1])


def _reference(cfg, root: Path):
    from pipeline.models import mtcnn

    return mtcnn.load_nets(*(root / w for w in reference_weights(cfg))), \
        mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)


def _detector_feeds(cfg, kind: str, set_name: str, root: Path) -> Iterator[list[Feed]]:
    """Per photo variant: every input net `kind` receives while the reference detector runs on it."""
    from pipeline.models import mtcnn

    nets, det_cfg = _reference(cfg, root)
    k = NETS.index(kind)
    for rgb in _photo_variants(cfg, set_name, root):
        captured: list[Feed] = []
        run = mtcnn.torch_runner(nets[k])

        def record(x: np.ndarray, run=run, captured=captured):
            captured.append({"input": np.ascontiguousarray(x, np.float32)})
            return run(x)

        runners = list(nets)
        runners[k] = record
        mtcnn.detect(rgb, *runners, det_cfg)
        yield captured


def _aligner_feeds(cfg, set_name: str, root: Path) -> Iterator[list[Feed]]:
    from pipeline.models import mtcnn
    from pipeline.models.align import chip_transform

    nets, det_cfg = _reference(cfg, root)
    template = np.asarray(cfg.data.template)
    for rgb in _photo_variants(cfg, set_name, root):
        faces = mtcnn.detect(rgb, *nets, det_cfg)
        if faces:
            theta = np.stack([chip_transform(f.landmarks, template) for f in faces])
            yield [{"image": np.ascontiguousarray(rgb.transpose(2, 0, 1)[None], np.float32), "theta": theta}]
        else:
            yield []


def _rebatch(per_photo: Iterator[list[Feed]], batch: int) -> Iterator[Feed]:
    """R-/O-Net crops (same shape) joined or split into feeds of `batch` samples, photo by photo."""
    for feeds in per_photo:
        if not feeds:
            continue
        x = np.concatenate([f["input"] for f in feeds])
        for i in range(0, len(x), batch):
            yield {"input": x[i:i + batch]}


class ChipFeeds(Sequence):
    """Chip batches converted to float only when used, so a large set never sits in memory as float32."""

    def __init__(self, chips: np.ndarray, batch: int, mcfg=None) -> None:
        self.chips, self.batch, self.mcfg = chips, batch, mcfg

    def __len__(self) -> int:
        return -(-len(self.chips) // self.batch)

    def __getitem__(self, i: int) -> Feed:
        if not 0 <= i < len(self):
            raise IndexError(i)
        chips = self.chips[i * self.batch:(i + 1) * self.batch]
        return {"input": to_nchw(chips) if self.mcfg is None else chip_input(self.mcfg, chips)}


class Stream:
    """Re-iterable feeds of one model on one set, `batch` samples at a time where the graph allows it (P-Net
    levels differ in size and the aligner takes one photo per feed, so those stay one feed per level / photo)."""

    def __init__(self, cfg, model: str, set_name: str, root: Path, batch: int) -> None:
        self.cfg, self.kind, self.set_name, self.root, self.batch = cfg, cfg.model(model).samples, set_name, root, batch
        self.model = model

    def __iter__(self) -> Iterator[Feed]:
        if self.kind == "chips":
            key = chip_set(self.cfg, self.model, self.set_name)
            yield from ChipFeeds(load_set(paths.data_set(key, self.root)).chips, self.batch, self.cfg.model(self.model))
        elif self.kind == "pnet":
            for feeds in _detector_feeds(self.cfg, "pnet", self.set_name, self.root):
                yield from feeds
        elif self.kind in NETS:
            yield from _rebatch(_detector_feeds(self.cfg, self.kind, self.set_name, self.root), self.batch)
        elif self.kind == "aligner":
            for feeds in _aligner_feeds(self.cfg, self.set_name, self.root):
                yield from feeds
        elif self.kind == "retinaface":
            from pipeline.models import retinaface

            for rgb in _photo_variants(self.cfg, self.set_name, self.root):
                yield {"input": retinaface.preprocess(rgb)}
        else:  # config.py validates the kind; this guards a new kind added there but not here
            raise KilnError(f"models.{self.model}.samples: no feed builder for {self.kind!r}",
                            "see pipeline/samples.py")


def stream(cfg, model: str, set_name: str, root: Path = Path("."), batch: int = CHIP_BATCH) -> Stream:
    return Stream(cfg, model, set_name, root, batch)


def feeds(cfg, model: str, set_name: str, root: Path = Path("."), batch: int = CHIP_BATCH) -> Sequence[Feed]:
    """The feeds as a sequence (chips stay lazy; detector feeds of the small golden photo set are held)."""
    kind = cfg.model(model).samples
    if kind == "chips":
        key = chip_set(cfg, model, set_name)
        return ChipFeeds(load_set(paths.data_set(key, root)).chips, batch, cfg.model(model))
    out = list(stream(cfg, model, set_name, root, batch))
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
