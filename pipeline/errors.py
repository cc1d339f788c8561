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


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI runner's cancel, `kill`, DVC stopping a stage) turned into an exception, so it unwinds through
    the same `finally` / atomic-rename paths as Ctrl-C and nothing is left half-done."""


def _terminated(signum, frame) -> None:       # noqa: ARG001 — the signal handler's signature
    raise Terminated()


def handle_sigterm() -> None:
    """Treat SIGTERM like SIGINT in this process (main thread only; elsewhere Python refuses handlers)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
