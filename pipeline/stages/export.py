"""export@<model>: PyTorch → ONNX (dynamic batch), checked, shape-inferred, inventoried and proven against golden.

(A model delivered as ONNX — models.<m>.onnx — is imported by import@<model> instead: pipeline/stages/imports.py.)

The exporter is pinned (params `export.exporter`) because only a pinned exporter gives byte-identical files;
tests/test_export.py exports twice in fresh processes and compares the bytes. The parity check runs the ONNX in
ONNX Runtime on the golden set and compares with the golden (PyTorch FP32) outputs: beyond `export.parity` the
stage fails and writes nothing.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from pipeline import models, paths, samples, stage
from pipeline.config import ExportConfig, ModelConfig
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, write_manifest
from pipeline.stages.golden import load_reference


def model_deps(cfg, key: str) -> list[str]:
    """What a stage that rebuilds a model and compares it with its golden outputs reads."""
    return [*models.weight_deps(cfg.model(key)), paths.golden(key).as_posix(), *samples.deps(cfg, key, "golden")]


STAGE = stage.Stage(
    "export", "pipeline.stages.export", "PyTorch → ONNX, checked, inventoried, parity-gated against golden",
    keys=lambda cfg: [m for m, spec in cfg.models.items() if spec.factory is not None], deps=model_deps,
    params=lambda cfg, key: [f"models.{key}", "export", *samples.params(cfg, key)],
    dynamic=lambda cfg, key: [*models.factory_modules(cfg.model(key))],
    outs=lambda cfg, key: [stage.Out(paths.export(key).as_posix())])


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    parity: dict
    ops: dict[str, int]


def export_onnx(model: torch.nn.Module, mcfg: ModelConfig, ecfg: ExportConfig, path: Path,
                example: dict[str, np.ndarray] | None = None) -> None:
    """Write the ONNX graph of `model`, with the dynamic axes of params `models.<name>.dynamic`.

    `example` (a golden feed) gives the input names, order and shapes; by default one input named `input` of
    batch 2 × `input_shape`. Deterministic for a pinned exporter.
    """
    if example is None:
        example = {"input": np.zeros((2, *mcfg.input_shape), np.float32)}
    output_names = list(getattr(model, "output_names", ["output"]))
    axes = {name: {a: f"{name}_{a}" for a in mcfg.dynamic.get(name, ())} for name in example}
    axes.update({name: {0: "batch"} for name in output_names if mcfg.samples != "pnet"})
    if mcfg.samples == "pnet":  # fully convolutional: every output spatial size follows the input's
        axes.update({name: {0: "batch", 2: "out_h", 3: "out_w"} for name in output_names})
    args = tuple(torch.from_numpy(v) for v in example.values())
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice; the choice is pinned
        kwargs = {"external_data": False} if ecfg.exporter == "dynamo" else {}
        torch.onnx.export(model, args, str(path), dynamo=ecfg.exporter == "dynamo", opset_version=ecfg.opset,
                          input_names=list(example), output_names=output_names,
                          dynamic_axes={k: v for k, v in axes.items() if v}, do_constant_folding=True, **kwargs)


def check_graph(path: Path) -> tuple[dict[str, int], dict[str, list]]:
    """onnx.checker (full) + strict shape inference; returns the operator inventory and output shapes."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise KilnError(f"{path}: exported graph is invalid: {str(e).splitlines()[0]}",
                        "the model uses an op the exporter lowers incorrectly; see the ONNX error above") from None
    ops = dict(sorted(Counter(n.op_type for n in model.graph.node).items()))
    shapes = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    return ops, shapes


