"""`kiln`: one subcommand per stage, plus the commands around the DAG (verify, registry, identify, …).

A stage subcommand (`kiln export embedder`) runs the stage module's own CLI — exactly what dvc.yaml runs as
`python -m pipeline.stages.export embedder` — so the DAG never depends on this package. The other commands parse,
call a pure core, print, and set the exit code.

Exit codes: 0 ok; 1 a gate or verification failed (the DAG must stop; also `promote`/`rollback` refusing a version
whose stored verdict is not pass or whose stored files no longer match their digests); 2 a user error (message +
hint, no traceback).

One module per command (as DVC's dvc/commands/*.py), each with its NAME, HELP, `arguments(parser)` and a thin
`run(args)` over the library that does the work:

    parser.py            the parser (stage commands, `dag`, `deps`, COMMANDS) and `main`
    common.py            what several commands share: the params file, checking and printing alias moves
    targets.py           kiln targets
    identify.py          kiln identify
    compare.py           kiln compare
    mixed.py             kiln mixed
    verify.py            kiln verify
    provenance.py        kiln provenance
    keygen.py            kiln keygen
    release.py           kiln release
    verify_release.py    kiln verify-release
    push.py              kiln push
    report.py            kiln report
    plan.py              kiln plan
    lock_classes.py      kiln lock-classes
    rebuild_check.py     kiln rebuild-check
    promote.py           kiln promote
    rollback.py          kiln rollback
    history.py           kiln history
    register_system.py   kiln register-system
    re_enroll.py         kiln re-enroll
    gallery_compat.py    kiln gallery-compat
    validate_release.py  kiln validate-release
    profile.py           kiln profile
    registry.py          kiln registry
"""

from pipeline.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
