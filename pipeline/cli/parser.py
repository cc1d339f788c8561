"""`kiln`'s parser and dispatch: the stage commands (found by name: pipeline/dagtools/catalog.py), `dag` and `deps`
(pipeline/dagtools/dag.py's own CLIs), and COMMANDS — one module each, which owns its arguments and a thin `run`.

A stage subcommand (`kiln export embedder`) runs the stage module's own CLI — exactly what dvc.yaml runs as
`python -m pipeline.stages.export embedder` — so the DAG never depends on this package. The other commands parse,
call a pure core, print, and set the exit code. Every command module is a few imports: the core each `run` calls is
imported inside it, so `kiln --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from pipeline.cli import (targets, identify, compare, mixed, verify, provenance, keygen, release, verify_release,
                          push, report, plan, lock_classes, rebuild_check, promote, rollback, history,
                          register_system, re_enroll, gallery_compat, validate_release, profile, registry,
                          upgrade_report)
from pipeline.dagtools import catalog
from pipeline.stage import printable_streams, report_errors

# `kiln --help` lists them in this order; each module: NAME, HELP, arguments(parser), run(args) -> exit code
COMMANDS = (targets, identify, compare, mixed, verify, provenance, keygen, release, verify_release, push, report, plan,
            lock_classes, rebuild_check, promote, rollback, history, register_system, re_enroll, gallery_compat,
            validate_release, upgrade_report, profile, registry)
FORWARDED = {"dag": "render dvc.yaml from the stage declarations (--check: fail if stale; --write: rewrite)",
             "deps": "one stage's dependencies: its derived code closure and its data (e.g. kiln deps "
                     "compile@embedder-ort-cpu-int8)"}


def build_parser(stages: list[catalog.Declared] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Reproducible face-recognition artifact builds.")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="parameters file (params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for d in catalog.declared() if stages is None else stages:   # dispatched before parsing (main); listed for --help
        sub.add_parser(d.name, help=(d.help or d.desc) + " [stage]", description=(d.help or d.desc) + " [stage]")
    for name, help_text in FORWARDED.items():                      # the same: their own CLIs parse their arguments
        sub.add_parser(name, help=help_text, description=help_text)
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        command.arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    printable_streams()                 # before argparse prints anything (--help, a usage error)
    argv = list(sys.argv[1:] if argv is None else argv)
    # Stage commands, `dag` and `deps` take their own arguments (the module's CLI): forward them as they are.
    i, forward = 0, []
    if argv[:1] == ["--params"] and len(argv) > 1:
        i, forward = 2, argv[:2]
    elif argv[:1] and argv[0].startswith("--params="):
        i, forward = 1, argv[:1]
    command, rest = (argv[i] if i < len(argv) else None), argv[i + 1:]
    stages = catalog.declared()
    try:
        if command in (names := {d.name: d for d in stages}):
            return importlib.import_module(names[command].module).main(forward + rest)
        if command in ("dag", "deps"):
            from pipeline.dagtools import dag

            return (dag.main if command == "dag" else dag.deps_main)(forward + rest)
        args = build_parser(stages).parse_args(argv)
        return report_errors(lambda: args.func(args))
    except BrokenPipeError:      # `kiln … | head`: the reader left; stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
