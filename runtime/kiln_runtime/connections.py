"""The service's HTTP connections: uvicorn's httptools protocol with the bounds uvicorn leaves out.

uvicorn closes a keep-alive connection idle past `timeout_keep_alive`, but it has no bound on how long a client may
take to send a request's head or its body, and its only connection bound (`limit_concurrency`) answers every request
503 once reached — health probes included. A client that opens connections and sends a byte a minute could hold them
all. `protocol(bounds, events)` is uvicorn's protocol class with:

- a **head bound**: a request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the request's first byte; past it, 408 and the connection is closed;
- a **body bound**: the body must arrive within `body_timeout_s` of the head; past it, 408 and closed;
- a **connection limit**: past `max_connections` open connections, a new one is still accepted and the oldest
  connection that holds no request being answered is closed to make room — an idle keep-alive one first, then one
  still sending its head, then one still sending its body (503 where a request had begun). So a probe's `/healthz`
  is answered while the limit is reached: it sends its request at once and is never the one closed. Only when every
  connection has a request being answered (the frames queue bounds those) and `reserve` more are open is a new one
  closed at once.

Every timeout, eviction and refusal is counted (`events(name)`: /metrics) and never logged as a trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

HEAD, BODY, ANSWERING, IDLE = "head", "body", "answering", "idle"
CUT = "kiln.cut"               # scope["state"] key: the bound that closed a request whose body the app was reading


@dataclass(frozen=True)
class Bounds:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    keep_alive_s: float = 5.0           # uvicorn's timeout_keep_alive: an idle keep-alive connection is closed

    @property
    def reserve(self) -> int:
        """Connections allowed past the limit when none can be closed to make room (every one is being answered)."""
        return max(8, self.max_connections // 8)


def _raw(status: int, phrase: str, error: str, hint: str) -> bytes:
    body = json.dumps({"error": error, "hint": hint}).encode("utf-8")
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode("ascii") + body


def protocol(bounds: Bounds, events: Callable[[str], None], live: dict | None = None) -> type:
    """uvicorn's httptools protocol class with `bounds` (this module's docstring). `live`: the open connections,
    oldest first (a dict used as an ordered set; /metrics reads its size)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    live = {} if live is None else live
    late_head = _raw(408, "Request Timeout", f"the request's head did not arrive within {bounds.header_timeout_s:g} s",
                     "send the request line and headers at once")
    late_body = _raw(408, "Request Timeout", f"the request's body did not arrive within {bounds.body_timeout_s:g} s",
                     "send the whole body at once; for a slow link, a smaller image")
    full = _raw(503, "Service Unavailable", f"more than {bounds.max_connections} connections are open",
                "retry shortly; reuse one connection for many requests")

    class Bounded(HttpToolsProtocol):
        phase = HEAD
        timer = None

        # ------------------------------------------------------------------ the phases of a request
        def connection_made(self, transport) -> None:      # noqa: ANN001 — asyncio's signature
            super().connection_made(transport)
            self.phase = HEAD
            self._arm(bounds.header_timeout_s, "header_timeout", late_head)
            live[self] = None
            if len(live) > bounds.max_connections:
                self._make_room()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self.phase != HEAD:                        # a keep-alive connection's next request: its first byte
                self.phase = HEAD
                self._arm(bounds.header_timeout_s, "header_timeout", late_head)

        def on_headers_complete(self) -> None:
            self.phase = BODY
            self._arm(bounds.body_timeout_s, "body_timeout", late_body)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self.phase = ANSWERING
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if self.phase == ANSWERING:
                self.phase = IDLE
            super().on_response_complete()

        def connection_lost(self, exc) -> None:            # noqa: ANN001 — asyncio's signature
            self._disarm()
            live.pop(self, None)
            super().connection_lost(exc)

        # ------------------------------------------------------------------ bounds
        def _arm(self, seconds: float, event: str, answer: bytes) -> None:
            self._disarm()
            self.timer = self.loop.call_later(seconds, self._expire, event, answer)

        def _disarm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def _answering(self) -> bool:
            cycle = self.cycle
            return cycle is not None and not cycle.response_complete and cycle.response_started

        def _close(self, event: str, answer: bytes | None) -> None:
            """Close, with `answer` written first when no response to this request has begun."""
            if self.transport.is_closing():
                return
            events(event)
            self._disarm()
            if self.phase == BODY and self.scope is not None:    # the app reading the body: cut, not a hang-up
                self.scope.setdefault("state", {})[CUT] = event
            if answer is not None and not self._answering():
                self.transport.write(answer)
            self.transport.close()

        def _expire(self, event: str, answer: bytes) -> None:
            self.timer = None
            self._close(event, answer)

        def _make_room(self) -> None:
            for phase, answer in ((IDLE, None), (HEAD, full), (BODY, full)):
                victim = next((c for c in live if c is not self and c.phase == phase
                               and not c.transport.is_closing()), None)
                if victim is not None:
                    victim._close("evicted", answer)
                    return
            if len(live) > bounds.max_connections + bounds.reserve:
                self._close("refused", full)

    return Bounded


def open_files_for(bounds: Bounds, workers: int) -> int:
    """File descriptors the service may need: every connection (and the reserve), two per worker, and room for the
    files and libraries it opens."""
    return bounds.max_connections + bounds.reserve + 4 * workers + 256


def raise_open_files(needed: int) -> int:
    """Raise this process's soft limit on open files towards `needed` (up to the hard limit); the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft


__all__ = ["CUT", "Bounds", "open_files_for", "protocol", "raise_open_files"]
