"""validate@'s verdict on one engine: gate it on the face task (pipeline/gates/evaluate.py) once its files verify,
and write validation.json with a manifest (kind "validation") binding it to the engine's identity digest. Used by
validate@ on a built engine and by `kiln validate-release` on a downloaded registered version."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import engines, paths, samples, targets
from pipeline.errors import KilnError
from pipeline.gates.evaluate import NOT_RUN, Verdict, evaluate
from pipeline.manifest import (atomic_dir, build_manifest, identity_digest, input_ref, manifest_path, read_manifest,
                               read_verified, write_json_atomic, write_manifest)

if TYPE_CHECKING:
    from pipeline.config import Config


def judge(cfg: Config, engine_name: str, engine_dir: Path, engine_ref: dict, out: Path, root: Path = Path("."), *,
          declaration) -> Verdict:
    """Gate the engine in `engine_dir` (verified before it is loaded) and write validation.json + its manifest to
    `out`, atomically. `engine_ref` is how the manifest names the engine (a path here; a registry version when
    `kiln validate-release` judges a downloaded one). An engine this host cannot run gets `not-run`. `declaration` is
    validate@'s stage declaration (its `STAGE`): the manifest records its identity (code, params, toolchain)."""
    spec = cfg.engine(engine_name)
    golden_manifest = manifest_path(paths.golden(spec.model, root), spec.model)
    read_verified(golden_manifest, fast=True)
    mpath = manifest_path(engine_dir, engine_name)
    if identity_digest(read_manifest(mpath)) != engine_ref["xxh3_128"]:
        raise KilnError(f"{engine_dir}: not the engine {engine_ref.get('manifest')} names", "validate it again")
    runnable, why = targets.get(spec.target).runnable(engine_dir)
    if runnable:
        runner = engines.load(spec.target, engine_dir, engine_name)        # verifies the files it loads
        metrics, failures, limits, extra = evaluate(cfg, engine_name, runner, root)
        verdict = "fail" if failures else "pass"
    else:
        read_verified(mpath, fast=True)          # not loaded, but a not-run verdict is still about these bytes
        metrics, failures, limits, extra, verdict = {}, [], {}, {"not_run": why}, NOT_RUN
    metrics = {k: round(v, 7) if isinstance(v, float) else v for k, v in metrics.items()}
    report = {"engine": engine_name, "verdict": verdict, "failures": failures,
              "metrics": metrics, "limits": limits, "engine_manifest_xxh3_128": engine_ref["xxh3_128"], **extra}
    with atomic_dir(out) as d:
        write_json_atomic(d / paths.VALIDATION_FILE, report)
        inputs = [engine_ref, input_ref("golden", golden_manifest, root)]
        inputs += samples.role(cfg, spec.model).gate_inputs(cfg, spec.model, root)
        write_manifest(d, build_manifest(
            kind="validation", name=engine_name, model=spec.model, target=spec.target, precision=spec.precision,
            directory=d, files=[d / paths.VALIDATION_FILE], inputs=inputs, build={"gate": "face-task"},
            results={"verdict": verdict, "failures": failures, **extra},
            **declaration.identity(cfg, engine_name, root)))
    return Verdict(engine_name, verdict == "pass", metrics, failures, verdict, extra.get("not_run", ""))
