"""The one user-facing error type (kiln_runtime.errors: the deployment side raises the same), and how the build's
processes treat SIGTERM. The CLI prints `kiln: error: <what>` and `hint: <fix>` and exits 2."""

from __future__ import annotations

# one error type, build and runtime
from kiln_runtime.errors import GateFailed, KilnError, deferred_signals  # noqa: F401


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
