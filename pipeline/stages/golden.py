"""golden@<model>: the FP32 reference outputs on the golden inputs. Every later check compares to these.

The reference is PyTorch eager for a model with a factory, and ONNX Runtime with graph optimizations off on the
original file for a model delivered as ONNX (pipeline/onnx_import.py `reference_session`).

Outputs are stored one file per feed and output (`reference/0003.prob.npy`), because P-Net's inputs differ in size
from one pyramid level to the next. Embedders (samples kind `chips`) also get `embeddings.npy`, all chips'
embeddings in set order, which the face-task validation and the matching stages read.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipeline import models, paths, samples, stage
from pipeline.data import load_set
from pipeline.errors import KilnError
from pipeline.facemetrics import as_l2
from pipeline.manifest import (atomic_dir, build_manifest, file_input, manifest_path, read_verified,
                               write_bytes_atomic, write_json_atomic, write_manifest)

def source_inputs(mcfg, root: Path) -> list[dict]:
    """Manifest inputs (digests) of the files the model's graph is read from (models.weight_deps)."""
    if mcfg.onnx is None:
        return [file_input("weights", root / w, root) for w in models.weight_deps(mcfg)]
    return [file_input("onnx_source" if i == 0 else "onnx_external_data", root / f, root)
            for i, f in enumerate(mcfg.onnx.files)]


STAGE = stage.Stage(
    "golden", "pipeline.stages.golden", "FP32 reference outputs (PyTorch, or ORT on an ONNX original) on each "
    "graph's golden inputs",
    keys=lambda cfg: list(cfg.models),
    deps=lambda cfg, key: models.weight_deps(cfg.model(key)) + samples.deps(cfg, key, "golden"),
    params=lambda cfg, key: [f"models.{key}", *samples.params(cfg, key)],
    dynamic=lambda cfg, key: [*models.factory_modules(cfg.model(key))],
    outs=lambda cfg, key: [stage.Out(paths.golden(key).as_posix())])


@dataclass(frozen=True)
class GoldenResult:
    directory: Path
    summary: dict


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def reference_outputs(model: torch.nn.Module, feeds: Sequence[samples.Feed]) -> list[list[np.ndarray]]:
    """Run the PyTorch model on every feed; inputs are passed in the feed's order (the forward's argument order).
    A reference with a NaN or infinite value is refused: every later gate would compare against garbage."""
    outs = []
    with torch.inference_mode():
        for i, feed in enumerate(feeds):
            y = model(*(torch.from_numpy(v) for v in feed.values()))
            outs.append([t.numpy() for t in (y if isinstance(y, (tuple, list)) else (y,))])
            if not all(np.isfinite(o).all() for o in outs[-1]):
                raise KilnError(f"the reference model produced NaN or infinite outputs on golden feed {i}",
                                "check the model's weights (a corrupt or NaN-filled file?) and its input scaling")
    return outs


def output_names(model: torch.nn.Module) -> list[str]:
    return list(getattr(model, "output_names", ["output"]))


def load_reference(directory: Path) -> tuple[list[str], list[list[np.ndarray]]]:
    """(output names, outputs per feed) of a golden artifact, its files verified against its manifest first."""
    read_verified(manifest_path(directory, directory.name), fast=True)
    index = json.loads((directory / "index.json").read_text())
    names = index["outputs"]
    return names, [[np.load(directory / "reference" / f"{i:04d}.{n}.npy", allow_pickle=False) for n in names]
                   for i in range(index["feeds"])]


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


def onnx_reference(mcfg, feeds: Sequence[samples.Feed], root: Path) -> tuple[list[list[np.ndarray]], list[str]]:
    """ONNX Runtime on the original (pinned, checked) file: outputs per feed and the output names. The file's I/O
    is checked first, as import@ checks it: a wrong input shape or layout, or a Loop, is one clear error."""
    from pipeline import onnx_import

    proto = onnx_import.load_source(mcfg, root)
    onnx_import.check_source(proto, mcfg, mcfg.onnx.path)
    run_feed, names = onnx_import.reference_session(proto, mcfg.layout)
    outs = []
    for i, feed in enumerate(feeds):
        outs.append(run_feed(feed))
        if not all(np.isfinite(o).all() for o in outs[-1]):
            raise KilnError(f"{mcfg.onnx.path}: the model produced NaN or infinite outputs on golden feed {i}",
                            f"check the file and models.{mcfg.name}.preprocess (input scaling)")
    return outs, names


def run(cfg, model_name: str, root: Path = Path(".")) -> GoldenResult:
    mcfg = cfg.model(model_name)
    feeds = samples.feeds(cfg, model_name, "golden", root)
    if mcfg.onnx is not None:
        outs, names = onnx_reference(mcfg, feeds, root)
    else:
        model = models.build(mcfg, root)
        outs = reference_outputs(model, feeds)
        names = output_names(model)
    summary = {"feeds": len(feeds), "samples": samples.sample_count(feeds), "feeds_xxh3_128": samples.digest(feeds),
               "outputs": {n: list(outs[0][k].shape[1:]) for k, n in enumerate(names)}}
    out = paths.golden(model_name, root)
    with atomic_dir(out) as d:
        files = []
        for i, per_feed in enumerate(outs):
            for n, a in zip(names, per_feed):
                files.append(d / "reference" / f"{i:04d}.{n}.npy")
                write_bytes_atomic(files[-1], _npy_bytes(a))
        write_json_atomic(d / "index.json", {"inputs": list(feeds[0]), "outputs": names, "feeds": len(feeds),
                                             "feeds_xxh3_128": summary["feeds_xxh3_128"]})
        files.append(d / "index.json")
        inputs = source_inputs(mcfg, root) + samples.inputs(cfg, model_name, "golden", root)
        if mcfg.samples == "chips":
            gset = load_set(paths.data_set(samples.chip_set(cfg, model_name, "golden"), root))
            emb = np.concatenate([o[0] for o in outs])
            write_bytes_atomic(d / "embeddings.npy", _npy_bytes(emb.astype(np.float32)))
            files.append(d / "embeddings.npy")
            plain = np.array([s["augmentation"] is None for s in gset.index["samples"]])
            unit, _ = as_l2(emb, mcfg.verify_threshold, mcfg.metric)     # cosine models: unit vectors
            summary.update(plain_chips=pair_distances(unit[plain], gset.labels[plain]),
                           all_chips=pair_distances(unit, gset.labels), golden_set_xxh3_128=gset.content_hash)
        write_manifest(d, build_manifest(
            kind="golden", name=model_name, model=model_name, precision="fp32", directory=d, files=files,
            inputs=inputs, build={"factory": mcfg.factory, "samples": mcfg.samples,
                                  "reference": "pytorch-eager-fp32" if mcfg.onnx is None else
                                  "onnxruntime-fp32-no-graph-optimization"},
            results=summary, **STAGE.identity(cfg, model_name, root)))
    return GoldenResult(out, summary)


def main(argv: list[str] | None = None) -> int:
    import time

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        s = run(args.cfg, args.key).summary
        print(f"golden@{args.key}: {s['samples']} samples in {s['feeds']} feeds → outputs {s['outputs']} "
              f"in {time.perf_counter() - t0:.1f} s")
        if "plain_chips" in s:
            print(f"  L2 between un-augmented chips: {s['plain_chips']}")
        return 0

    return stage.main(STAGE, body, argv, key_help="model name from params.yaml (e.g. embedder)")


if __name__ == "__main__":
    sys.exit(main())
