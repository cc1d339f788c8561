"""gallery@<size>: the golden embeddings enrolled (their identity labels) plus distractors drawn from a
distribution fitted to them (pipeline/matching/gallery.py): vectors.npy, labels.npy, distribution.json, manifest.
Deterministic and prefix-stable: a larger gallery extends a smaller one."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import paths, stage
from pipeline.dvcfiles import address
from pipeline.data import load_set
from pipeline.errors import KilnError
from pipeline.manifest import (atomic_dir, atomic_path, build_manifest, input_ref, manifest_path, read_verified,
                               write_json_atomic, write_manifest)
from pipeline.matching import gallery as g
from pipeline.matching.gallery import MODEL

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "gallery", "pipeline.stages.gallery",
    "golden embeddings enrolled + distractors fitted to them (deterministic, prefix-stable, hashed)",
    keys=lambda cfg: [str(s) for s in cfg.matching.gallery_sizes],
    deps=lambda cfg, key: [paths.golden(MODEL).as_posix(), paths.data_set("golden").as_posix()],
    params=lambda cfg, key: ["matching.seed", f"models.{MODEL}.verify_threshold"],
    outs=lambda cfg, key: [stage.Out(paths.gallery(int(key)).as_posix())],
    help="golden embeddings enrolled + realistic distractors at one gallery size")


def _save_npy(dest: Path, a: np.ndarray) -> None:
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, a, allow_pickle=False)


@dataclass(frozen=True)
class GalleryResult:
    directory: Path
    size: int
    enrolled: int
    content_hash: str
    distances: dict


def run(cfg: Config, size: int, root: Path = Path(".")) -> GalleryResult:
    m = cfg.matching
    m.check_size(int(size))
    root = Path(root)
    gdir, sdir = paths.golden(MODEL, root), paths.data_set("golden", root)
    read_verified(manifest_path(gdir, MODEL),
                  hint=f"rebuild the golden embeddings (dvc repro -f {address(f'golden@{MODEL}')})")
    emb = np.load(gdir / "embeddings.npy", allow_pickle=False)
    labels = load_set(sdir).labels.astype(np.int64)
    if len(emb) != len(labels):
        raise KilnError(f"{gdir}: {len(emb)} embeddings but the golden set has {len(labels)} labels",
                        f"rebuild them together (dvc repro {address(f'golden@{MODEL}')})")
    dist = g.fit_distribution(emb, labels)
    vectors, glabels, digest = g.build_gallery(emb, labels, size, dist, m.seed)
    threshold = cfg.model(MODEL).verify_threshold
    report = g.distance_report(vectors[len(emb):len(emb) + 1500], emb, threshold)
    out = paths.gallery(size, root)
    name = paths.gallery_name(size)
    with atomic_dir(out) as d:
        _save_npy(d / "vectors.npy", vectors)
        _save_npy(d / "labels.npy", glabels)
        write_json_atomic(d / "distribution.json", dist)
        inputs = [input_ref("golden_embeddings", manifest_path(gdir, MODEL), root),
                  input_ref("golden_set", manifest_path(sdir, "golden"), root)]
        write_manifest(d, build_manifest(
            kind="gallery", name=name, model=MODEL, directory=d,
            files=[d / "vectors.npy", d / "labels.npy", d / "distribution.json"], inputs=inputs,
            build={"size": size, "enrolled": int(len(emb)), "seed": m.seed, "chunk": g.CHUNK, "rank": dist["rank"],
                   "shrink": dist["shrink"], "distractor_label": g.DISTRACTOR, "dtype": "float32"},
            results={"gallery_xxh3_128": digest, "fit": dist["fit"], "distances": report},
            **STAGE.identity(cfg, str(size), root)))
    return GalleryResult(out, size, int(len(emb)), digest, report)


def main(argv: list[str] | None = None) -> int:
    import time

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        r = run(args.cfg, int(args.key))
        dp = r.distances["distractor_pairs"]
        print(f"gallery@{r.size}: {r.enrolled} golden embeddings enrolled + {r.size - r.enrolled} distractors in "
              f"{time.perf_counter() - t0:.1f} s, xxh3-128 {r.content_hash}; distractor pairs L2 median "
              f"{dp['median']:.3f}, {100 * r.distances['distractor_to_enrolled']['frac_above_threshold']:.1f}% of "
              f"distractor↔enrolled beyond the threshold")
        return 0

    return stage.main(STAGE, body, argv, key_help="gallery size from matching.gallery_sizes")


if __name__ == "__main__":
    sys.exit(main())
