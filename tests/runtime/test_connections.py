"""kiln_runtime/connections.py: the bounds uvicorn leaves out, on a real uvicorn server over loopback (a small
Starlette app stands in for the face system: the bounds are the protocol's, whatever the app does; the served system
meets them in tests/release/test_system_release.py). Small configured bounds: a second or so per case."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from contextlib import contextmanager

from kiln_runtime.connections import Bounds, protocol


@contextmanager
def server(bounds: Bounds):
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def echo(request: Request):
        return JSONResponse({"bytes": len(await request.body())})

    async def slow(request: Request):
        import asyncio

        await asyncio.sleep(0.5)
        return JSONResponse({"bytes": len(await request.body())})

    events: dict[str, int] = {}
    live: dict = {}

    def count(name: str) -> None:
        events[name] = events.get(name, 0) + 1

    app = Starlette(routes=[Route("/healthz", health), Route("/echo", echo, methods=["POST"]),
                            Route("/slow", slow, methods=["POST"])])
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            timeout_keep_alive=bounds.keep_alive_s, http=protocol(bounds, count, live))
    srv = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port, events, live
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        sock.close()


def _healthz(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return r.status


def _read_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except OSError:                   # reset, or the timeout: what came is the answer
        pass
    return data


def test_a_head_that_does_not_arrive_in_time_is_cut_with_408():
    with server(Bounds(header_timeout_s=0.5, body_timeout_s=5, max_connections=64)) as (port, events, live):
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for i, s in enumerate(slow):      # half send part of a head, half nothing at all
            if i % 2:
                s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        assert _healthz(port) == 200
        t0 = time.monotonic()
        answers = [_read_all(s, 5) for s in slow]
        waited = time.monotonic() - t0
        assert all(a.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 0.5 s" in a for a in answers), answers[:2]
        assert waited < 4, waited                              # cut at the bound, not held (bound 0.5 s)
        assert events == {"header_timeout": 20} and len(live) == 0
        for s in slow:
            s.close()


def test_a_body_that_does_not_arrive_in_time_is_cut_with_408_and_a_keep_alive_request_restarts_the_clock():
    with server(Bounds(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=64)) as (port, events, _):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
        got = _read_all(s, 5)
        assert got.startswith(b"HTTP/1.1 408 ") and b"body did not arrive within 0.5 s" in got, got[:200]
        s.close()
        k = socket.create_connection(("127.0.0.1", port))     # a keep-alive client: each request is bounded anew
        for _ in range(3):
            k.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            k.settimeout(5)
            assert k.recv(65536).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.3)                                     # idle within keep-alive, under the head bound
        k.close()
        assert events == {"body_timeout": 1}


def test_past_the_connection_limit_the_oldest_idle_or_slow_connection_makes_room_and_health_is_answered():
    """300 connections that never finish their heads against a limit of 16: every /healthz on a new connection is
    answered at once; the slow ones are closed oldest first (503: too many connections), the count stays bounded."""
    with server(Bounds(header_timeout_s=30, body_timeout_s=30, max_connections=16)) as (port, events, live):
        slow = []
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHo")
            slow.append(s)
            if i % 50 == 49:
                assert _healthz(port) == 200 and len(live) <= 16 + 2
        assert _healthz(port) == 200
        assert events.get("evicted", 0) >= 300 - 16 and "refused" not in events, events
        first = _read_all(slow[0], 2)
        assert first.startswith(b"HTTP/1.1 503 ") and b"more than 16 connections are open" in first, first[:200]
        for s in slow:
            s.close()


def test_an_answer_before_the_body_closes_the_connection():
    """A request answered before its body arrived (here: /healthz never reads it) would leave the connection open,
    unbounded and never evictable once the body trickled in: it is closed after the answer instead."""
    with server(Bounds(header_timeout_s=5, body_timeout_s=5, max_connections=64)) as (port, _, live):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n")
        got = _read_all(s, 3)
        assert got.startswith(b"HTTP/1.1 200 ") and b'"ok"' in got, got      # answered, then closed (EOF)
        s.close()
        time.sleep(0.1)
        assert len(live) == 0


def test_pipelined_requests_are_answered_in_order_and_never_evicted_meanwhile():
    """Two requests sent back to back on one connection: while the first is answered, the connection holds answers
    owed and is not closed to make room, however many connections arrive."""
    with server(Bounds(header_timeout_s=5, body_timeout_s=5, max_connections=8)) as (port, events, _):
        p = socket.create_connection(("127.0.0.1", port))
        one = b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        p.sendall(one + one.replace(b"abc", b"abcd").replace(b"Length: 3", b"Length: 4"))
        time.sleep(0.1)
        crowd = []
        for _ in range(30):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"GET /healthz HTTP/1.1\r\nHo")
            crowd.append(c)
        got = b""
        p.settimeout(5)
        while got.count(b"HTTP/1.1 200 ") < 2:
            chunk = p.recv(65536)
            assert chunk, (got, events)
            got += chunk
        assert got.index(b'"bytes":3') < got.index(b'"bytes":4'), got
        assert events.get("evicted", 0) >= 30 - 8 - 1
        for c in crowd + [p]:
            c.close()
