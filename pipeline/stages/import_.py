"""import@<model>: a user's ONNX file (models.<m>.onnx) → the FP32 graph at artifacts/export/<m>, like export@.

For a model delivered as ONNX this stage replaces export@: the same output (model.onnx + a manifest of kind `onnx`),
so calibrate@, quantize@, compile@, validate@ and bench@ treat it like an exported model. What it does
(pipeline/onnx_import.py): sha256 pins (the file and every external-data file) and onnx.checker, structural fixes
that change no value, weight-only nodes folded to FP32, the declared input size and layout and the role's output
rank checked (an NHWC input gets a Transpose in front), a fixed batch of 1 made dynamic, strict shape inference, the
op inventory recorded, every ONNX target the model has engines for asked which ops it cannot run
(pipeline/opsupport.py: any → one error naming them per target; the answers and the versions asked go to the run's
record, never into the output: a portable stage must not follow one target's toolchain, and a target that loses an
op after an upgrade fails in its own compile@); then the same parity gate as export@ (params
`export.parity`) against golden@<model> — ONNX Runtime on the original file with graph optimizations off.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from pipeline import onnx_import, opsupport, paths, samples, stage, targets
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, write_manifest
from pipeline.gates.parity import check_graph, model_deps, parity
from pipeline.gates.reference import load_reference, source_inputs
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config


def onnx_models(cfg: Config) -> list[str]:
    return [m for m, spec in cfg.models.items() if spec.onnx is not None]


STAGE = stage.Stage(
    "import", "pipeline.stages.import_",
    "a user's ONNX file: pinned, made runnable, weights folded to FP32, dynamic batch, checked, parity-gated",
    keys=onnx_models,
    deps=model_deps,
    params=lambda cfg, key: [f"models.{key}", "export.parity", *samples.params(cfg, key)],
    dynamic=lambda cfg, key: roles.modules(cfg.model(key).samples),
    outs=lambda cfg, key: [stage.Out(paths.export(key).as_posix())],
    portable=True,
    probes=("openvino",),               # opsupport asks it; the answer goes to the run's record, not the manifest
    help="import a model delivered as ONNX: check its pins, make it runnable, prove parity with its golden outputs")


@dataclass(frozen=True)
class ImportResult:
    onnx_path: Path
    report: dict
    parity: dict
    ops: dict[str, int]
    support: dict


def op_support(cfg: Config, model_name: str, onnx_path: Path) -> dict:
    """Each ONNX target this model has engines for, asked which ops it cannot run; any → one error naming them."""
    wanted = sorted({e.target for e in cfg.engines_of(model_name) if targets.source_kind(e.target) == "onnx"})
    support = opsupport.unsupported(onnx_path, wanted)
    bad = {t: ops for t, ops in support.items() if isinstance(ops, list) and ops}
    if bad:
        raise KilnError(f"import@{model_name}: {cfg.model(model_name).onnx.path} has ops these targets cannot run: "
                        + "; ".join(f"{t}: {', '.join(ops)}" for t, ops in bad.items()),
                        f"drop the {', '.join(bad)} engines of {model_name} from params.yaml `engines:`, or replace "
                        "those ops in the model")
    return {t: ("all supported" if v == [] else v) for t, v in support.items()}


def run(cfg: Config, model_name: str, root: Path = Path(".")) -> ImportResult:
    mcfg, ecfg = cfg.model(model_name), cfg.export
    src = root / mcfg.onnx.path
    proto = onnx_import.load_source(mcfg, root)
    imported, report = onnx_import.prepare(proto, mcfg, mcfg.onnx.path, samples.role(cfg, model_name))
    golden_dir = paths.golden(model_name, root)
    feeds = samples.feeds(cfg, model_name, "golden", root)
    _, reference = load_reference(golden_dir)
    out = paths.export(model_name, root)
    with atomic_dir(out) as d:
        onnx_path = d / paths.ONNX_FILE
        onnx.save(imported, str(onnx_path))
        ops, shapes = check_graph(onnx_path)
        support = op_support(cfg, model_name, onnx_path)
        par = parity(onnx_path, feeds, reference)
        max_abs = ecfg.parity.max_abs if mcfg.parity_max_abs is None else mcfg.parity_max_abs
        if not (par["max_abs"] <= max_abs and par["cosine_min"] >= ecfg.parity.min_cosine):
            raise GateFailed(f"import@{model_name}: the imported graph differs from the original beyond tolerance: "
                             f"max |Δ| {par['max_abs']:.3g} (limit {max_abs:g}), min cosine "
                             f"{par['cosine_min']:.7f} (limit {ecfg.parity.min_cosine:g})",
                             "a folded or re-batched node changed values: report it with the file's sha256")
        results = {"parity": {k: (round(v, 9) if isinstance(v, float) else v) for k, v in par.items()},
                   "parity_limits": {"max_abs": max_abs, "min_cosine": ecfg.parity.min_cosine},
                   "ops": ops, "nodes": sum(ops.values()), "outputs": shapes, "import": report,
                   "bytes": {"source": src.stat().st_size, "imported": onnx_path.stat().st_size}}
        write_manifest(d, build_manifest(
            kind="onnx", name=model_name, model=model_name, precision="fp32", directory=d, files=[onnx_path],
            inputs=[*source_inputs(mcfg, root), input_ref("golden", manifest_path(golden_dir, model_name), root)],
            build={"importer": "kiln-onnx-import", "source_sha256": mcfg.onnx.sha256, "opset": report["opset"],
                   "dynamic_axes": {k: list(v) for k, v in mcfg.dynamic.items()},
                   "inputs": {k: list(v.shape) for k, v in feeds[0].items()}},
            results=results, **STAGE.identity(cfg, model_name, root)))
    return ImportResult(out / paths.ONNX_FILE, report, results["parity"], ops, support)


def main(argv: list[str] | None = None) -> int:
    import time

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        from pipeline.toolchain import versions

        r = run(args.cfg, args.key)
        run_.record["op_support"] = {"answers": r.support, "asked": versions(*STAGE.probes)}
        rep = r.report
        print(f"import@{args.key}: {r.onnx_path} ({r.onnx_path.stat().st_size / 1e6:.1f} MB, "
              f"{sum(r.ops.values())} nodes, opset {rep['opset']}) in {time.perf_counter() - t0:.1f} s")
        print(f"  made runnable: {rep['dropped_unfed_inputs']} unfed inputs dropped, "
              f"{rep['unlisted_initializer_inputs']} initializers unlisted from the inputs; folded to FP32: "
              f"{rep['folded'] or 'nothing'}; kept quantized: {rep['kept_quantized'] or 'nothing'}; "
              f"batch made dynamic: {', '.join(rep['batch_made_dynamic']) or 'already'}")
        p = r.parity
        print(f"  parity vs the original file (ONNX Runtime, golden@) on {p['samples']} golden samples: max |Δ| "
              f"{p['max_abs']:.2e}, cosine min {p['cosine_min']:.7f}")
        print("  ops: " + ", ".join(f"{k}×{v}" for k, v in r.ops.items()))
        print("  op support: " + "; ".join(f"{t}: {v}" for t, v in r.support.items()))
        return 0

    return stage.main(STAGE, body, argv, key_help="an ONNX-sourced model from params.yaml (models.<m>.onnx)")


if __name__ == "__main__":
    sys.exit(main())
