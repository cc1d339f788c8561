"""Running a face system: photo → faces → chips → embeddings → identities. The one implementation, numpy glue
around engines: system@ gates it, sysbench@ loads it, `kiln identify` and a deployment host (`kiln-run`) run it.

A system is what its system.json describes (`Spec`): the detector (the MTCNN cascade of three nets, or a single-shot
graph decoded here), the chip geometry (the aligner engine warps onto data.template; an embedder with its own
geometry gets the reference warp and its own input normalisation), the embedder, the metric and threshold it decides
with. The graphs are callables (engines' runners, or the build's reference modules); nothing here knows a compiler.

`identify_frames` batches where it pays: detection and the aligner run per frame (each frame its own pyramid; the
aligner graph warps one image), then ONE embedder call for every chip of every frame and ONE gallery search for all
of them. Stage times (ms) add up in the caller's `timings`: per net, `detect_glue` (pyramid / anchors, crops, NMS
and box maths: the detector's wall time minus its nets'), `align`, `embed`, `match`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import numpy as np

from kiln_runtime import align, mtcnn, retinaface, singleshot
from kiln_runtime.errors import GateFailed

MTCNN = "mtcnn"
NETS = ("pnet", "rnet", "onet")                                  # the MTCNN cascade's models, in order
SINGLE_SHOT = {"retinaface": (retinaface.DecodeConfig, retinaface.detect),     # kind → (settings, detect)
               "singleshot": (singleshot.Decode, singleshot.detect)}
BY_NAME = ("singleshot",)           # detectors that read their graph's outputs by name (a runner's output_names)
STAGES = (*NETS, "detect_glue", "align", "embed", "match")


@dataclass(frozen=True)
class Match:
    box: tuple[float, float, float, float]
    score: float
    identity: str          # "unknown" when the nearest gallery face is beyond the threshold
    nearest: str
    distance: float        # L2 distance (metric l2) or cosine similarity (metric cosine) to the nearest
    metric: str = "l2"
    embedding: np.ndarray | None = field(default=None, repr=False, compare=False)   # the embedder's raw output
    landmarks: np.ndarray | None = field(default=None, repr=False, compare=False)   # (5, 2) x, y in the photo


@dataclass(frozen=True)
class Preprocess:
    """An embedder's own chip input: (chip[channels] - mean) / std (channels rgb or bgr)."""
    channels: str = "rgb"
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)


