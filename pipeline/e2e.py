"""End to end: photo → faces → chips → embeddings → identities, on the built engines of one target.

A system (params.yaml `systems:`) is a detector and an embedder. `dlib-mtcnn`: the MTCNN nets, the aligner graph
and the dlib embedder; a single-shot detector (`retinaface`) is one graph. This module BUILDS systems from the
checkout — engines by name, each loaded only after its files verify against its manifest (pipeline/engines.py),
the golden gallery, a FAISS index — and the runtime RUNS them: `identify_frames` is kiln_runtime.system's, fed the
Spec read back from what the system's system.json says (`described`), so system@ gates, sysbench@ loads and a
deployment host (`kiln-run`) runs the same code on the same description. An embedder with its own chip geometry
(models.<m>.preprocess) has no aligner engine: its chips come from the runtime's reference warp.
`System.eager()` builds the system from the reference graphs (PyTorch modules), for comparison.

Matching is a brute-force search over a gallery enrolled from the golden set's un-augmented chips with the system's
own embedder, in its own metric (L2, or cosine between unit vectors) and threshold, or (`use_index`, the default
embedder only) the chosen FAISS index of a gallery size, verified before it is read.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline import engines, paths, samples
from pipeline.dvcfiles import address
from pipeline.config import MTCNN, Config, Decode, ModelConfig
from pipeline.data import load_set
from pipeline.errors import KilnError
from kiln_runtime import system as run
from kiln_runtime.mtcnn import DetectorConfig
from kiln_runtime.system import BY_NAME, net_of
from kiln_runtime.system import Match, Spec  # noqa: F401 — a system's answers; how it runs (its system.json)
from pipeline.samples import NETS           # the MTCNN cascade's models

GRAPHS = (*NETS, "aligner", "embedder")
STAGES = run.STAGES
DEFAULT_SYSTEM = "dlib-mtcnn"


def described(cfg: Config, system: str, aligner: bool) -> dict:
    """How `system` runs, as its system.json says it (pipeline/gates/system.py `describe` writes these keys) and as
    kiln_runtime reads it back (`Spec.described`): the detector and its settings, the embedder, the metric and
    threshold, the chip geometry (`aligner`: an aligner engine warps)."""
    from dataclasses import asdict

    spec = cfg.system(system)
    emb = cfg.model(spec.embedder)
    if spec.detector == MTCNN:
        detector = {"kind": MTCNN, **asdict(DetectorConfig(min_face_size=cfg.data.min_face_size))}
    elif cfg.model(spec.detector).samples in BY_NAME:          # a declared head: the whole decode, and the
        detector = {"kind": cfg.model(spec.detector).samples,   # frame size it detects at (a system's choice)
                    "model": spec.detector, **cfg.model(spec.detector).decode.runtime(spec.detect_size).doc()}
    else:                                                           # RetinaFace: its own decode, thresholds only
        d = cfg.model(spec.detector).decode or Decode()
        detector = {"kind": cfg.model(spec.detector).samples, "model": spec.detector,
                    "score_threshold": d.score_threshold, "nms_threshold": d.nms_threshold}
    pre = emb.preprocess
    return {
        "detector": detector, "embedder": spec.embedder,
        "thresholds": {"metric": emb.metric, "verify_threshold": emb.verify_threshold},
        "preprocessing": {"chip_size": cfg.data.chip_size, "template": [list(p) for p in cfg.data.template],
                          "channels": "rgb", "aligner": aligner} if pre is None else {**asdict(pre), "aligner": False},
    }


def graphs(cfg: Config, system: str = DEFAULT_SYSTEM) -> tuple[str, ...]:
    """The models a system runs, in order: detector graph(s), the aligner (default chip geometry only), embedder."""
    spec = cfg.system(system)
    det = NETS if spec.detector == MTCNN else (spec.detector,)
    aligner = ("aligner",) if cfg.model(spec.embedder).preprocess is None and "aligner" in cfg.models else ()
    return (*det, *aligner, spec.embedder)


def resolve(cfg: Config, system: str = DEFAULT_SYSTEM, target: str | None = None,
            precision: str | None = None) -> dict[str, str]:
    """Model → engine name for each graph of `system`: the engine of `target` in `precision`, else that target's
    FP32 engine (`kiln identify --target/--precision`). Without `target`, the system's own choice (system@): its
    pinned engines (`systems.<name>.engines`), then its `target` / `precision` for the other graphs."""
    spec = cfg.system(system)
    pins = spec.engines if target is None else {}
    target, precision = target or spec.target, precision or spec.precision
    picks = {}
    for model in graphs(cfg, system):
        if model in pins:
            picks[model] = pins[model]
            continue
        options = [e for e in cfg.engines_of(model) if e.target == target]
        pick = next((e for e in options if e.precision == precision), None) or \
            next((e for e in options if e.precision == "fp32"), None)
        if pick is None:
            raise KilnError(f"no {target} engine for {model!r} in params.yaml `engines:`",
                            f"add one (e.g. {model}-{target}-fp32) and build it: dvc repro")
        picks[model] = pick.name
    return picks


@dataclass
class System:
    name: str
    nets: tuple[Callable, ...]          # numpy (N,3,H,W) → tuple of outputs: the 3 MTCNN nets, or the one detector
    # image (1,3,H,W), theta (N,2,3) → chips (N,3,S,S): the aligner graph; None: the reference warp onto the
    # embedder's own template
    align: Callable[[np.ndarray, np.ndarray], np.ndarray] | None
    embed: Callable[[np.ndarray], np.ndarray]          # the embedder's input (N,3,S,S) → (N,D)
    cfg: Config
    engines: dict[str, str] = field(default_factory=dict)
    gallery: tuple[np.ndarray, list[str]] | None = None
    index: tuple[object, np.ndarray, tuple[str, ...]] | None = None   # (faiss index, row labels, identity names)
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    system: str = DEFAULT_SYSTEM
    threads_used: dict[str, int | None] = field(default_factory=dict)   # model → intra-op threads (None: as built)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engines(cls, cfg: Config, target: str, precision: str, root: Path = Path("."),
                     release_dir: Path | None = None, system: str = DEFAULT_SYSTEM) -> "System":
        """Per graph, the built engine of `target` in `precision`, else its FP32 engine (which one is recorded).

        With `release_dir`, each engine is instead its MLflow `production` version, downloaded there and verified
        against its checksums (what a release engineer ships), rather than the local build.
        """
        return cls.from_picks(cfg, f"{target}-{precision}", resolve(cfg, system, target, precision), root,
                              release_dir, system)

    @classmethod
    def fastest(cls, cfg: Config, root: Path = Path("."), release_dir: Path | None = None,
                system: str = DEFAULT_SYSTEM) -> "System":
        """Per graph, the engine the leaderboard marked: the fastest on this host that passed its gate, at the batch
        the system feeds it (artifacts/reports/leaderboard.json; every engine is still verified when it loads)."""
        import json

        board = paths.reports(root) / "leaderboard.json"
        if not board.is_file():
            raise KilnError(f"{board}: no leaderboard", "build it: dvc repro leaderboard")
        winners = {r["model"]: r["engine"] for r in json.loads(board.read_text(encoding="utf-8")) if r.get("best")}
        missing = [m for m in graphs(cfg, system) if m not in winners]
        if missing:
            raise KilnError(f"{board}: no engine of {', '.join(missing)} passed its gate and was timed here",
                            "build and bench them: dvc repro")
        return cls.from_picks(cfg, "fastest-per-graph", {m: winners[m] for m in graphs(cfg, system)}, root,
                              release_dir, system)

    @classmethod
    def from_picks(cls, cfg: Config, name: str, picks: dict[str, str], root: Path = Path("."),
                   release_dir: Path | None = None, system: str = DEFAULT_SYSTEM,
                   threads: int | None = None) -> "System":
        """The system of one named engine per graph (model → engine name from params.yaml `engines:`); `threads`:
        each engine's intra-op threads, where its target can be told (else as compiled: `threads_used`)."""
        chosen, dirs = {}, {}
        for model in graphs(cfg, system):
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
        return cls.from_dirs(cfg, name, dirs, picks, system, threads, chosen)

    @classmethod
    def from_dirs(cls, cfg: Config, name: str, dirs: dict[str, Path], picks: dict[str, str],
                  system: str = DEFAULT_SYSTEM, threads: int | None = None,
                  labels: dict[str, str] | None = None) -> "System":
        """The system of engine directories: `dirs` model → the folder holding that engine's files and manifest (a
        build, a registry download, an extracted system release), `picks` model → engine name, `labels` model → how
        `engines` names it (default: the engine name). `cfg` needs only the system's slice (systems, models,
        engines, data: pipeline/release/system.py). Each engine still loads only after its files verify against its
        manifest."""
        if missing := [m for m in graphs(cfg, system) if m not in dirs or m not in picks]:
            raise KilnError(f"system {system}: no engine for {', '.join(missing)}", "release the whole system again")
        runners = {m: engines.load(cfg.engine(picks[m]).target, Path(dirs[m]), picks[m], threads)
                   for m in graphs(cfg, system)}
        chosen = dict(labels) if labels else {m: picks[m] for m in runners}
        spec = cfg.system(system)
        by_name = spec.detector != MTCNN and cfg.model(spec.detector).samples in BY_NAME
        nets = tuple(net_of(runners[m], by_name) for m in (NETS if spec.detector == MTCNN else (spec.detector,)))
        align = None
        if "aligner" in runners:
            align = lambda image, theta: runners["aligner"].run_all({"image": image, "theta": theta})[0]  # noqa: E731
        else:
            size = cfg.model(spec.embedder).preprocess.chip_size
            chosen["align"] = f"reference warp {size}×{size} (numpy; no aligner engine for this chip geometry)"
        made = cls(name, nets, align, runners[spec.embedder].run, cfg, chosen, system=system)
        made.threads_used = {m: getattr(r, "threads", None) for m, r in runners.items()}
        return made

    @classmethod
    def eager(cls, cfg: Config, root: Path = Path("."), system: str = DEFAULT_SYSTEM) -> "System":
        """A system from its reference graphs: each model's PyTorch module, or, for a model delivered as an ONNX
        file, that original file on ONNX Runtime (what its golden@ runs)."""
        runs = {m: _reference(cfg.model(m), root) for m in graphs(cfg, system)}
        spec = cfg.system(system)
        nets = tuple(runs[m] for m in (NETS if spec.detector == MTCNN else (spec.detector,)))
        align = (lambda i, t: runs["aligner"](i, t)[0]) if "aligner" in runs else None
        return cls("pytorch-eager", nets, align, lambda c: runs[spec.embedder](c)[0], cfg,
                   {m: "pytorch" if cfg.model(m).factory else "onnxruntime (original file)" for m in runs},
                   system=system)

    # ------------------------------------------------------------------ running
    @property
    def _embedder(self):
        return self.cfg.model(self.cfg.system(self.system).embedder)

    def enroll(self, root: Path = Path(".")) -> None:
        """Gallery = the golden set's un-augmented chips (the embedder's own chip geometry), embedded by this
        system's embedder."""
        mcfg = self._embedder
        gset = load_set(paths.data_set(samples.chip_set(self.cfg, mcfg.name, "golden"), root))
        plain = [i for i, s in enumerate(gset.index["samples"]) if s["augmentation"] is None]
        emb = self.embed(samples.chip_input(mcfg, gset.chips[plain]))
        self.gallery = (emb, [gset.identities[gset.labels[i]] for i in plain])

    def use_index(self, size: int, root: Path = Path(".")) -> None:
        """Match through the chosen FAISS index of the `size` gallery (golden identities + distractors)."""
        from pipeline.manifest import manifest_path, read_verified
        from pipeline.matching import index as ix
        from pipeline.matching.spec import IndexSpec

        if self.cfg.system(self.system).embedder != "embedder":
            raise KilnError(f"system {self.system}: the FAISS galleries hold the default embedder's embeddings",
                            "match this system against its own enrolled gallery (drop --gallery)")
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
        """Faces in `rgb`, best first; `exclude` drops one gallery entry (leave-one-out checks). Stage times add
        up in `self.timings`."""
        return self.identify_frames([rgb], self.timings, exclude)[0]

    @property
    def spec(self) -> Spec:
        """How this system runs, read back from what its system.json says (kiln_runtime's Spec): the runtime runs
        exactly that, here and on a deployment host."""
        if getattr(self, "_spec", None) is None:
            doc = json.loads(json.dumps(described(self.cfg, self.system, self.align is not None)))
            self._spec = Spec.described(doc, f"system {self.system}")
        return self._spec

    def identify_frames(self, frames: list[np.ndarray], timings: dict[str, float],
                        exclude: int | None = None) -> list[list[Match]]:
        """Faces per frame (kiln_runtime.system.identify_frames: detection and the aligner per frame, ONE embedder
        call and ONE gallery search for all of them); stage times (ms) add up in `timings`."""
        if self.gallery is None:
            raise RuntimeError("enroll() the gallery first")
        return run.identify_frames(self.spec, self.nets, self.align, self.embed, self.gallery, frames, timings,
                                   exclude, self._search_index if self.index is not None else None)

    def _search_index(self, emb: np.ndarray) -> list[tuple[str, float]]:
        from pipeline.matching import index as ix

        built, labels, names = self.index
        d, i = ix.search(built, emb, 1)
        return [(names[labels[j]] if labels[j] >= 0 else "distractor", float(dist))
                for j, dist in zip(i[:, 0], d[:, 0])]


def _reference(mcfg: ModelConfig, root: Path) -> Callable[..., tuple[np.ndarray, ...]]:
    """One model's reference graph as numpy inputs → tuple of numpy outputs."""
    if mcfg.factory is None:
        from pipeline import onnx_import
        from pipeline.roles import registry as roles

        proto = onnx_import.load_source(mcfg, root)
        onnx_import.check_source(proto, mcfg, mcfg.onnx.path, roles.get(mcfg.samples))
        run_feed, names = onnx_import.reference_session(proto, mcfg.layout, mcfg.dynamic.get("input", ()))
        if mcfg.samples in BY_NAME:       # a declared decode reads outputs by name
            return lambda x: dict(zip(names, run_feed({"x0": x})))
        return lambda *xs: tuple(run_feed({f"x{i}": x for i, x in enumerate(xs)}))   # bound by position
    import torch

    from pipeline import models

    mod = models.build(mcfg, root)

    def run(*xs):
        with torch.inference_mode():
            out = mod(*(torch.from_numpy(x) for x in xs))
        return tuple(t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,)))
    return run
