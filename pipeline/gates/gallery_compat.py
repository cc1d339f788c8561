"""Gallery compatibility: can a candidate embedder engine read a gallery the production embedder enrolled?

Changing the embedder of a deployed face system (another precision, target or toolchain) leaves the enrolled
gallery as the old engine made it. So, before such a system is promoted, its embedder is measured against the
production one on the embedder's golden chip set (pipeline/e2e.py `enroll`: the gallery is the un-augmented chips):

* the gallery is enrolled from the un-augmented chips by the PRODUCTION engine;
* the probes are the augmented chips, embedded by the production engine (`same`: what production sees today) and by
  the CANDIDATE (`cross`: what production will see after the swap, before any re-enrolment);
* both decide in the embedder's own space (pipeline.vectors.as_l2: L2, or L2 between unit vectors for a cosine
  model) at its verify_threshold, open-set like `kiln identify`: the nearest gallery face's name, or `unknown`.

Metrics: `top1_agreement` (probes whose identity-or-unknown is the same under cross as under same-engine probing),
`decision_flips` (probe × gallery-face same/different decisions that change), `tar_delta` / `far_delta` (cross −
same, genuine / impostor pairs accepted), `distance_delta_max` (largest change of a probe-to-gallery distance), and
for context each side's own numbers (`same`, `cross`, and `candidate`: the candidate against a gallery it enrolled
itself — what re-enrolment gives). The limits are params.yaml `gallery_compat:` (pipeline/config.py GalleryCompat);
a candidate outside them is `re-enroll required`. Engines load only verified (pipeline.engines.load).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline import engines, paths, samples
from pipeline.data import load_set
from pipeline.errors import KilnError
from pipeline.gates.facemetrics import check
from pipeline.manifest import manifest_path, read_manifest
from pipeline.roles import registry as roles
from pipeline.vectors import as_l2

if TYPE_CHECKING:
    from pipeline.config import Config, ModelConfig

COMPATIBLE, RE_ENROLL = "compatible", "re-enroll required"
CHECKS = (("top1_agreement", ">=", "top1_agreement_min"), ("decision_flips", "<=", "decision_flips_max"),
          ("tar_delta_abs", "<=", "tar_delta_max"), ("far_delta_abs", "<=", "far_delta_max"),
          ("distance_delta_max", "<=", "distance_delta_max"))
BATCH = 16                    # chips per engine call (static-batch engines run it in their own chunks)


@dataclass(frozen=True)
class Compat:
    candidate: str            # engine names
    production: str
    model: str
    metrics: dict[str, Any]
    limits: dict[str, Any]
    failures: list[str] = field(default_factory=list)
    enrolment: dict[str, str] | None = None   # the recorded re-enrolment a move past `re-enroll required` relies on

    @property
    def verdict(self) -> str:
        return RE_ENROLL if self.failures else COMPATIBLE

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}

    def summary(self) -> str:
        m = self.metrics
        if not m:                     # nothing measurable (another embedder model)
            return f"{self.candidate} vs gallery of {self.production}: {self.verdict}: {'; '.join(self.failures)}"
        return (f"{self.candidate} vs gallery of {self.production}: {self.verdict} (top1_agreement "
                f"{m['top1_agreement']:.4g}, decision_flips {m['decision_flips']}/{m['pairs']}, tar_delta "
                f"{m['tar_delta']:+.4g}, far_delta {m['far_delta']:+.4g}, distance_delta_max "
                f"{m['distance_delta_max']:.4g})" + (f": {'; '.join(self.failures)}" if self.failures else ""))


def _embed(runner, x: np.ndarray) -> np.ndarray:
    return np.concatenate([np.asarray(runner.run(x[i:i + BATCH]), np.float32) for i in range(0, len(x), BATCH)])


def _decide(gallery: np.ndarray, probes: np.ndarray, thr: float) -> tuple[np.ndarray, np.ndarray]:
    """(probe × gallery distances, each probe's nearest gallery row or -1 when it is beyond the threshold)."""
    d = np.linalg.norm(probes[:, None, :] - gallery[None, :, :], axis=-1)
    j = np.argmin(d, axis=1)
    return d, np.where(d[np.arange(len(j)), j] < thr, j, -1)


def _side(d: np.ndarray, near: np.ndarray, thr: float, g_lab: np.ndarray, p_lab: np.ndarray) -> dict[str, float]:
    genuine = p_lab[:, None] == g_lab[None, :]
    accept = d < thr
    ident = np.where(near >= 0, g_lab[np.maximum(near, 0)], -1)
    return {"top1_accuracy": float(np.mean(ident == p_lab)), "tar": float(accept[genuine].mean()),
            "far": float(accept[~genuine].mean()) if (~genuine).any() else 0.0}


def measure(mcfg: ModelConfig, production: np.ndarray, candidate: np.ndarray, labels: np.ndarray, plain: np.ndarray
            ) -> dict[str, Any]:
    """The metrics from both engines' embeddings of the same chips (`plain`: the enrolled, un-augmented rows)."""
    p, thr = as_l2(production, mcfg.verify_threshold, mcfg.metric)
    c, _ = as_l2(candidate, mcfg.verify_threshold, mcfg.metric)
    probe = ~plain
    g_lab, p_lab = labels[plain], labels[probe]
    d_same, n_same = _decide(p[plain], p[probe], thr)
    d_cross, n_cross = _decide(p[plain], c[probe], thr)
    d_cand, n_cand = _decide(c[plain], c[probe], thr)
    ident = lambda n: np.where(n >= 0, g_lab[np.maximum(n, 0)], -1)     # noqa: E731 — identity or -1 (unknown)
    same, cross = _side(d_same, n_same, thr, g_lab, p_lab), _side(d_cross, n_cross, thr, g_lab, p_lab)
    m = {"probes": int(probe.sum()), "gallery": int(plain.sum()), "pairs": int(d_same.size),
         "metric": mcfg.metric, "threshold": float(mcfg.verify_threshold), "threshold_l2": float(thr),
         "top1_agreement": float(np.mean(ident(n_same) == ident(n_cross))),
         "decision_flips": int(np.sum((d_same < thr) != (d_cross < thr))),
         "tar_delta": cross["tar"] - same["tar"], "far_delta": cross["far"] - same["far"],
         "distance_delta_max": float(np.max(np.abs(d_cross - d_same))),
         "margin_min": float(np.min(np.abs(d_same - thr))),
         "same": same, "cross": cross, "candidate": _side(d_cand, n_cand, thr, g_lab, p_lab)}
    m["tar_delta_abs"], m["far_delta_abs"] = abs(m["tar_delta"]), abs(m["far_delta"])
    return _rounded(m)


def _rounded(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return round(v, 7) if isinstance(v, float) else v


def _runner(cfg: Config, name: str, directory: Path | None, root: Path):
    """A verified runner of engine `name` from `directory` (default: its local build)."""
    if directory is None:           # the local build: params.yaml says what it is, the load checks the manifest
        return engines.load(cfg.engine(name).target, paths.engine(name, root), name)
    d = Path(directory)             # a verified registry download: its own manifest names the target
    return engines.load(read_manifest(manifest_path(d, name)).get("target") or cfg.engine(name).target, d, name)


def compare(cfg: Config, candidate: str, production: str, root: Path = Path("."), candidate_dir: Path | None = None,
            production_dir: Path | None = None, model: str | None = None,
            limits: dict[str, Any] | None = None) -> Compat:
    """Measure `candidate` (engine name) against a gallery enrolled by `production`, both of embedder `model`
    (default: the candidate's model in params.yaml); `*_dir`: a verified copy elsewhere (a registry download);
    `limits`: the limits to judge by (default params.yaml's `gallery_compat:`; a system version's recorded ones)."""
    root = Path(root)
    if model is None:               # two local engines (kiln gallery-compat): both of one embedder model
        model = cfg.engine(candidate).model
        if (other := cfg.engine(production).model) != model:
            raise KilnError(f"{candidate} is an engine of {model}, {production} of {other}: a gallery is read by "
                            "engines of one embedder", "compare two engines of the same embedder model")
        if cfg.model(model).samples not in roles.with_task("embed"):
            raise KilnError(f"{candidate}: {model} is not an embedder (role {cfg.model(model).samples})",
                            "compare two embedder engines, e.g. embedder-ort-cpu-int8 embedder-ort-cpu-fp32")
    mcfg = cfg.model(model)
    gset = load_set(paths.data_set(samples.chip_set(cfg, model, "golden"), root))
    x = samples.chip_input(mcfg, gset.chips)
    plain = np.array([s["augmentation"] is None for s in gset.index["samples"]])
    emb_p = _embed(_runner(cfg, production, production_dir, root), x)
    emb_c = emb_p if (candidate, candidate_dir) == (production, production_dir) else \
        _embed(_runner(cfg, candidate, candidate_dir, root), x)
    metrics = measure(mcfg, emb_p, emb_c, np.asarray(gset.labels), plain)
    limits = dict(limits) if limits is not None else asdict(cfg.gallery_compat)
    return Compat(candidate, production, model, metrics, limits, check(metrics, CHECKS, limits))


def table(c: Compat) -> str:
    """The numbers as a table: same-engine (production), cross (candidate probes on production's gallery), and the
    candidate against its own gallery (re-enrolled)."""
    from pipeline import tables

    m = c.metrics
    rows = [(label, f"{s['top1_accuracy']:.4f}", f"{s['tar']:.4f}", f"{s['far']:.4f}")
            for label, s in ((f"same engine: {c.production} on its gallery", m["same"]),
                             (f"cross: {c.candidate} probes on {c.production}'s gallery", m["cross"]),
                             (f"re-enrolled: {c.candidate} on its own gallery", m["candidate"]))]
    head = tables.markdown(["probing", "top-1 accuracy", "TAR", "FAR"], rows)
    rule = f"{'cosine' if m['metric'] == 'cosine' else 'L2'} threshold {m['threshold']:g}"
    lines = [head, "", f"{m['probes']} probes × {m['gallery']} gallery faces = {m['pairs']} decisions at the {rule} "
             f"(closest same-engine pair {m['margin_min']:.4g} from it)"]
    for k, op, key in CHECKS:
        shown = m[k.removesuffix("_abs")] if k.endswith("_abs") else m[k]
        ok = "ok  " if not any(f.startswith(k + " ") for f in c.failures) else "FAIL"
        delta = k.endswith("_abs")
        lines.append(f"  {ok} {k.removesuffix('_abs'):<20} {format(shown, '+.6g' if delta else '.6g'):<10} (limit "
                     f"{'|Δ| ' if delta else ''}{op} {c.limits[key]:g})")
    lines.append(f"gallery-compat: {c.verdict}")
    return "\n".join(lines)
