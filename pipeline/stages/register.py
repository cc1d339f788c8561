"""register@<engine> and register-index@<size>: the registry edge of the DAG (pipeline/registry/).

A stage runs when its artifact or verdict changed, not on every `dvc repro`: registration is idempotent by
content, and what it writes (artifacts/registry/<name>/receipt.json + manifest) names the registered content only,
the same in every clone. The version number and the tracking URI are this registry's facts: they go to the
stage's record. A new or lost registry is filled again by `kiln registry sync` (every built, validated artifact).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline import benchgate, paths, stage
from pipeline.errors import GateFailed
from pipeline.manifest import atomic_dir, build_manifest, input_ref, write_json_atomic, write_manifest
from pipeline.registry import registration as reg

RECEIPT_FILE = "receipt.json"

STAGE = stage.Stage(
    "register", "pipeline.stages.register",
    "log + register the validated engine in MLflow (idempotent by content; a new version becomes `candidate`)",
    keys=lambda cfg: list(cfg.engines),
    deps=lambda cfg, key: [paths.engine(key).as_posix(), paths.validation(key).as_posix(),
                           benchgate.path(cfg.engine(key).model, key).as_posix()],
    params=lambda cfg, key: ["register.experiment"],
    outs=lambda cfg, key: [stage.Out(paths.receipt(key).as_posix(), cache=False)])

def write_receipt(cfg, spec: stage.Stage, key: str, art: reg.Registrable, receipt: reg.Receipt, root: Path) -> Path:
    out = paths.receipt(art.name, root)
    with atomic_dir(out) as d:
        write_json_atomic(d / RECEIPT_FILE, {"kind": art.kind, **receipt.content()})
        write_manifest(d, build_manifest(
            kind="registration", name=art.name, directory=d, files=[d / RECEIPT_FILE],
            inputs=[input_ref(art.kind, art.manifest_file, root), input_ref("validation", art.verdict_manifest, root)],
            build={"registry": "mlflow"}, results={"verdict": receipt.verdict}, **spec.identity(cfg, key, root)))
    return out


def run(cfg, engine_name: str, root: Path = Path("."), allow_failed: bool = False) -> reg.Receipt:
    art = reg.engine_registrable(cfg, engine_name, root)
    gate = benchgate.check(cfg, engine_name, root)          # None: its model was not benched here
    if gate == "fail" and not allow_failed:
        raise GateFailed(f"{engine_name}: its bench gate failed (an INT8 engine not faster than its FP32 sibling: "
                         f"{paths.bench(art.tags['model'], root) / paths.BENCH_FILE}); not registered",
                         "change the quantization recipe or drop the engine, or register it deliberately with "
                         "--allow-failed (no alias)")
    art.tags["bench_gate"] = gate or "not benched here"
    receipt = reg.register(cfg, art, root, allow_failed)
    write_receipt(cfg, STAGE, engine_name, art, receipt, root)
    return receipt


def sync(cfg, root: Path = Path("."), progress=print) -> list[reg.Receipt]:
    """Register every built, validated engine and chosen index (idempotent): what a new or lost registry needs.
    Artifacts not built here, or whose verdict is a failure, are reported and skipped."""
    out = []
    jobs = [(e, lambda e=e: run(cfg, e, root), reg.engine_registrable(cfg, e, root)) for e in cfg.engines]
    from pipeline.stages.register_index import run_index

    jobs += [(paths.gallery_name(s), lambda s=s: run_index(cfg, s, root), reg.index_registrable(cfg, s, root))
             for s in cfg.matching.gallery_sizes]
    for name, job, art in jobs:
        if not art.manifest_file.is_file() or not art.verdict_manifest.is_file():
            progress(f"registry sync: {name}: not built or not validated here; skipped")
            continue
        try:
            r = job()
        except GateFailed as e:
            progress(f"registry sync: {name}: not registered: {e.message}")
            continue
        progress(f"registry sync: {name}: {'registered new version' if r.new else 'already registered as'} "
                 f"{r.name} v{r.version}{_REPAIRED if r.repaired else ''}")
        out.append(r)
    return out


_REPAIRED = "; its interrupted registration was completed (alias and history)"


def print_receipt(label: str, r: reg.Receipt, run_: stage.Run) -> None:
    run_.record.update(registered_model=r.name, version=r.version, tracking_uri=r.tracking_uri, new=r.new)
    state = "registered new version" if r.new else "already registered as version"
    alias = {"pass": ", alias candidate", "not-run": ", alias built: promotable once a host with the runtime "
             f"passes it (kiln validate-release {r.name} {r.version})"}.get(r.verdict, "") if r.new else ""
    alias += _REPAIRED if r.repaired else ""
    print(f"{label}: {state} {r.name} v{r.version} (sha256 {r.sha256[:12]}…, validation {r.verdict}{alias}) "
          f"in {r.tracking_uri}")


def main(argv: list[str] | None = None) -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--allow-failed", action="store_true",
                       help="register an engine whose validation failed (no alias; promote refuses it)")

    def body(args, run_) -> int:
        print_receipt(f"register@{args.key}", run(args.cfg, args.key, allow_failed=args.allow_failed), run_)
        return 0

    return stage.main(STAGE, body, argv, build=extra, key_help="engine name from params.yaml `engines:`")


if __name__ == "__main__":
    sys.exit(main())
