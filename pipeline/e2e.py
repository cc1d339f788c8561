"""End to end: photo → faces → chips → embeddings → identities, on the built engines of one target.

The four graphs (detector nets, aligner, embedder) run as compiled engines through the target protocol, each
loaded only after its files verify against its manifest (pipeline/engines.py); only the glue between them
(pyramid, NMS, box maths, the landmark→template fit) is numpy. `System.eager()` builds the same system from the
PyTorch reference modules, for comparison.

Matching is a brute-force L2 search over a gallery enrolled from the golden set's un-augmented chips with the
system's own embedder, or (`use_index`) the chosen FAISS index of a gallery size, verified before it is read.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline import engines, paths
from pipeline.stage import address
from pipeline.config import Config
from pipeline.data import load_set, to_nchw
from pipeline.errors import KilnError
from pipeline.models import mtcnn
from pipeline.models.align import chip_transform

NETS = ("pnet", "rnet", "onet")
GRAPHS = (*NETS, "aligner", "embedder")
STAGES = (*NETS, "detect_glue", "align", "embed", "match")


@dataclass(frozen=True)
class Match:
    box: tuple[float, float, float, float]
    score: float
    identity: str          # "unknown" when the nearest gallery face is farther than the threshold
    nearest: str
    distance: float


@dataclass
class System:
    name: str
    nets: tuple[Callable, Callable, Callable]          # numpy (N,3,H,W) → tuple of outputs
    align: Callable[[np.ndarray, np.ndarray], np.ndarray]  # image (1,3,H,W), theta (N,2,3) → chips (N,3,S,S)
    embed: Callable[[np.ndarray], np.ndarray]          # chips (N,3,S,S) 0..255 → (N,D)
    cfg: Config
    engines: dict[str, str] = field(default_factory=dict)
    gallery: tuple[np.ndarray, list[str]] | None = None
    index: tuple[object, np.ndarray, tuple[str, ...]] | None = None   # (faiss index, row labels, identity names)
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engines(cls, cfg: Config, target: str, precision: str, root: Path = Path("."),
                     release_dir: Path | None = None) -> "System":
        """Per graph, the built engine of `target` in `precision`, else its FP32 engine (which one is recorded).

        With `release_dir`, each engine is instead its MLflow `production` version, downloaded there and verified
        against its checksums (what a release engineer ships), rather than the local build.
        """
        picks = {}
        for model in GRAPHS:
            options = [e for e in cfg.engines_of(model) if e.target == target]
            pick = next((e for e in options if e.precision == precision), None) or \
                next((e for e in options if e.precision == "fp32"), None)
            if pick is None:
                raise KilnError(f"no {target} engine for {model!r} in params.yaml `engines:`",
                                f"add one (e.g. {model}-{target}-fp32) and build it: dvc repro")
            picks[model] = pick.name
        return cls.from_picks(cfg, f"{target}-{precision}", picks, root, release_dir)

    @classmethod
    def fastest(cls, cfg: Config, root: Path = Path("."), release_dir: Path | None = None) -> "System":
        """Per graph, the engine the leaderboard marked: the fastest at batch 1 on this host that passed its gate
        (artifacts/reports/leaderboard.json; every engine is still verified when it loads)."""
        import json

        board = paths.reports(root) / "leaderboard.json"
        if not board.is_file():
            raise KilnError(f"{board}: no leaderboard", "build it: dvc repro leaderboard")
        winners = {r["model"]: r["engine"] for r in json.loads(board.read_text()) if r.get("best")}
        missing = [m for m in GRAPHS if m not in winners]
        if missing:
            raise KilnError(f"{board}: no engine of {', '.join(missing)} passed its gate and was timed here",
                            "build and bench them: dvc repro")
        return cls.from_picks(cfg, "fastest-per-graph", {m: winners[m] for m in GRAPHS}, root, release_dir)

    @classmethod
    def from_picks(cls, cfg: Config, name: str, picks: dict[str, str], root: Path = Path("."),
                   release_dir: Path | None = None) -> "System":
        """The system of one named engine per graph (model → engine name from params.yaml `engines:`)."""
        chosen, dirs = {}, {}
        for model in GRAPHS:
            pick = cfg.engine(picks[model])
            if pick.model != model:
                raise KilnError(f"engine {pick.name} is a {pick.model} engine, not a {model} one",
                                f"pick one of {', '.join(e.name for e in cfg.engines_of(model))}")
            if release_dir is not None:
                from pipeline.registry import fetch_release

                dirs[model], version = fetch_release(cfg, pick.name, release_dir / pick.name, root)
                chosen[model] = f"{pick.name}@production(v{version})"
                continue
            if not paths.engine(pick.name, root).is_dir():
                raise KilnError(f"engine {pick.name} is not built",
                                f"build it first: dvc repro {address(f'compile@{pick.name}')}")
            dirs[model], chosen[model] = paths.engine(pick.name, root), pick.name
        runners = {m: engines.load(cfg.engine(picks[m]).target, d, picks[m]) for m, d in dirs.items()}
        nets = tuple((lambda r: (lambda x: tuple(r.run_all({"input": x}))))(runners[m]) for m in NETS)
        return cls(name, nets, lambda image, theta: runners["aligner"].run_all({"image": image, "theta": theta})[0],
                   runners["embedder"].run, cfg, chosen)

    @classmethod
    def eager(cls, cfg: Config, root: Path = Path(".")) -> "System":
        import torch

        from pipeline import models

        mods = {m: models.build(cfg.model(m), root) for m in GRAPHS}

        def call(mod):
            def run(*xs):
                with torch.inference_mode():
                    return mod(*(torch.from_numpy(x) for x in xs))
            return run

        nets = tuple((lambda f: (lambda x: tuple(t.numpy() for t in f(x))))(call(mods[m])) for m in NETS)
        align, embed = call(mods["aligner"]), call(mods["embedder"])
        return cls("pytorch-eager", nets, lambda i, t: align(i, t).numpy(), lambda c: embed(c).numpy(), cfg,
                   {m: "pytorch" for m in mods})

    # ------------------------------------------------------------------ running
    def _timed(self, stage: str, fn: Callable, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.timings[stage] += (time.perf_counter() - t0) * 1e3
        return out

    def enroll(self, root: Path = Path(".")) -> None:
        """Gallery = the golden set's un-augmented chips, embedded by this system's embedder."""
        gset = load_set(paths.data_set("golden", root))
        plain = [i for i, s in enumerate(gset.index["samples"]) if s["augmentation"] is None]
        emb = self.embed(to_nchw(gset.chips[plain]))
        self.gallery = (emb, [gset.identities[gset.labels[i]] for i in plain])

    def use_index(self, size: int, root: Path = Path(".")) -> None:
        """Match through the chosen FAISS index of the `size` gallery (golden identities + distractors)."""
        from pipeline.manifest import manifest_path, read_verified
        from pipeline.matching import index as ix
        from pipeline.matching.spec import IndexSpec

        name = paths.gallery_name(size)
        d = paths.index(size, root)
        if not manifest_path(d, name).is_file():
            raise KilnError(f"{d}: no matching index for a {size} gallery",
                            f"build it: dvc repro {address(f'match@{size}')}")
        spec = read_verified(manifest_path(d, name), fast=True)["build"]["spec"]
        read_verified(manifest_path(paths.gallery(size, root), name), fast=True)
        built = ix.deserialize((d / "index.faiss").read_bytes())
        ix.set_search_params(built, IndexSpec.parse(spec))
        labels = np.load(paths.gallery(size, root) / "labels.npy", allow_pickle=False)
        self.index = (built, labels, load_set(paths.data_set("golden", root)).identities)
        self.engines["matching"] = f"{name} ({spec})"

    def identify(self, rgb: np.ndarray, exclude: int | None = None) -> list[Match]:
        """Faces in `rgb`, best first; `exclude` drops one gallery entry (leave-one-out checks)."""
        if self.gallery is None:
            raise RuntimeError("enroll() the gallery first")
        data = self.cfg.data
        det_cfg = mtcnn.DetectorConfig(min_face_size=data.min_face_size)
        nets = [(lambda s, f: (lambda x: self._timed(s, f, x)))(s, f) for s, f in zip(NETS, self.nets)]
        in_nets = sum(self.timings[s] for s in NETS)
        t0 = time.perf_counter()
        faces = mtcnn.detect(rgb, *nets, det_cfg)
        # pyramid, crops, NMS and box maths: the detector's wall time minus what its nets took
        self.timings["detect_glue"] += (time.perf_counter() - t0) * 1e3 - (sum(self.timings[s] for s in NETS) - in_nets)
        if not faces:
            return []
        template = np.asarray(data.template)
        theta = np.stack([chip_transform(f.landmarks, template) for f in faces])
        image = np.ascontiguousarray(rgb.transpose(2, 0, 1)[None], np.float32)
        chips = self._timed("align", self.align, image, theta)
        emb = self._timed("embed", self.embed, np.ascontiguousarray(chips, np.float32))
        if self.index is not None and exclude is None:
            found = self._timed("match", self._search_index, emb)
        else:
            gal, names = self.gallery
            keep = np.arange(len(names)) != (-1 if exclude is None else exclude)

            def match(e):
                d = np.linalg.norm(gal[keep] - e, axis=1)
                j = int(np.argmin(d))
                return [n for n, k in zip(names, keep) if k][j], float(d[j])

            found = self._timed("match", lambda: [match(e) for e in emb])
        thr = self.cfg.model("embedder").verify_threshold
        return [Match(f.box, f.score, n if d < thr else "unknown", n, d) for f, (n, d) in zip(faces, found)]

    def _search_index(self, emb: np.ndarray) -> list[tuple[str, float]]:
        from pipeline.matching import index as ix

        built, labels, names = self.index
        d, i = ix.search(built, emb, 1)
        return [(names[labels[j]] if labels[j] >= 0 else "distractor", float(dist))
                for j, dist in zip(i[:, 0], d[:, 0])]
