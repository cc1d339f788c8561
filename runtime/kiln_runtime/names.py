"""The one rule for names that become paths or printed labels, shared by the build (pipeline/paths.py) and the
runtime: a slug is 1-64 characters from letters, digits, '-' and '_', starting with a letter or digit (never empty,
`.`/`..`, a separator or a dot). An identity (a gallery label: what identify prints) is a slug other than the words
identify prints in a name's place, so no label can hold a newline, a terminal escape or a bidi character."""

from __future__ import annotations

import re

from kiln_runtime.errors import KilnError

SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
NOT_IDENTITIES = ("unknown", "distractor")      # what identify prints for no match and for a FAISS distractor


def is_slug(name: object) -> bool:
    return isinstance(name, str) and SLUG.fullmatch(name) is not None


def slug(name: object, what: str = "name") -> str:
    """`name` if it is a safe path component, else a KilnError naming it."""
    if not is_slug(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:79] + "…"      # never echo unbounded input
        raise KilnError(f"{what} {shown} is not a valid name",
                        "use 1-64 letters, digits, '-' or '_', starting with a letter or digit (no '/', '.', spaces)")
    return name  # type: ignore[return-value]


def is_identity(name: object) -> bool:
    return is_slug(name) and name not in NOT_IDENTITIES
