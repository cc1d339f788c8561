"""bench@<model>: latency, throughput, cold start and memory of every engine of a model, side by side.

All engines of the model and the PyTorch eager model ("the model just runs") are measured in one process,
interleaved in rounds so machine noise hits them alike; ratios come from that one run. Cold start (verified load +
session creation + first inference) and memory are measured in a fresh process per engine. Outputs are DVC metrics
with `cache: false` (timings are records of one run: never restored from the run cache, and declared
non-reproducible in the README), with a manifest binding them to the engines' and verdicts' digests, and the host
class they were measured on (toolchain.host_class). An INT8 engine must beat its FP32 sibling on the same target by
`bench.int8_min_speedup` with confidence (pipeline/gates/timing.py `int8_decision`: the median per-round ratio ≥ the
margin, and the rounds' spread < margin − 1 or every round ≥ the margin); one that does not is `not-faster-here`
on this host class — printed, not a DAG failure: it stays registrable, is never a leaderboard winner, and
promote says so in the move's record.

Each engine's verdict is also written alone, without timings, to `gate/<engine>.json` (DVC-cached): the engine's
and its verdict's digests (and the FP32 sibling's, for an INT8 engine), the gate applied, pass / not-faster-here /
not-run. That file is what `register@<engine>` depends on, so a bench rerun with the same verdicts, or another
engine added to the model (another host's target), stales no registration.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import models, paths, stage, targets
from pipeline.gates import benchgate
from pipeline.gates.timing import ROUNDS, BenchResult, measure_model, table
from pipeline.manifest import build_manifest, input_ref, manifest_path, write_json_atomic, write_manifest
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config


def _engines(cfg: Config, model: str) -> list:
    return cfg.engines_of(model)


STAGE = stage.Stage(
    "bench", "pipeline.stages.bench",
    "every engine of the model + PyTorch eager, interleaved in one run; timings are records (never cached)",
    keys=lambda cfg: [m for m in cfg.models if cfg.engines_of(m)],
    deps=lambda cfg, key: [*models.weight_deps(cfg.model(key)),
                           *(paths.engine(e.name).as_posix() for e in _engines(cfg, key)),
                           *(paths.validation(e.name).as_posix() for e in _engines(cfg, key))],
    params=lambda cfg, key: ["bench", f"models.{key}"],
    dynamic=lambda cfg, key: [*models.factory_modules(cfg.model(key)),
                              *sorted({targets.module(e.target) for e in _engines(cfg, key)}),
                              *roles.modules(cfg.model(key).samples)],
    # cached, like every output a later stage reads: a host that adds an engine of another model pulls this record
    # for the leaderboard (`dvc repro --pull`); an uncached output exists only on the host that made it
    outs=lambda cfg, key: [stage.Out((paths.bench(key) / paths.BENCH_FILE).as_posix(), kind="metrics"),
                           stage.Out(manifest_path(paths.bench(key), key).as_posix()),
                           stage.Out(benchgate.directory(key).as_posix())],
    help="benchmark every engine of a model side by side with PyTorch eager")


def run(cfg: Config, model_name: str, root: Path = Path("."), progress=print) -> BenchResult:
    """The bench stage: measure, then write artifacts/bench/<model>/bench.json + its manifest (never cached) and
    each engine's verdict alone (gate/<engine>.json + the gate's manifest, cached)."""
    result = measure_model(cfg, model_name, root, progress)
    d = paths.bench(model_name, root)
    write_json_atomic(d / paths.BENCH_FILE, result.report)
    inputs = []
    for e in _engines(cfg, model_name):
        inputs.append(input_ref(f"engine:{e.name}", manifest_path(paths.engine(e.name, root), e.name), root))
        inputs.append(input_ref(f"validation:{e.name}", manifest_path(paths.validation(e.name, root), e.name), root))
    write_manifest(d, build_manifest(
        kind="bench", name=model_name, model=model_name, directory=d, files=[d / paths.BENCH_FILE], inputs=inputs,
        build={"rounds": ROUNDS, "timings": "one run's record: not reproducible, not cached"},
        results={"verdict": result.report["verdict"], "failures": result.failures,
                 "not_faster_here": sorted(n for n, x in result.report.get("int8", {}).items()
                                           if x["verdict"] == benchgate.NOT_FASTER)},
        **STAGE.identity(cfg, model_name, root)))
    verdicts = {e.name: "not-run" if e.name in result.report["not_run"] else
                result.report["engines"][e.name].get("bench_gate", "pass") for e in _engines(cfg, model_name)}
    benchgate.write(cfg, model_name, verdicts, inputs, STAGE.identity(cfg, model_name, root), root)
    return result


def main(argv: list[str] | None = None) -> int:
    from pipeline.errors import GateFailed

    def body(args, run_) -> int:
        r = run(args.cfg, args.key)
        print(table(r.report, args.cfg.bench.batches))
        for name, why in r.report["not_run"].items():
            print(f"  {name}: built only, not timed — {why}")
        print(f"host class: {r.report['host_class']}")
        for name, x in r.report.get("int8", {}).items():
            per_batch = ", ".join(f"b{b} {d['ratio']:.3f}× spread {d['spread']:.3f}" + (f" ({d['why']})" if d["why"]
                                                                                          else "")
                                  for b, d in x["batches"].items())
            print(f"  {name} vs {x['fp32_sibling']}: {per_batch} — needs {x['rule']} → {x['verdict']}")
        if r.failures:
            raise GateFailed("; ".join(r.failures), "change the quantization recipe or drop the INT8 engine")
        return 0

    return stage.main(STAGE, body, argv, key_help="model name from params.yaml (e.g. embedder)")


if __name__ == "__main__":
    sys.exit(main())
