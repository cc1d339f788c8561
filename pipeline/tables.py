"""The one table printer: rows of cells → a Markdown (GitHub) table, via `tabulate`.

Numbers are formatted by the caller's `floatfmt` (default 4 significant digits); None prints as an empty cell and
`|` inside a cell is escaped, so every table Kiln prints pastes into the README as is.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def markdown(headers: Sequence[str], rows: Iterable[Sequence[Any]], floatfmt: str = ".4g") -> str:
    from tabulate import tabulate

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v).replace("|", "\\|")

    return tabulate([[cell(v) for v in r] for r in rows], headers=list(headers), tablefmt="github",
                    disable_numparse=True)