def compare(run_feed, feeds, reference: list[list[np.ndarray]]) -> dict[str, float]:
    """`run_feed(feed) -> outputs` vs the reference on every feed and output: max |Δ| and per-sample cosine.
    A NaN or infinite value on either side makes max |Δ| infinite and the cosine -1, so no gate can pass it."""
    max_abs, cosines, n = 0.0, [], 0
    for feed, ref in zip(feeds, reference):
        got = run_feed(feed)
        n += next(iter(feed.values())).shape[0]
        for g, r in zip(got, ref):
            g2, r2 = g.reshape(len(g), -1).astype(np.float64), r.reshape(len(r), -1).astype(np.float64)
            if not (np.isfinite(g2).all() and np.isfinite(r2).all()):
                max_abs = float("inf")
                cosines.append(np.full(len(g2), -1.0))
                continue
            max_abs = max(max_abs, float(np.abs(g2 - r2).max()))
            cosines.append(np.sum(g2 * r2, 1) / np.maximum(np.linalg.norm(g2, axis=1) * np.linalg.norm(r2, axis=1),
                                                            1e-30))
    cos = np.concatenate(cosines)
    return {"max_abs": max_abs, "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()), "samples": n}


def parity(onnx_path: Path, feeds, reference: list[list[np.ndarray]]) -> dict[str, float]:
    """ONNX Runtime (CPU) vs the PyTorch reference on every feed and output."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return compare(lambda feed: sess.run(None, feed), feeds, reference)


def run(cfg, model_name: str, root: Path = Path(".")) -> ExportResult:
    mcfg, ecfg = cfg.model(model_name), cfg.export
    golden_dir = paths.golden(model_name, root)
    feeds = samples.feeds(cfg, model_name, "golden", root)
    _, reference = load_reference(golden_dir)
    out = paths.export(model_name, root)
    with atomic_dir(out) as d:
        onnx_path = d / "model.onnx"
        export_onnx(models.build(mcfg, root), mcfg, ecfg, onnx_path, feeds[0])
        ops, shapes = check_graph(onnx_path)
        par = parity(onnx_path, feeds, reference)
        max_abs = ecfg.parity.max_abs if mcfg.parity_max_abs is None else mcfg.parity_max_abs
        passed = par["max_abs"] <= max_abs and par["cosine_min"] >= ecfg.parity.min_cosine
        if not passed:
            raise GateFailed(f"export@{model_name}: ONNX Runtime differs from PyTorch beyond tolerance: max |Δ| "
                             f"{par['max_abs']:.3g} (limit {max_abs:g}), min cosine "
                             f"{par['cosine_min']:.7f} (limit {ecfg.parity.min_cosine:g})",
                             "inspect the exported graph; loosen export.parity only with a reason")
        results = {"parity": {k: (round(v, 9) if isinstance(v, float) else v) for k, v in par.items()},
                   "parity_limits": {"max_abs": max_abs, "min_cosine": ecfg.parity.min_cosine},
                   "ops": ops, "nodes": sum(ops.values()), "outputs": shapes}
        write_manifest(d, build_manifest(
            kind="onnx", name=model_name, model=model_name, precision="fp32", directory=d, files=[onnx_path],
            inputs=[input_ref("golden", manifest_path(golden_dir, model_name), root)],
            build={"exporter": ecfg.exporter, "opset": ecfg.opset,
                   "dynamic_axes": {k: list(v) for k, v in mcfg.dynamic.items()},
                   "inputs": {k: list(v.shape) for k, v in feeds[0].items()}},
            results=results, **STAGE.identity(cfg, model_name, root)))
    return ExportResult(out / paths.ONNX_FILE, results["parity"], ops)


def main(argv: list[str] | None = None) -> int:
    import time

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        r = run(args.cfg, args.key)
        p = r.parity
        print(f"export@{args.key}: {r.onnx_path} ({r.onnx_path.stat().st_size / 1e6:.1f} MB, "
              f"{sum(r.ops.values())} nodes) in {time.perf_counter() - t0:.1f} s")
        print_parity(p)
        print("  ops: " + ", ".join(f"{k}×{v}" for k, v in r.ops.items()))
        return 0

    return stage.main(STAGE, body, argv, key_help="model name from params.yaml (e.g. embedder)")


def print_parity(p: dict) -> None:
    print(f"  parity vs PyTorch on {p['samples']} golden samples: max |Δ| {p['max_abs']:.2e}, "
          f"cosine min {p['cosine_min']:.7f}")


if __name__ == "__main__":
    sys.exit(main())
