"""compile@<engine>: lower one model (ONNX or torch.export program) for one target and precision; audit what runs.

The audit reads the compiled engine and lists compute nodes that fell back from the requested precision (e.g. a
Conv left in float inside an INT8 engine) — the "silent fallback" that passes functional tests and ruins latency.
The target's `fallback_policy` decides whether that warns (recorded in the manifest) or fails the stage.

Reproducibility is proven, not assumed: a target whose compile is cheap (`reproducibility.checked_at_compile`)
is compiled a second time, in a fresh process, in a scratch project (pipeline/scratch.py), and an engine whose
bytes differ fails the stage. Other targets record their claim and how to prove it (`kiln rebuild-check`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import paths, scratch, stage, targets
from pipeline.config import EngineSpec
from pipeline.targets import source_kind
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, read_verified, write_manifest
from pipeline.targets.base import CompileOptions, OpSupport

STAGE = stage.Stage(
    "compile", "pipeline.stages.compile",
    "lower one model for one target and precision; audit fallbacks; prove the build reproducible",
    keys=lambda cfg: list(cfg.engines),
    deps=lambda cfg, key: [cfg.engine(key).source, *(_samples().deps(cfg, cfg.engine(key).model, "calibration")
                                                     if _calibrates(cfg, key) else []),
                           *([paths.tuning(key).as_posix()] if targets.tuned(cfg, key) else [])],
    params=lambda cfg, key: [f"engines.{key}", f"targets.{cfg.engine(key).target}",
                             *(_samples().params(cfg, cfg.engine(key).model) if _calibrates(cfg, key) else [])],
    targets=lambda cfg, key: [cfg.engine(key).target],
    dynamic=lambda cfg, key: [targets.module(cfg.engine(key).target), *([SAMPLES] if _calibrates(cfg, key) else [])],
    outs=lambda cfg, key: [stage.Out(paths.engine(key).as_posix())])

# A program target's int8 engine is calibrated at compile (PT2E) on the stored calibration chips, streamed by
# pipeline.samples. It is loaded by name (`dynamic`), so that only those engines' stages depend on it and its
# imports (the detectors' code, image libraries); every other compile stage's closure stays as narrow as before.
SAMPLES = "pipeline.samples"


def _samples():
    return importlib.import_module(SAMPLES)


def _calibrates(cfg, key: str) -> bool:
    e = cfg.engine(key)
    return source_kind(e.target) == "program" and e.precision == "int8"


@dataclass(frozen=True)
class CompileResult:
    directory: Path
    audit: OpSupport
    reproducibility: dict
    warnings: list[str]


def source_artifact(spec: EngineSpec, root: Path) -> tuple[Path, Path]:
    """The file an engine is compiled from and its manifest, by what the target compiles: the torch.export
    program (program targets), else the FP32 ONNX export or the recipe's INT8 QDQ model."""
    if source_kind(spec.target) == "program":
        d = paths.program(spec.model, root)
        return d / paths.PROGRAM_FILE, manifest_path(d, spec.model)
    if spec.precision == "int8":
        d = paths.quantized(spec.model, spec.recipe, root)
        return d / paths.ONNX_FILE, manifest_path(d, f"{spec.model}-{spec.recipe}")
    d = paths.export(spec.model, root)
    return d / paths.ONNX_FILE, manifest_path(d, spec.model)


