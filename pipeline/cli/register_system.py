"""`kiln register-system`: register a version of a face system (kiln-system-NAME) from system@NAME's output: every
engine pinned by registered version and identity digest, thresholds, preprocessing and the system verdict
(idempotent by content; each engine must be registered)"""

from __future__ import annotations

import argparse

from pipeline.cli.common import load_cfg

NAME = "register-system"
HELP = ("register a version of a face system (kiln-system-NAME) from system@NAME's output: every engine pinned "
        "by registered version and identity digest, thresholds, preprocessing and the system verdict (idempotent "
        "by content; each engine must be registered)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="system name from params.yaml `systems:`")
    p.add_argument("--allow-failed", action="store_true",
                   help="register a system whose gate failed (no alias; promote refuses it)")


def run(args) -> int:
    from pipeline.registry import systems
    from pipeline.tables import shown

    r = systems.register_system(load_cfg(args), args.name, allow_failed=args.allow_failed)
    print(f"register-system: {'registered new version' if r.new else 'already registered as'} {r.name} v{r.version} "
          f"(system gate {shown(r.verdict, 40)}; sha256 {r.sha256[:12]}) at {shown(r.tracking_uri)}")
    for p in r.parts:
        print(f"  {p.model:<9} {p.registered_model} v{p.version}  manifest {p.xxh3_128}")
    return 0
