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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, scratch, stage, targets
from pipeline.errors import GateFailed
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, write_manifest
from pipeline.roles import registry as roles
from pipeline.targets import source_kind
from pipeline.targets.base import OpSupport
from pipeline.targets.build import SAMPLES, build, calibrates, samples_module, source_artifact

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "compile", "pipeline.stages.compile",
    "lower one model for one target and precision; audit fallbacks; prove the build reproducible",
    keys=lambda cfg: list(cfg.engines),
    deps=lambda cfg, key: [cfg.engine(key).source,
                           *(samples_module().deps(cfg, cfg.engine(key).model, "calibration")
                             if calibrates(cfg, key) else []),
                           *([paths.tuning(key).as_posix()] if targets.tuned(cfg, key) else [])],
    params=lambda cfg, key: [f"engines.{key}", f"targets.{cfg.engine(key).target}",
                             *(samples_module().params(cfg, cfg.engine(key).model) if calibrates(cfg, key) else [])],
    targets=lambda cfg, key: [cfg.engine(key).target],
    dynamic=lambda cfg, key: [targets.module(cfg.engine(key).target),
                              *([SAMPLES, *roles.modules(cfg.model(cfg.engine(key).model).samples)]
                                if calibrates(cfg, key) else [])],
    outs=lambda cfg, key: [stage.Out(paths.engine(key).as_posix())],
    help="compile an engine (model × target × precision), audit it, prove it reproducible")


@dataclass(frozen=True)
class CompileResult:
    directory: Path
    audit: OpSupport
    reproducibility: dict
    warnings: list[str]


def run(cfg: Config, engine_name: str, root: Path = Path("."), check: bool = True) -> CompileResult:
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
