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


def _exit_now(signum, frame) -> None:         # noqa: ARG001 — the signal handler's signature
    import os
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:                     # noqa: BLE001 — a closed or broken stream: exit all the same
            pass
    os._exit(128 + signum)


def _quiet_signals() -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_now)
        signal.signal(signal.SIGTERM, _exit_now)


def exit_quietly() -> None:
    """Once the command is done, a SIGINT or SIGTERM during the interpreter's exit (atexit callbacks: e.g.
    multiprocessing joining its queues' threads) ends the process at once with 130 / 143 and no traceback: its work
    is finished and written (atomically), nothing is left to unwind. Registered last, so it runs first at exit."""
    import atexit

    atexit.unregister(_quiet_signals)
    atexit.register(_quiet_signals)


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
