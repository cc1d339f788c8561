"""export@<model>: PyTorch → ONNX (dynamic batch), checked, shape-inferred, inventoried and proven against golden.

(A model delivered as ONNX — models.<m>.onnx — is imported by import@<model> instead: pipeline/stages/import_.py.)

The exporter is pinned (params `export.exporter`) because only a pinned exporter gives byte-identical files;
tests/models/test_export.py exports twice in fresh processes and compares the bytes. The parity check runs the ONNX in
ONNX Runtime on the golden set and compares with the golden (PyTorch FP32) outputs: beyond `export.parity` the
stage fails and writes nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import models, paths, samples, stage
from pipeline.errors import GateFailed
from pipeline.gates.parity import check_graph, model_deps, parity, print_parity
from pipeline.gates.reference import load_reference
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, write_manifest
from pipeline.models.export import export_onnx
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config


STAGE = stage.Stage(
    "export", "pipeline.stages.export", "PyTorch → ONNX, checked, inventoried, parity-gated against golden",
    keys=lambda cfg: [m for m, spec in cfg.models.items() if spec.factory is not None], deps=model_deps,
    params=lambda cfg, key: [f"models.{key}", "export", *samples.params(cfg, key)],
    dynamic=lambda cfg, key: [*models.factory_modules(cfg.model(key)), *roles.modules(cfg.model(key).samples)],
    outs=lambda cfg, key: [stage.Out(paths.export(key).as_posix())],
    portable=True,
    help="export a model to ONNX, check it and prove parity with the golden outputs")


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    parity: dict
    ops: dict[str, int]


def run(cfg: Config, model_name: str, root: Path = Path(".")) -> ExportResult:
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


if __name__ == "__main__":
    sys.exit(main())
