"""The service's HTTP connections: uvicorn's httptools protocol with the bounds uvicorn leaves out.

uvicorn closes a keep-alive connection idle past `timeout_keep_alive`, but it has no bound on how long a client may
take to send a request's head or its body, and its only connection bound (`limit_concurrency`) answers every request
503 once reached — health probes included. A client that opens connections and sends a byte a minute could hold them
all. `protocol(bounds, events)` is uvicorn's protocol class with:

- a **head bound**: a request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the request's first byte; past it, 408 and the connection is closed;
- a **body bound**: the body must arrive within `body_timeout_s` of the head; past it, 408 and closed;
- a **connection limit**: past `max_connections` open connections, a new one is still accepted and a connection
  that holds no request being answered is closed to make room — an idle keep-alive one first, else the one stalled
  longest in its head or its body (503 where a request had begun). So a probe's `/healthz` is answered while the
  limit is reached: it sends its request at once and is never the one stalled longest. Only when every connection
  has a request being answered (the frames queue bounds those) and `reserve` more are open is a new one closed at
  once.

A response that completes before its request's body arrived closes the connection (its remaining bytes are never
read); a pipelined request's head is bounded from the moment the answer before it completes, and nothing is written
on a connection while an earlier answer on it is owed.

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
        phase = HEAD                   # of the newest request: its head, its body, answering it, or idle
        since = 0.0                    # when that phase began (eviction: the longest stalled first)
        owed = 0                       # requests whose head arrived and whose response is not complete
        timer = None

        # ------------------------------------------------------------------ the phases of a request
        def connection_made(self, transport) -> None:      # noqa: ANN001 — asyncio's signature
            super().connection_made(transport)
            self._phase(HEAD)
            self._arm(bounds.header_timeout_s, "header_timeout", late_head)
            live[self] = None
            if len(live) > bounds.max_connections:
                self._make_room()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self.phase != HEAD:                        # the next request's first byte
                self._phase(HEAD)
                if self.owed == 0:                        # pipelined behind an answer: armed when that completes
                    self._arm(bounds.header_timeout_s, "header_timeout", late_head)

        def on_headers_complete(self) -> None:
            self.owed += 1
            self._phase(BODY)
            self._arm(bounds.body_timeout_s, "body_timeout", late_body)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._phase(ANSWERING)
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self.owed = max(0, self.owed - 1)
            if self.owed == 0:
                if self.phase == BODY:                    # answered before its body came (a 413, say): no reuse
                    self._disarm()
                    self.transport.close()
                elif self.phase == ANSWERING:
                    self._phase(IDLE)                     # uvicorn arms its keep-alive timer
                elif self.phase == HEAD:                  # a pipelined request's head, now bounded
                    self._arm(bounds.header_timeout_s, "header_timeout", late_head)
            super().on_response_complete()

        def connection_lost(self, exc) -> None:            # noqa: ANN001 — asyncio's signature
            self._disarm()
            live.pop(self, None)
            super().connection_lost(exc)

        # ------------------------------------------------------------------ bounds
        def _phase(self, phase: str) -> None:
            self.phase, self.since = phase, self.loop.time()

        def _arm(self, seconds: float, event: str, answer: bytes) -> None:
            self._disarm()
            self.timer = self.loop.call_later(seconds, self._expire, event, answer)

        def _disarm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def evictable(self) -> bool:
            """Holding no answer: idle, or the only request owed is still arriving (its head or its body)."""
            return not self.transport.is_closing() and (
                self.owed == 0 or (self.owed == 1 and self.phase == BODY and not self._started()))

        def _started(self) -> bool:
            cycle = self.cycle
            return cycle is not None and cycle.response_started

        def _close(self, event: str, answer: bytes | None) -> None:
            """Close, with `answer` written first when no response on this connection is owed but this one."""
            if self.transport.is_closing():
                return
            events(event)
            self._disarm()
            if self.phase == BODY and self.scope is not None:    # the app reading the body: cut, not a hang-up
                self.scope.setdefault("state", {})[CUT] = event
            if answer is not None and self.evictable():
                self.transport.write(answer)
            self.transport.close()

        def _expire(self, event: str, answer: bytes) -> None:
            self.timer = None
            if not self.evictable():       # an earlier answer is still being sent: bound this one after it
                self._arm(bounds.body_timeout_s if event == "body_timeout" else bounds.header_timeout_s, event,
                          answer)
                return
            self._close(event, answer)

        def _make_room(self) -> None:
            idle = [c for c in live if c is not self and c.phase == IDLE and c.evictable()]
            stalled = [c for c in live if c is not self and c.phase in (HEAD, BODY) and c.evictable()]
            if idle or stalled:
                victim = min(idle, key=lambda c: c.since) if idle else min(stalled, key=lambda c: c.since)
                victim._close("evicted", None if victim.phase == IDLE else full)
            elif len(live) > bounds.max_connections + bounds.reserve:
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
