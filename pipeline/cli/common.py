"""What several `kiln` commands share: the params file, and how alias moves are checked and printed."""

from __future__ import annotations

import sys

from pipeline.errors import KilnError


def load_cfg(args):
    """params.yaml (or --params), validated: every command that reads the config loads it here."""
    from pipeline import config

    return config.load(args.params)


MAX_REASON = 500       # characters of a `--reason`: one sentence, stored in the registry, replayed by `kiln history`

SYSTEM_HELP = ("NAME is a face system (params.yaml `systems:`), registered as kiln-system-NAME by kiln "
               "register-system: its version and every part move together")
RE_ENROLL_HELP = ("a system whose embedder cannot read the production gallery (re-enroll required) is moved, "
                  "relying on the re-enrolment `kiln re-enroll --system NAME VERSION` recorded (in the history)")
FORCE_HELP = ("an engine that a production face system pins at another version: move its own alias anyway "
              "(needs --reason; recorded). What production runs is still the system's pin")


def check_reason(args) -> str | None:
    """`--reason`, refused at the edge when it could not be shown as typed: longer than MAX_REASON, or holding a
    control, format or line-separator character (an ESC sequence, an OSC 8 link, a newline, a bidi override); so
    what the registry stores prints as typed. What a registry already holds is escaped when printed."""
    from pipeline.tables import first_hidden, shown

    reason = args.reason
    if reason is not None and len(reason) > MAX_REASON:
        raise KilnError(f"--reason is {len(reason)} characters; at most {MAX_REASON} are recorded",
                        f"say why in one sentence (≤ {MAX_REASON} characters); link a ticket for the rest")
    if reason is not None and (bad := first_hidden(reason)) is not None:
        raise KilnError(f"--reason holds the control or format character {bad}: {shown(reason, 80)}",
                        "use plain text: no escape sequences, newlines, tabs or bidi characters")
    return reason


def print_move(m) -> None:
    from pipeline.tables import shown

    # the reason and actor come from the registry (and a user): escaped, bounded (+ the note promote may add)
    reason, actor = shown(m.reason, MAX_REASON + 300), shown(m.actor, 100)
    if m.action == "retire":
        print(f"retire: {m.name}@{m.alias} v{m.from_version} removed ({reason})")
        return
    if not m.changed:
        print(f"{m.action}: {m.name}@{m.alias} is already v{m.to_version}; nothing moved")
        return
    was = f"v{m.from_version}" if m.from_version is not None else "none"
    print(f"{m.action}: {m.name}@{m.alias} {was} → v{m.to_version} by {actor} at {shown(m.at, 40)} ({reason})")


def is_system(args) -> bool:
    """Whether NAME is a face system: `--system NAME`, or its registered name kiln-system-NAME."""
    return args.system or args.name.startswith("kiln-system-")


def print_system_move(s) -> None:
    from pipeline.tables import shown

    if s.compat is not None:
        print(f"gallery-compat: {shown(s.compat.summary(), 1000)}")
    if getattr(s, "shadow", None):
        print(f"shadow: {shown(s.shadow, 1000)}")
    for line in getattr(s, "upgrades", ()):
        print(shown(line, 1000))
    for m in (*s.parts, *s.retired, s.system):
        print_move(m)


def no_force(args) -> None:
    if args.force:
        raise KilnError("--force moves one engine past the production system that pins it; a system move is gated "
                        "as a whole", "drop --force")


def warn_forged(forged: list[str]) -> None:
    """Registry tags that say other than the run's record: one loud line each (the record is what was shown)."""
    from pipeline.tables import shown

    for line in forged:                  # it quotes the edited tag: escaped, bounded
        print(f"kiln: WARNING: {shown(line, 400)} — the tag was edited in the registry; shown: the record",
              file=sys.stderr)
