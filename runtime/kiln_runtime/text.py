"""`shown`: the one way a string Kiln did not write reaches a terminal, on the build and on a deployment host alike
(pipeline/tables.py re-exports it next to the table printer).

A reason, an identity label, an actor, a value quoted from a release, a registry or a user's file can hold ESC
sequences (colours, cursor moves, OSC 8 links, window titles), C1 controls, a newline that forges a second output
line, or bidi and format characters that make text read otherwise than it is. Every character of Unicode categories
Cc, Cf, Cs, Zl and Zp — C0 and C1 controls, DEL, ESC, U+200B–U+200F, U+202A–U+202E, U+2066–U+2069, U+FEFF, lone
surrogates, U+2028/U+2029 — is replaced by its visible escape (`\\x1b`, `\\u202e`) and the result is bounded with an
ellipsis: shown, never interpreted, never longer than the caller allows.
"""

from __future__ import annotations

import unicodedata

MAX_SHOWN = 200                  # characters of one untrusted value on one output line, unless the caller says
_HIDDEN = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))


def _escape(ch: str) -> str:
    if unicodedata.category(ch) not in _HIDDEN:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def first_hidden(text: str) -> str | None:
    """The escape of the first character of `text` that `shown` would escape, None if none."""
    return next((_escape(ch) for ch in text if unicodedata.category(ch) in _HIDDEN), None)


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """`value` as text that prints as itself on one line: every control, format or separator character as its
    escape, at most `limit` characters (an escape is never cut; `…` marks the cut)."""
    text = value if isinstance(value, str) else str(value)
    out: list[str] = []
    used = 0
    for ch in text:                     # stops one piece past the limit: never escapes more than it shows
        out.append(_escape(ch))
        used += len(out[-1])
        if used > limit:
            break
    if used <= limit:
        return "".join(out)
    while out and used > limit - 1:
        used -= len(out.pop())
    return "".join(out) + "…"
