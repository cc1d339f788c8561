"""`kiln gallery-compat`: can CANDIDATE read a gallery PRODUCTION enrolled? probes embedded by the candidate against
the production engine's enrolment of the golden set: top-1 agreement, decision flips, ΔTAR/ΔFAR beside same-engine
probing (exit 1: re-enroll required)"""

from __future__ import annotations

import argparse

from pipeline.cli.common import load_cfg

NAME = "gallery-compat"
HELP = ("can CANDIDATE read a gallery PRODUCTION enrolled? probes embedded by the candidate against the "
        "production engine's enrolment of the golden set: top-1 agreement, decision flips, ΔTAR/ΔFAR beside "
        "same-engine probing (exit 1: re-enroll required)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("candidate", help="embedder engine name (built here)")
    p.add_argument("production", help="the embedder engine that enrolled the gallery")


def run(args) -> int:
    from pipeline.gates import gallery_compat

    c = gallery_compat.compare(load_cfg(args), args.candidate, args.production)
    print(f"gallery-compat: probes embedded by {c.candidate} against a gallery enrolled by {c.production} "
          f"(golden set of {c.model})")
    print(gallery_compat.table(c))
    return 1 if c.failures else 0
