"""The one user-facing error type, shared with the build (pipeline/errors.py re-exports it): the CLIs print
`kiln: error: <what>` / `kiln-run: error: <what>` and `hint: <fix>` and exit 2 (1 for a failed gate)."""

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


class deferred_signals:
    """`with deferred_signals():` a short cleanup that must not be cut in half (stopping worker processes): a SIGINT
    or SIGTERM that arrives inside it is held and acts (as KeyboardInterrupt / Terminated, or the default action)
    when the block ends. Main thread only; elsewhere Python refuses handlers and this does nothing."""

    def __enter__(self) -> "deferred_signals":
        import signal
        import threading

        self.got: list[int] = []
        self.old: dict = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, lambda signum, frame: self.got.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for s, handler in self.old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if self.got:
            signal.raise_signal(self.got[0])
