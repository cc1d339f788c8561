"""The shadow rollout's command line (kiln_runtime/shadow.py): `kiln-run serve`'s --shadow options, and

    kiln-run shadow-report LOG [--json FILE]     the shadow log summarised: frames, agreement counts, both p99s
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln_runtime.errors import KilnError


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share of the requests, above 0 and at most 1 (e.g. 0.1)")
    return v


def _count(high: int):
    def parse(text: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number from 1 to {high}")
        return int(text)
    return parse


def serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shadow rollout (a candidate run beside production, never answering)")
    g.add_argument("--shadow", metavar="CANDIDATE", help="a candidate system release (archive or OCI reference), "
                   "verified like ARCHIVE, run on a sampled share of the identify requests; its faces, identities "
                   "and decisions are compared with production's and logged")
    g.add_argument("--shadow-key", metavar="K.pub", help="the candidate's publisher key (default: --key)")
    g.add_argument("--shadow-log", metavar="FILE", help="the shadow log (JSON lines; appended to when it is this "
                   "pair's): needed with --shadow")
    g.add_argument("--shadow-share", type=_share, default=0.1, metavar="F", help="share of the requests the "
                   "candidate also runs (0.1)")
    g.add_argument("--shadow-workers", type=_count(64), default=1, metavar="N", help="the candidate's worker "
                   "processes, at nice +10 (1)")
    g.add_argument("--shadow-queue", type=_count(10000), default=8, metavar="N", help="candidate frames waiting or "
                   "running; past it a sampled frame is skipped and counted (8)")


def shadow_settings(args):
    """serve's --shadow options as ShadowSettings, or None; one line for options that make no sense together."""
    from kiln_runtime.serve import ShadowSettings

    given = [f"--{k.replace('_', '-')}" for k in ("shadow_key", "shadow_log") if getattr(args, k)]
    if not args.shadow:
        if given:
            raise KilnError(f"{given[0]} without --shadow CANDIDATE", "add --shadow CANDIDATE, or drop the option")
        return None
    if not args.shadow_log:
        raise KilnError("--shadow needs --shadow-log FILE: the log is the shadow's record (kiln-run shadow-report "
                        "reads it)", "add --shadow-log FILE")
    return ShadowSettings(Path(args.shadow), Path(args.shadow_key or args.key), Path(args.shadow_log),
                          args.shadow_share, args.shadow_workers, args.shadow_queue)


def cmd_report(args) -> int:
    from kiln_runtime import shadow

    header, records = shadow.read_log(Path(args.log))
    s = shadow.summarize(header, records)
    for line in shadow.report_lines(s):
        print(line)
    if args.json:
        from kiln_runtime.files import write_json

        write_json(Path(args.json), s)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("shadow-report", help="summarise a shadow log: frames compared, agreement on faces, "
                       "identities and decisions, both systems' p50/p99")
    p.add_argument("log", metavar="LOG", help="the file kiln-run serve --shadow-log wrote")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    p.set_defaults(func=cmd_report)


__all__ = ["add_parser", "serve_args", "shadow_settings"]
