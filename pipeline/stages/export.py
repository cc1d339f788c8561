"""export@<model>: PyTorch → ONNX (dynamic batch), checked, shape-inferred, inventoried and proven against golden.

The exporter is pinned (params `export.exporter`) because only a pinned exporter gives byte-identical files;
tests/test_export.py exports twice in fresh processes and compares the bytes. The parity check runs the ONNX in
ONNX Runtime on the golden set and compares with the golden (PyTorch FP32) outputs: beyond `export.parity` the
stage fails and writes nothing.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from pipeline import models, paths, toolchain
from pipeline.config import Config, ExportConfig, ModelConfig
from pipeline.data import load_set, to_nchw
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, source_info, write_manifest

PARITY_BATCH = 8


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    parity: dict
    ops: dict[str, int]


def export_onnx(model: torch.nn.Module, mcfg: ModelConfig, ecfg: ExportConfig, path: Path) -> None:
    """Write the ONNX graph of `model` with a dynamic batch axis. Deterministic for a pinned exporter."""
    dummy = torch.zeros(2, *mcfg.input_shape)
    output_names = list(getattr(model, "output_names", ["output"]))
    axes = {"input": {0: "batch"}, **{name: {0: "batch"} for name in output_names}}
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice; the choice is pinned
        kwargs = {"external_data": False} if ecfg.exporter == "dynamo" else {}
        torch.onnx.export(model, (dummy,), str(path), dynamo=ecfg.exporter == "dynamo", opset_version=ecfg.opset,
                          input_names=["input"], output_names=output_names, dynamic_axes=axes,
                          do_constant_folding=True, **kwargs)


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


def parity(onnx_path: Path, x: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """ONNX Runtime (CPU) vs the PyTorch reference: max |Δ| and min/mean per-sample cosine."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    got = np.concatenate([sess.run(None, {name: x[i:i + PARITY_BATCH]})[0] for i in range(0, len(x), PARITY_BATCH)])
    cos = np.sum(got * reference, 1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
    return {"max_abs": float(np.abs(got - reference).max()), "cosine_min": float(cos.min()),
            "cosine_mean": float(cos.mean()), "samples": int(len(x))}


def run(cfg: Config, model_name: str, root: Path = Path(".")) -> ExportResult:
    mcfg, ecfg = cfg.model(model_name), cfg.export
    set_dir, golden_dir = paths.data_set("golden", root), paths.golden(model_name, root)
    gset = load_set(set_dir)
    reference = np.load(golden_dir / "embeddings.npy", allow_pickle=False)
    out = paths.export(model_name, root)
    with atomic_dir(out) as d:
        onnx_path = d / "model.onnx"
        export_onnx(models.build(mcfg, root), mcfg, ecfg, onnx_path)
        ops, shapes = check_graph(onnx_path)
        par = parity(onnx_path, to_nchw(gset.chips), reference)
        passed = par["max_abs"] <= ecfg.parity_max_abs and par["cosine_min"] >= ecfg.parity_min_cosine
        if not passed:
            raise GateFailed(f"export@{model_name}: ONNX Runtime differs from PyTorch beyond tolerance: max |Δ| "
                             f"{par['max_abs']:.3g} (limit {ecfg.parity_max_abs:g}), min cosine "
                             f"{par['cosine_min']:.7f} (limit {ecfg.parity_min_cosine:g})",
                             "inspect the exported graph; loosen export.parity only with a reason")
        results = {"parity": {k: (round(v, 9) if isinstance(v, float) else v) for k, v in par.items()},
                   "parity_limits": {"max_abs": ecfg.parity_max_abs, "min_cosine": ecfg.parity_min_cosine},
                   "ops": ops, "nodes": sum(ops.values()), "outputs": shapes}
        write_manifest(d, build_manifest(
            kind="onnx", name=model_name, model=model_name, precision="fp32", directory=d, files=[onnx_path],
            inputs=[input_ref("golden", manifest_path(golden_dir, model_name), root),
                    input_ref("golden_set", manifest_path(set_dir, "golden"), root)],
            toolchain=toolchain.describe("torch", "onnx", "onnxruntime"),
            build={"exporter": ecfg.exporter, "opset": ecfg.opset, "dynamic_axes": {"input": ["batch"]},
                   "input_shape": ["batch", *mcfg.input_shape]},
            source=source_info(root, {"export": cfg.section("export"), "model": cfg.section("models", model_name)}),
            results=results))
    return ExportResult(out / "model.onnx", results["parity"], ops)
