"""golden@<model>: the FP32 reference outputs on the golden inputs. Every later check compares to these.

The reference is PyTorch eager for a model with a factory, and ONNX Runtime with graph optimizations off on the
original file for a model delivered as ONNX (pipeline/onnx_import.py `reference_session`).

Outputs are stored one file per feed and output (`reference/0003.prob.npy`), because P-Net's inputs differ in size
from one pyramid level to the next. The model's role adds what it needs beside them (pipeline/roles/): an embedder
(`samples: chips`) gets `embeddings.npy`, all chips' embeddings in set order, which the face-task validation and the
matching stages read.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import models, paths, samples, stage
from pipeline.gates.golden import npy_bytes, onnx_reference, output_names, reference_outputs
from pipeline.gates.reference import source_inputs
from pipeline.manifest import atomic_dir, build_manifest, write_bytes_atomic, write_json_atomic, write_manifest
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "golden", "pipeline.stages.golden", "FP32 reference outputs (PyTorch, or ORT on an ONNX original) on each "
    "graph's golden inputs",
    keys=lambda cfg: list(cfg.models),
    deps=lambda cfg, key: models.weight_deps(cfg.model(key)) + samples.deps(cfg, key, "golden"),
    params=lambda cfg, key: [f"models.{key}", *samples.params(cfg, key)],
    dynamic=lambda cfg, key: [*models.factory_modules(cfg.model(key)), *roles.modules(cfg.model(key).samples)],
    outs=lambda cfg, key: [stage.Out(paths.golden(key).as_posix())],
    portable=True,
    help="compute a model's FP32 PyTorch reference outputs on its golden inputs")


@dataclass(frozen=True)
class GoldenResult:
    directory: Path
    summary: dict


def run(cfg: Config, model_name: str, root: Path = Path(".")) -> GoldenResult:
    mcfg = cfg.model(model_name)
    feeds = samples.feeds(cfg, model_name, "golden", root)
    if mcfg.onnx is not None:
        outs, names, note = onnx_reference(mcfg, feeds, root)
    else:
        note = None
        model = models.build(mcfg, root)
        outs = reference_outputs(model, feeds)
        names = output_names(model)
    summary = {"feeds": len(feeds), "samples": samples.sample_count(feeds), "feeds_xxh3_128": samples.digest(feeds),
               "outputs": {n: list(outs[0][k].shape[1:]) for k, n in enumerate(names)},
               **({"reference_note": note} if note else {})}
    out = paths.golden(model_name, root)
    with atomic_dir(out) as d:
        files = []
        for i, per_feed in enumerate(outs):
            for n, a in zip(names, per_feed):
                files.append(d / "reference" / f"{i:04d}.{n}.npy")
                write_bytes_atomic(files[-1], npy_bytes(a))
        write_json_atomic(d / "index.json", {"inputs": list(feeds[0]), "outputs": names, "feeds": len(feeds),
                                             "feeds_xxh3_128": summary["feeds_xxh3_128"]})
        files.append(d / "index.json")
        inputs = source_inputs(mcfg, root) + samples.inputs(cfg, model_name, "golden", root)
        arrays, extra = samples.role(cfg, model_name).golden(cfg, model_name, outs, root)  # embedder: embeddings.npy
        for name, a in arrays.items():
            write_bytes_atomic(d / name, npy_bytes(a))
            files.append(d / name)
        summary.update(extra)
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
