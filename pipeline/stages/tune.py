"""tune@<engine>: search kernel schedules for one engine of a tunable target (tvm: MetaSchedule); the schedule
database is the artifact.

Tuning measures candidate kernels on this host, so its database is not a function of its inputs the way an engine
is: it is the expensive, cached step whose result compile@<engine> applies deterministically. DVC keys it by what
it searched — the engine's ONNX source, the target's params (buckets, threads, mcpu, `tuning.trials` …) and the
target's toolchain fingerprint (`rebuild_on`: TVM, LLVM, the CPU) — so a toolchain or budget change searches
again and anything else reuses it. A stage exists only for engines with `tuning.trials` > 0 (0 = untuned).
`artifacts/tuning/<engine>/` holds the database files beside their manifest (what was searched, trials, records).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, stage, targets
from pipeline.toolchain import read_fingerprint
from pipeline.errors import KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, read_verified, write_manifest

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "tune", "pipeline.stages.tune",
    "search kernel schedules for one engine (MetaSchedule, within its trial budget); the database is the artifact",
    keys=lambda cfg: [e for e in cfg.engines if targets.tuned(cfg, e)],
    deps=lambda cfg, key: [cfg.engine(key).source],
    params=lambda cfg, key: [f"engines.{key}", f"targets.{cfg.engine(key).target}"],
    targets=lambda cfg, key: [cfg.engine(key).target],
    dynamic=lambda cfg, key: [targets.module(cfg.engine(key).target)],
    outs=lambda cfg, key: [stage.Out(paths.tuning(key).as_posix())],
    help="search kernel schedules for a tunable engine (tvm: MetaSchedule); the database is cached")


def run(cfg: Config, engine_name: str, root: Path = Path(".")) -> tuple[Path, dict]:
    spec = cfg.engine(engine_name)
    targets.check(cfg, [engine_name])
    if not targets.tuned(cfg, engine_name):
        raise KilnError(f"engine {engine_name}: nothing to tune ({spec.target} does not tune, or its "
                        "tuning.trials is 0)", f"set targets.{spec.target}.tuning.trials > 0")
    fp = read_fingerprint(spec.target, root)
    if not fp["available"]:
        raise KilnError(f"engine {engine_name}: {spec.target}: unavailable ({fp['reason']}); not tuned",
                        "tune it on a host that has this toolchain, or set tuning.trials: 0")
    if targets.source_kind(spec.target) != "onnx" or spec.precision == "int8":
        raise KilnError(f"engine {engine_name}: only FP32 ONNX engines are tuned", "set tuning.trials: 0")
    src_dir = paths.export(spec.model, root)
    src_manifest = manifest_path(src_dir, spec.model)
    read_verified(src_manifest)
    target = targets.get(spec.target)
    opts = targets.options(cfg, spec.target)
    out = paths.tuning(engine_name, root)
    with atomic_dir(out) as d, tempfile.TemporaryDirectory(prefix="kiln-tune-") as work:
        files, summary = target.tune(src_dir / paths.ONNX_FILE, opts, d, Path(work))
        write_manifest(d, build_manifest(
            kind="tuning", name=engine_name, model=spec.model, target=spec.target, precision=spec.precision,
            directory=d, files=files, inputs=[input_ref("onnx", src_manifest, root)],
            build={"options": cfg.targets[spec.target].options, "searched": summary.pop("target")},
            results=summary, **STAGE.identity(cfg, engine_name, root)))
    return out, summary


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        t0 = time.perf_counter()
        out, s = run(args.cfg, args.key)
        print(f"tune@{args.key}: {out} in {time.perf_counter() - t0:.0f} s; {s['tasks']} kernels, {s['trials']} "
              f"trials, {s['records']} records")
        return 0

    return stage.main(STAGE, body, argv, key_help="engine name from params.yaml `engines:` (tuning.trials > 0)")


if __name__ == "__main__":
    sys.exit(main())
