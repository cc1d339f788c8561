"""golden@<model>: the FP32 PyTorch reference outputs on the golden set. Every later validation compares to these."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline import models, paths, toolchain
from pipeline.config import Config
from pipeline.data import load_set, to_nchw
from pipeline.manifest import (atomic_dir, build_manifest, file_digests, input_ref, manifest_path, source_info,
                               write_bytes_atomic, write_manifest)

BATCH = 16


@dataclass(frozen=True)
class GoldenResult:
    directory: Path
    embeddings: np.ndarray
    summary: dict


def reference_outputs(model: torch.nn.Module, x: np.ndarray, batch: int = BATCH) -> np.ndarray:
    with torch.inference_mode():
        return np.concatenate([model(torch.from_numpy(x[i:i + batch])).numpy() for i in range(0, len(x), batch)])


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


def run(cfg: Config, model_name: str, root: Path = Path(".")) -> GoldenResult:
    mcfg = cfg.model(model_name)
    set_dir = paths.data_set("golden", root)
    gset = load_set(set_dir)
    emb = reference_outputs(models.build(mcfg, root), to_nchw(gset.chips))
    plain = np.array([s["augmentation"] is None for s in gset.index["samples"]])
    summary = {"count": int(len(emb)), "dim": int(emb.shape[1]), "golden_set_xxh3_128": gset.content_hash,
               "plain_chips": pair_distances(emb[plain], gset.labels[plain]),
               "all_chips": pair_distances(emb, gset.labels)}
    out = paths.golden(model_name, root)
    with atomic_dir(out) as d:
        buf = io.BytesIO()
        np.save(buf, emb.astype(np.float32), allow_pickle=False)
        write_bytes_atomic(d / "embeddings.npy", buf.getvalue())
        inputs = [input_ref("golden_set", manifest_path(set_dir, "golden"), root),
                  {"role": "weights", "path": mcfg.weights.as_posix(), **file_digests(root / mcfg.weights)}]
        write_manifest(d, build_manifest(
            kind="golden", name=model_name, model=model_name, precision="fp32", directory=d,
            files=[d / "embeddings.npy"], inputs=inputs, toolchain=toolchain.describe("torch", "numpy"),
            build={"factory": mcfg.factory, "reference": "pytorch-eager-fp32"},
            source=source_info(root, cfg.section("models", model_name)), results=summary))
    return GoldenResult(out, emb, summary)
