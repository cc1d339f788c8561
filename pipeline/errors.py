"""The one user-facing error type. The CLI prints `kiln: error: <what>` and `hint: <fix>` and exits 2."""

from __future__ import annotations


class KilnError(Exception):
    """An error the user can fix. `hint` says how; no traceback is shown for these."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message + (f" (hint: {self.hint})" if self.hint else "")


class GateFailed(KilnError):
    """A validation or audit gate rejected an artifact; the CLI exits 1 so the DAG stops."""
