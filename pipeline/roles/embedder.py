"""The embedder role (`samples: chips`): aligned face chips → one vector each.

Feeds: batches of chips from the golden / calibration image set (artifacts/data/<set>, or <set>-<model> for a model
with its own `preprocess` geometry), made into the model's input by `inputs.chip_input` (channel order, mean, std)
batch by batch, so a large set never sits in memory as float32. golden@ also writes every chip's embedding
(`embeddings.npy`) and how far same- and different-identity chips lie apart. The gate compares the engine's
embeddings with those: cosine and L2 per chip, identity top-1 through the golden gallery, same/different decisions
at the model's threshold (pipeline/gates/facemetrics.py), against params.yaml `validate:`'s top-level limits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.roles.base import CHECK, Feed, Outputs, Role, by_name

if TYPE_CHECKING:
    from pipeline.config import Config, ModelConfig

BATCH = 8                  # chips per engine call in the gate
FACE_METRICS = "pipeline.gates.facemetrics:face_metrics"
EMBEDDER_GATE = "pipeline.gates.facemetrics:EMBEDDER_GATE"     # the GPU-side scripts apply the same table


def pair_distances(emb: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """L2 distance ranges of same-identity and different-identity pairs: how far the threshold is from the data."""
    d = np.linalg.norm(emb[:, None] - emb[None], axis=-1)
    same = labels[:, None] == labels[None]
    off = ~np.eye(len(emb), dtype=bool)
    s, o = d[same & off], d[~same]
    out = {}
    if s.size:
        out.update(same_l2_min=float(s.min()), same_l2_max=float(s.max()))
    if o.size:
        out.update(diff_l2_min=float(o.min()), diff_l2_max=float(o.max()))
    return {k: round(v, 6) for k, v in out.items()}


class ChipFeeds(Sequence):
    """Chip batches converted to float only when used, so a large set never sits in memory as float32."""

    def __init__(self, chips: np.ndarray, batch: int, mcfg: ModelConfig | None = None) -> None:
        self.chips, self.batch, self.mcfg = chips, batch, mcfg

    def __len__(self) -> int:
        return -(-len(self.chips) // self.batch)

    def __getitem__(self, i: int) -> Feed:
        from pipeline.roles import inputs
        from pipeline.data import to_nchw

        if not 0 <= i < len(self):
            raise IndexError(i)
        chips = self.chips[i * self.batch:(i + 1) * self.batch]
        return {"input": to_nchw(chips) if self.mcfg is None else inputs.chip_input(self.mcfg, chips)}


class Embedder(Role):
    name = "chips"
    task = "embed"
    feed_range = (0.0, 255.0)
    outputs = Outputs(None, 2, "an embedder's first output must be rank 2 (batch, dimension)")
    key_metric, direction, accuracy_label = "cosine_min", 1, "golden cosine min"
    metrics = FACE_METRICS

    @staticmethod
    def _set(cfg: Config, model: str, set_name: str, root: Path):
        from pipeline import paths
        from pipeline.roles import inputs
        from pipeline.data import load_set

        return load_set(paths.data_set(inputs.chip_set(cfg, model, set_name), root))

    # ------------------------------------------------------------------ feeds
    def deps(self, cfg: Config, model: str, set_name: str) -> list[str]:
        from pipeline import paths
        from pipeline.roles import inputs

        return [paths.data_set(inputs.chip_set(cfg, model, set_name)).as_posix()]

    def params(self, cfg: Config, model: str) -> list[str]:
        return []

    def manifest_inputs(self, cfg: Config, model: str, set_name: str, root: Path) -> list[dict]:
        from pipeline import paths
        from pipeline.roles import inputs
        from pipeline.manifest import input_ref, manifest_path

        key = inputs.chip_set(cfg, model, set_name)
        return [input_ref(f"{set_name}_set", manifest_path(paths.data_set(key, root), key), root)]

    def feeds(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Sequence[Feed]:
        return ChipFeeds(self._set(cfg, model, set_name, root).chips, batch, cfg.model(model))

    def stream(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Iterator[Feed]:
        yield from self.feeds(cfg, model, set_name, root, batch)

    # ------------------------------------------------------------------ golden reference
    def golden(self, cfg: Config, model: str, outs: list[list[np.ndarray]],
               root: Path) -> tuple[dict[str, np.ndarray], dict]:
        """Every chip's embedding, and the L2 ranges of same / different identities (cosine models: unit vectors)."""
        from pipeline.vectors import as_l2

        mcfg = cfg.model(model)
        gset = self._set(cfg, model, "golden", root)
        emb = np.concatenate([o[0] for o in outs])
        plain = np.array([s["augmentation"] is None for s in gset.index["samples"]])
        unit, _ = as_l2(emb, mcfg.verify_threshold, mcfg.metric)     # cosine models: unit vectors
        return {"embeddings.npy": emb.astype(np.float32)}, {
            "plain_chips": pair_distances(unit[plain], gset.labels[plain]),
            "all_chips": pair_distances(unit, gset.labels), "golden_set_xxh3_128": gset.content_hash}

    # ------------------------------------------------------------------ gate
    def measure(self, cfg: Config, model: str, runner, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """The engine's embeddings of every golden chip vs golden@'s; extra: the golden set's content hash."""
        from pipeline import paths
        from pipeline.roles import inputs

        mcfg = cfg.model(model)
        gset = self._set(cfg, model, "golden", root)
        ref = np.load(paths.golden(model, root) / "embeddings.npy", allow_pickle=False)
        x = inputs.chip_input(mcfg, gset.chips)
        got = np.concatenate([runner.run(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
        gallery = np.array([s["augmentation"] is None for s in gset.index["samples"]])
        metrics = by_name(self.metrics)(got, ref, gset.labels, np.flatnonzero(gallery), mcfg.verify_threshold,
                                        mcfg.metric)
        return metrics, {"golden_set_xxh3_128": gset.content_hash}

    def gate_inputs(self, cfg: Config, model: str, root: Path) -> list[dict]:
        return self.manifest_inputs(cfg, model, "golden", root)

    def gate_checks(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(by_name(EMBEDDER_GATE))

    def gate(self, cfg: Config, metrics: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        """Against params.yaml `validate:`'s own limits (its sections are the other roles')."""
        from dataclasses import asdict

        limits = {k: v for k, v in cfg.section("validate").items() if not isinstance(v, dict)}
        return by_name(CHECK)(metrics, self.gate_checks(), asdict(cfg.validate)), limits


EMBEDDER = Embedder()
