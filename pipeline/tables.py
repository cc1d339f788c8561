"""What Kiln prints: the one table printer, and `shown`, the one way a string Kiln did not write reaches a terminal.

`markdown`: rows of cells → a Markdown (GitHub) table, via `tabulate`. Numbers are formatted by the caller's
`floatfmt` (default 4 significant digits); None prints as an empty cell, every other cell is `shown` (bounded by
`max_cell`) and `|` inside a cell is escaped, so every table Kiln prints pastes into the README as is.

`shown` (with `first_hidden`) lives in the runtime, kiln_runtime/text.py, since a deployment host prints values
from a release too; it is re-exported here. A reason, an identity label, an actor, a value quoted from a release, a
registry or a user's file can hold ESC sequences, C1 controls, a newline that forges a second output line, or bidi
and format characters: every such character is shown as its visible escape and the result is bounded — shown,
never interpreted, never longer than the caller allows.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from kiln_runtime.text import MAX_SHOWN, first_hidden, shown  # noqa: F401  (re-exported)

MAX_CELL = 500                   # one table cell


def markdown(headers: Sequence[str], rows: Iterable[Sequence[Any]], floatfmt: str = ".4g",
             max_cell: int = MAX_CELL) -> str:
    from tabulate import tabulate

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return format(v, floatfmt)
        return shown(v, max_cell).replace("|", "\\|")

    return tabulate([[cell(v) for v in r] for r in rows], headers=list(headers), tablefmt="github",
                    disable_numparse=True)