@dataclass(frozen=True)
class Spec:
    """How a system runs, as its system.json says (the build's pipeline/gates/system.py `describe` writes it)."""
    detector: str                                  # "mtcnn" or a single-shot kind (SINGLE_SHOT)
    settings: Any                                  # mtcnn.DetectorConfig or the kind's decode settings
    detector_model: str | None                     # a single-shot detector's model (its engine's key)
    embedder: str                                  # the embedder's model (its engine's key)
    metric: str                                    # "l2" or "cosine"
    threshold: float                               # same person when L2 < t, or cosine similarity ≥ t
    chip_size: int
    template: np.ndarray                           # (5, 2) chip pixels the landmarks are fitted onto
    aligner: bool                                  # an aligner engine warps (else `align.warp` + `preprocess`)
    preprocess: Preprocess | None = None           # None: RGB 0..255

    @property
    def graphs(self) -> tuple[str, ...]:
        """The models it runs, in order: detector graph(s), the aligner (if an engine), the embedder."""
        det = NETS if self.detector == MTCNN else (self.detector_model,)
        return (*det, *(("aligner",) if self.aligner else ()), self.embedder)

    @property
    def detector_graphs(self) -> tuple[str, ...]:
        return NETS if self.detector == MTCNN else (self.detector_model,)

    @classmethod
    def described(cls, doc: dict, source: str = "system.json") -> "Spec":
        """The Spec of a system.json; GateFailed (one line) if it asks for anything this runtime does not run
        exactly as described — an unknown detector kind or setting, metric or preprocessing key."""
        def fail(why: str) -> GateFailed:
            return GateFailed(f"{source}: {why}", "run it with the kiln-runtime that matches the kiln that gated it, "
                              "or gate and release the system again")
        try:
            det, thr, pre = dict(doc["detector"]), dict(doc["thresholds"]), dict(doc["preprocessing"])
            kind = det.pop("kind")
            model = det.pop("model", None)
            if kind == MTCNN:
                settings_type = mtcnn.DetectorConfig
            elif kind in SINGLE_SHOT:
                settings_type = SINGLE_SHOT[kind][0]
                if not isinstance(model, str):
                    raise fail(f"a {kind} detector names no model")
            else:
                raise fail(f"detector kind {str(kind)[:40]!r} is not one this runtime runs ({MTCNN}, "
                           f"{', '.join(SINGLE_SHOT)})")
            known = {f.name for f in fields(settings_type)}
            if unknown := sorted(set(det) - known):
                raise fail(f"detector setting {str(unknown[0])[:40]!r} is not one this runtime's {kind} has")
            if hasattr(settings_type, "from_doc"):
                try:
                    settings = settings_type.from_doc(det)
                except singleshot.DecodeError as e:
                    raise fail(f"its {kind} decode: {e}") from None
            else:
                settings = settings_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in det.items()})
            metric, threshold = thr.pop("metric"), float(thr.pop("verify_threshold"))
            if metric not in ("l2", "cosine") or thr:
                extra = f", unknown {sorted(thr)[0]!r}" if thr else ""
                raise fail(f"thresholds: metric {str(metric)[:20]!r}{extra}")
            aligner = bool(pre.pop("aligner"))
            chip_size, template = int(pre.pop("chip_size")), np.asarray(pre.pop("template"), np.float64)
            channels = pre.pop("channels", "rgb")
            extra = {k: tuple(float(x) for x in pre.pop(k)) for k in ("mean", "std") if k in pre}
            if pre or channels not in ("rgb", "bgr") or template.shape != (5, 2) or not 16 <= chip_size <= 1024:
                raise fail(f"preprocessing: {', '.join(sorted(pre)) or 'chip_size, template or channels'} not as "
                           "this runtime reads it")
            embedder = doc["embedder"]
            if not isinstance(embedder, str):
                raise fail("its embedder is not a model name")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise fail(f"not a system description this runtime reads ({type(e).__name__}: {str(e)[:100]})") from None
        return cls(kind, settings, model, embedder, metric, threshold, chip_size, template, aligner,
                   None if aligner else Preprocess(channels, **extra))


# ---------------------------------------------------------------------------------------------- the pieces
def as_l2(emb: np.ndarray, threshold: float, metric: str = "l2") -> tuple[np.ndarray, float]:
    """(embeddings, L2 threshold) in which a face system with this metric decides by L2 distance: cosine models
    compare unit-normalized embeddings, where cosine ≥ t is exactly L2 < sqrt(2 − 2t)."""
    if metric == "l2":
        return emb, threshold
    if metric != "cosine":
        raise ValueError(f"unknown metric {metric!r}")
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-30)
    return unit, float(np.sqrt(max(0.0, 2.0 - 2.0 * threshold)))


def chip_input(chips: np.ndarray, pre: Preprocess | None) -> np.ndarray:
    """(N, S, S, 3) RGB chips in 0..255 → the embedder's (N, 3, S, S) float32 input: channel order, then
    (x - mean) / std."""
    x = np.ascontiguousarray(np.asarray(chips).transpose(0, 3, 1, 2), dtype=np.float32)
    if pre is None:
        return x
    if pre.channels == "bgr":
        x = x[:, ::-1]
    mean = np.asarray(pre.mean, np.float32)[None, :, None, None]
    std = np.asarray(pre.std, np.float32)[None, :, None, None]
    if (mean != 0).any() or (std != 1).any():
        x = (x - mean) / std
    return np.ascontiguousarray(x, np.float32)