def build(cfg, engine_name: str, root: Path, out: Path) -> tuple[list[Path], OpSupport, list[str]]:
    """Compile into `out` and audit; the fallback policy may refuse. No manifest, no reproducibility check."""
    spec = cfg.engine(engine_name)
    targets.check(cfg, [engine_name])
    tcfg = cfg.targets[spec.target]
    if not tcfg.enabled:
        raise KilnError(f"engine {engine_name}: target {spec.target} is disabled in params.yaml",
                        f"set targets.{spec.target}.enabled: true, or drop the engine from `engines:`")
    fp = stage.read_fingerprint(spec.target, root)
    if not fp["available"]:
        raise KilnError(f"engine {engine_name}: {spec.target}: unavailable ({fp['reason']}); not built",
                        "build it on a host that has this toolchain, or drop the engine from `engines:`")
    src, src_manifest = source_artifact(spec, root)
    read_verified(src_manifest)             # the source must be exactly what its manifest says, before use
    target = targets.get(spec.target)
    calibration = _samples().stream(cfg, spec.model, "calibration", root) if _calibrates(cfg, engine_name) else None
    tuning = paths.tuning(engine_name, root) if targets.tuned(cfg, engine_name) else None
    if tuning is not None:
        read_verified(manifest_path(tuning, engine_name))       # the database is what tune@ recorded
    options = CompileOptions(spec.precision, targets.options(cfg, spec.target), calibration, tuning)
    with tempfile.TemporaryDirectory(prefix="kiln-compile-") as work:
        files = target.compile(src, options, out, Path(work))
    audit = target.audit(out, spec.precision)
    warnings = [f"{f['node']} ({f['op']}) runs as {f['runs_as']}" for f in audit.fallback]
    if warnings and tcfg.fallback_policy == "fail":
        raise GateFailed(f"compile@{engine_name}: {len(warnings)} compute nodes fell back from {spec.precision}: "
                         + "; ".join(warnings[:5]), f"fix the quantization recipe, or set targets.{spec.target}"
                         ".fallback_policy: warn to accept it")
    return files, audit, warnings


def run(cfg, engine_name: str, root: Path = Path("."), check: bool = True) -> CompileResult:
    spec = cfg.engine(engine_name)
    target = targets.get(spec.target)
    claim = target.reproducibility
    src, src_manifest = source_artifact(spec, root)
    out = paths.engine(engine_name, root)
    with atomic_dir(out) as d:
        files, audit, warnings = build(cfg, engine_name, root, d)
        repro = {"claim": claim.claim, "basis": claim.basis}
        if check and claim.checked_at_compile:
            with scratch.rebuild(STAGE, cfg, engine_name, root, ("--no-rebuild-check",)) as other:
                built = Path(other) / paths.engine(engine_name)
                # the manifest is written below; compare the engine's files themselves
                differ = [f.name for f in files
                          if not (built / f.relative_to(d)).is_file()
                          or (built / f.relative_to(d)).read_bytes() != f.read_bytes()]
                accepted = target.accept_rebuild(d, built, differ) if differ else "bit-identical"
            if accepted is None:
                raise GateFailed(f"compile@{engine_name}: a second build in a fresh process differs in "
                                 f"{', '.join(differ)}; {spec.target} claims {claim.claim} builds",
                                 f"classify the difference: kiln rebuild-check compile@{engine_name}")
            repro["checked"] = f"compile: second build in a fresh process, scratch project: {accepted}"
        else:
            repro["checked"] = (f"not at compile; prove it with `kiln rebuild-check compile@{engine_name}`"
                                if check else "not checked (a rebuild-check's own build)")
        extras = target.manifest_extras(d)
        write_manifest(d, build_manifest(
            kind="engine", name=engine_name, model=spec.model, target=spec.target, precision=spec.precision,
            directory=d, files=files, inputs=[input_ref(source_kind(spec.target), src_manifest, root),
                                              *([input_ref("tuning", manifest_path(paths.tuning(engine_name, root),
                                                                                   engine_name), root)]
                                                if targets.tuned(cfg, engine_name) else [])],
            build={"options": cfg.targets[spec.target].options, "recipe": spec.recipe,
                   "fallback_policy": cfg.targets[spec.target].fallback_policy, "reproducibility": repro,
                   **extras.get("build", {})},
            results={"audit": audit.summary(), "fallback_warnings": warnings, **extras.get("results", {})},
            **STAGE.identity(cfg, engine_name, root)))
    return CompileResult(out, audit, repro, warnings)


def main(argv: list[str] | None = None) -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-rebuild-check", action="store_true",
                       help="skip the fresh-process rebuild (used by that rebuild itself)")

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        r = run(args.cfg, args.key, check=not args.no_rebuild_check)
        a = r.audit.summary()
        print(f"compile@{args.key}: {r.directory} in {time.perf_counter() - t0:.1f} s; {a['native_nodes']} compute "
              f"nodes native {a['precision']}, {a['fallback_nodes']} fell back; reproducibility: "
              f"{r.reproducibility['claim']} ({r.reproducibility['checked']})")
        for w in r.warnings:
            print(f"  warning: fallback: {w}")
        return 0

    return stage.main(STAGE, body, argv, build=extra, key_help="engine name from params.yaml `engines:`")


if __name__ == "__main__":
    sys.exit(main())
