"""register@<engine> and register-index@<size>: the registry edge of the DAG (pipeline/registry/).

A stage runs when its artifact or verdict changed, not on every `dvc repro`: registration is idempotent by
content, and what it writes (artifacts/registry/<name>/receipt.json + manifest) names the registered content only,
the same in every clone. The version number and the tracking URI are this registry's facts: they go to the
stage's record (pipeline/registry/receipts.py). A new or lost registry is filled again by `kiln registry sync`
(every built, validated artifact: pipeline/registry/sync.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, stage
from pipeline.errors import GateFailed
from pipeline.gates import benchgate
from pipeline.registry import registration as reg
from pipeline.registry.receipts import print_receipt, write_receipt

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "register", "pipeline.stages.register",
    "log + register the validated engine in MLflow (idempotent by content; a new version becomes `candidate`)",
    keys=lambda cfg: list(cfg.engines),
    deps=lambda cfg, key: [paths.engine(key).as_posix(), paths.validation(key).as_posix(),
                           benchgate.path(cfg.engine(key).model, key).as_posix()],
    params=lambda cfg, key: ["register.experiment"],
    outs=lambda cfg, key: [stage.Out(paths.receipt(key).as_posix(), cache=False)],
    help="register a validated engine in MLflow (idempotent by content); new → 'candidate'")


def run(cfg: Config, engine_name: str, root: Path = Path("."), allow_failed: bool = False,
        host_class: str | None = None) -> reg.Receipt:
    """Register the engine with its bench verdict and its bench rows, keyed by the host class they were measured on
    (`host_class`; default the bench report's): the same content from another class adds that class's rows."""
    art = reg.engine_registrable(cfg, engine_name, root, host_class)
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


def main(argv: list[str] | None = None) -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--allow-failed", action="store_true",
                       help="register an engine whose validation failed (no alias; promote refuses it)")

    def body(args, run_) -> int:
        r = run(args.cfg, args.key, allow_failed=args.allow_failed)
        print_receipt(f"register@{args.key}", r, run_)
        if r.host_class_added:
            print(f"  added the bench rows of host class {r.host_class_added} to {r.name} v{r.version}")
        if (gate := benchgate.check(args.cfg, args.key)) == benchgate.NOT_FASTER:
            print(f"  bench verdict {gate}: an INT8 engine not faster than its FP32 sibling on this host class; "
                  "registered, but `kiln promote` refuses it")
        return 0

    return stage.main(STAGE, body, argv, build=extra, key_help="engine name from params.yaml `engines:`")


if __name__ == "__main__":
    sys.exit(main())