def _timed(timings: dict[str, float], stage: str, fn: Callable, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    timings[stage] = timings.get(stage, 0.0) + (time.perf_counter() - t0) * 1e3
    return out


def detect(spec: Spec, nets: tuple[Callable, ...], rgb: np.ndarray, timings: dict[str, float]) -> list:
    """Faces in one (H, W, 3) RGB uint8 frame, best first; `nets` map a numpy input to a tuple of outputs."""
    names = spec.detector_graphs
    timed = [(lambda s, f: (lambda x: _timed(timings, s, f, x)))(s, f) for s, f in zip(names, nets)]
    in_nets = sum(timings.get(s, 0.0) for s in names)
    t0 = time.perf_counter()
    if spec.detector == MTCNN:
        faces = mtcnn.detect(rgb, *timed, spec.settings)
    else:
        faces = SINGLE_SHOT[spec.detector][1](rgb, timed[0], spec.settings)
    glue = (time.perf_counter() - t0) * 1e3 - (sum(timings.get(s, 0.0) for s in names) - in_nets)
    timings["detect_glue"] = timings.get("detect_glue", 0.0) + glue
    return faces


def chips(spec: Spec, warp: Callable | None, rgb: np.ndarray, faces: list, timings: dict[str, float]) -> np.ndarray:
    """The embedder's input for `faces` of one frame: the aligner graph's warp (`warp(image, theta)`), or the
    reference warp rounded to pixels (as the embedder's image sets were made) and its own normalisation."""
    theta = np.stack([align.chip_transform(f.landmarks, spec.template) for f in faces])
    if warp is not None:
        image = np.ascontiguousarray(rgb.transpose(2, 0, 1)[None], np.float32)
        return np.ascontiguousarray(_timed(timings, "align", warp, image, theta), np.float32)
    def made() -> np.ndarray:
        chip = np.clip(np.rint(align.warp(rgb, theta, spec.chip_size)), 0, 255).astype(np.uint8)
        return chip_input(chip, spec.preprocess)

    return _timed(timings, "align", made)


BRUTE_FORCE_ROWS = 4096       # above this many gallery rows, distances come from one matrix product (below)


def nearest(spec: Spec, gallery: np.ndarray, names: list[str], emb: np.ndarray,
            exclude: int | None = None) -> list[tuple[str, float]]:
    """Nearest gallery identity and distance per embedding, brute force in the system's metric (cosine similarity
    for a cosine model); `exclude` drops one gallery row (leave-one-out checks). Up to BRUTE_FORCE_ROWS rows (every
    release's own gallery) the distances are computed pairwise, as the gates computed them; above (a live gallery of
    thousands) from |g|² − 2 g·q + |q|² in one matrix product (an L2 gallery is not copied; a cosine one is
    normalized, as before) — the same nearest row, its distance equal to float32 rounding."""
    if exclude is None:
        rows, who = gallery, names
    else:
        keep = np.arange(len(names)) != exclude
        rows, who = gallery[keep], [n for n, k in zip(names, keep) if k]
    if not who:                         # an empty gallery (a live one, before anyone is enrolled): nobody is near
        return [("", float("nan"))] * len(emb)
    gal_m, _ = as_l2(rows, spec.threshold, spec.metric)
    q_m, _ = as_l2(emb, spec.threshold, spec.metric)
    if len(who) <= BRUTE_FORCE_ROWS:
        d = np.linalg.norm(gal_m[None] - q_m[:, None], axis=2)      # (queries, gallery)
        j = np.argmin(d, axis=1)
        dist = d[np.arange(len(j)), j]
    else:
        q = np.asarray(q_m, np.float32)
        d2 = np.einsum("ij,ij->i", gal_m, gal_m)[None] - 2.0 * (q @ gal_m.T)      # |q|² added below: same argmin
        j = np.argmin(d2, axis=1)
        dist = np.sqrt(np.maximum(d2[np.arange(len(j)), j] + np.einsum("ij,ij->i", q, q), 0.0))
    found = [(who[int(k)], float(v)) for k, v in zip(j, dist)]
    if spec.metric == "cosine":         # report the similarity the model's threshold is written in
        found = [(n, 1.0 - dist * dist / 2.0) for n, dist in found]
    return found


def identify_frames(spec: Spec, nets: tuple[Callable, ...], warp: Callable | None, embed: Callable,
                    gallery: tuple[np.ndarray, list[str]], frames: list[np.ndarray], timings: dict[str, float],
                    exclude: int | None = None, search: Callable | None = None) -> list[list[Match]]:
    """Faces per frame, best first, each with its identity ("unknown" beyond the threshold), nearest and distance.
    `search(emb)` replaces the brute-force gallery search (the build's FAISS index)."""
    faces = [detect(spec, nets, rgb, timings) for rgb in frames]
    made = [chips(spec, warp, rgb, f, timings) for rgb, f in zip(frames, faces) if f]
    if not made:
        return [[] for _ in frames]
    emb = _timed(timings, "embed", embed, np.concatenate(made) if len(made) > 1 else made[0])
    if search is not None and exclude is None:
        found = _timed(timings, "match", search, emb)
    else:
        found = _timed(timings, "match", nearest, spec, gallery[0], gallery[1], emb, exclude)
    same = (lambda d: d >= spec.threshold) if spec.metric == "cosine" else (lambda d: d < spec.threshold)  # noqa: E731
    out, at = [], 0
    for f in faces:
        out.append([Match(x.box, x.score, n if same(d) else "unknown", n, d, spec.metric, e, x.landmarks)
                    for x, (n, d), e in zip(f, found[at:at + len(f)], emb[at:at + len(f)])])
        at += len(f)
    return out


# ---------------------------------------------------------------------------------------------- a loaded system
@dataclass
class System:
    """A face system ready to run: its spec, its graphs as callables, its gallery. `identify(rgb)` adds its stage
    times to `timings`; `identify_frames` takes the caller's (a load test keeps one per worker)."""
    name: str
    spec: Spec
    nets: tuple[Callable, ...]
    warp: Callable | None
    embed: Callable
    gallery: tuple[np.ndarray, list[str]]
    engines: dict[str, str] = field(default_factory=dict)          # model → what runs it (for people)
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    threads_used: dict[str, int | None] = field(default_factory=dict)

    def identify(self, rgb: np.ndarray, exclude: int | None = None) -> list[Match]:
        """Faces in one frame; `exclude` drops one gallery row (leave-one-out checks)."""
        return self.identify_frames([rgb], self.timings, exclude)[0]

    def identify_frames(self, frames: list[np.ndarray], timings: dict[str, float],
                        exclude: int | None = None) -> list[list[Match]]:
        return identify_frames(self.spec, self.nets, self.warp, self.embed, self.gallery, frames, timings, exclude)

    @classmethod
    def of_runners(cls, name: str, spec: Spec, runners: dict[str, Any], gallery: tuple[np.ndarray, list[str]],
                   engines: dict[str, str] | None = None) -> "System":
        """The system of one runner per graph (`spec.graphs`): detector nets fed `input`, the aligner `image` and
        `theta`, the embedder its first input; the embedder's output must be as wide as the gallery."""
        missing = [m for m in spec.graphs if m not in runners]
        if missing:
            raise GateFailed(f"system {name}: no engine for {', '.join(missing)}", "release the whole system again")
        nets = tuple(net_of(runners[m], spec.detector in BY_NAME) for m in spec.detector_graphs)
        warp = None
        if spec.aligner:
            warp = (lambda r: (lambda image, theta: r.run_all({"image": image, "theta": theta})[0]))(runners["aligner"])
        dim = int(gallery[0].shape[1])
        made = cls(name, spec, nets, warp, _same_width(runners[spec.embedder].run, dim, name), gallery,
                   dict(engines or {m: m for m in runners}))
        made.threads_used = {m: getattr(r, "threads", None) for m, r in runners.items()}
        made._runners = runners              # kept alive: each holds its verified private copy
        return made


def net_of(runner, by_name: bool = False) -> Callable:
    """A detector graph as the detector calls it: numpy input → its outputs, a tuple in the graph's order or, for a
    declared decode (`by_name`), a dict by output name (the runner's `output_names`)."""
    if not by_name:
        return lambda x: tuple(runner.run_all({"input": x}))
    names = getattr(runner, "output_names", None)
    if not names:
        raise GateFailed(f"{type(runner).__name__} does not name its outputs, which a declared decode reads by name",
                         "run the detector on ort-cpu or openvino-cpu")
    return lambda x: dict(zip(names, runner.run_all({"input": x})))


def _same_width(embed: Callable, dim: int, what: str) -> Callable:
    """The embedder, refusing in one line an output that is not (faces, dim): the gallery's width is what the release
    recorded at build time; an embedder that disagrees would otherwise fail inside the search with a traceback."""
    def run(x):
        out = embed(x)
        if getattr(out, "ndim", None) != 2 or out.shape[1] != dim:
            raise GateFailed(f"{what}: its embedder outputs {tuple(getattr(out, 'shape', ()))}, its gallery holds "
                             f"{dim}-d embeddings", "do not use this release")
        return out
    return run
