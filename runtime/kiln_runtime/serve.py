"""`kiln-run serve`: a verified system release as an HTTP service (Starlette on uvicorn).

    POST /v1/identify   an image (JPEG, PNG, BMP or WebP bytes as the body) → its faces: box, score, landmarks,
                        identity ("unknown" past the threshold), nearest, distance; the system and version; per-stage
                        milliseconds. A bad image is a 400, a body over the size bound a 413, a full queue a 503 with
                        Retry-After — each a JSON {"error", "hint"}; never a 500 with a trace.
    GET  /healthz       200 while the process serves
    GET  /readyz        200 only once the archive verified and every engine of every worker warmed; 503 while
                        draining
    GET  /metrics       Prometheus text: request and per-stage latency histograms, frames, faces, batches, errors by
                        reason, queue depth, in-flight requests, process CPU seconds, the release served

The archive is verified once, before the port opens (signature, content: kiln_runtime/release.py); any failure and
the service does not start. Each of `workers` worker processes owns its own copy of the system (its engines with
cores / workers intra-op threads; processes, so the Python glue of one never waits on another's interpreter lock)
and takes up to `max_batch` queued frames at once — ONE embedder call and ONE gallery search for all their faces, as
sysbench@ runs it. The service is bounded: past `queue` frames in it (queued or being run) a request is answered 503
at once instead of growing latency without end. SIGTERM drains: the port closes, /readyz turns 503, requests in
flight finish, the process exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kiln_runtime.errors import KilnError
from kiln_runtime.images import decode_bytes
from kiln_runtime.system import STAGES, Match, System

MAX_BYTES = 20 << 20            # one request body: a 4096-side JPEG is a few MB
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


# ---------------------------------------------------------------------------------------------- answers
def answer(matches: list[Match], release: str, version: int, size: tuple[int, int]) -> dict[str, Any]:
    """One photo's answer, as the service and `kiln-run identify --json` give it."""
    return {"system": release, "version": version, "image": {"width": size[1], "height": size[0]},
            "faces": [{"box": [round(float(v), 2) for v in m.box], "score": round(float(m.score), 5),
                       "landmarks": [] if m.landmarks is None else
                       [[round(float(x), 2), round(float(y), 2)] for x, y in np.asarray(m.landmarks)],
                       "identity": m.identity, "nearest": m.nearest, "distance": round(float(m.distance), 6),
                       "metric": m.metric} for m in matches]}


# ---------------------------------------------------------------------------------------------- metrics
class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        tail = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{tail} {self.sum:.6f}", f"{name}_count{tail} {self.count}"]


class Metrics:
    """What /metrics shows; every update under one lock (worker threads and the event loop both write)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.latency = Histogram()
        self.stages = {s: Histogram() for s in ("decode", *STAGES)}
        self.frames = self.faces = self.batches = 0
        self.inflight = 0

    def count(self, status: int, reason: str | None = None) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            if reason:
                self.errors[reason] = self.errors.get(reason, 0) + 1

    def text(self, release: str, version: int, ready: bool, held: int, cpu_s: float) -> str:
        with self.lock:
            out = ["# HELP kiln_release_info The system release served.", "# TYPE kiln_release_info gauge",
                   f'kiln_release_info{{system="{release}",version="{version}"}} 1',
                   "# HELP kiln_ready 1 once verified and warmed, 0 while starting or draining.",
                   "# TYPE kiln_ready gauge", f"kiln_ready {int(ready)}",
                   "# HELP kiln_requests_total Requests to /v1/identify by HTTP status.",
                   "# TYPE kiln_requests_total counter",
                   *(f'kiln_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())),
                   "# HELP kiln_errors_total Refused or failed identify requests by reason.",
                   "# TYPE kiln_errors_total counter",
                   *(f'kiln_errors_total{{reason="{r}"}} {n}' for r, n in sorted(self.errors.items())),
                   "# HELP kiln_request_duration_seconds Identify requests answered 200: body read to answer.",
                   "# TYPE kiln_request_duration_seconds histogram",
                   *self.latency.lines("kiln_request_duration_seconds"),
                   "# HELP kiln_stage_duration_seconds Time per frame in each stage of the system.",
                   "# TYPE kiln_stage_duration_seconds histogram",
                   *(ln for s, h in self.stages.items() for ln in h.lines("kiln_stage_duration_seconds",
                                                                           f'stage="{s}"')),
                   "# HELP kiln_frames_total Frames identified.", "# TYPE kiln_frames_total counter",
                   f"kiln_frames_total {self.frames}",
                   "# HELP kiln_faces_total Faces found.", "# TYPE kiln_faces_total counter",
                   f"kiln_faces_total {self.faces}",
                   "# HELP kiln_batches_total Batches the workers ran (frames / batches = mean batch).",
                   "# TYPE kiln_batches_total counter", f"kiln_batches_total {self.batches}",
                   "# HELP kiln_queue_depth Frames in the service: queued or being run (--queue bounds it).",
                   "# TYPE kiln_queue_depth gauge", f"kiln_queue_depth {held}",
                   "# HELP kiln_inflight_requests Identify requests being answered.",
                   "# TYPE kiln_inflight_requests gauge", f"kiln_inflight_requests {self.inflight}",
                   "# HELP process_cpu_seconds_total CPU time of the service: this process and its workers' batches.",
                   "# TYPE process_cpu_seconds_total counter", f"process_cpu_seconds_total {cpu_s:.6f}"]
        return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- the workers
READY_TIMEOUT_S = 120.0


class BadImage(KilnError):
    """A request body that is not an image this service reads: its client's error (400)."""


def _worker(tree: str, threads: int, max_batch: int, jobs, results) -> None:
    """A worker process: load the verified tree's system (each engine verified again as it loads), warm it, say
    ready, then run batches of up to `max_batch` queued frames until told to stop (None). The server stops it:
    SIGINT and SIGTERM are ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from kiln_runtime import release

    try:
        system = release.load(Path(tree), threads=threads).system
        warm(system)
        results.put(("ready", os.getpid(), None))
    except BaseException as e:  # noqa: BLE001 — the server reports it as one line
        results.put(("error", os.getpid(), f"{type(e).__name__}: {str(e)[:300]}"))
        return
    parent = os.getppid()
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:           # the server was killed (SIGKILL): do not linger as an orphan
                return
            continue
        if job is None:
            return
        batch = [job]
        while len(batch) < max_batch:
            try:
                nxt = jobs.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                jobs.put(None)                   # this worker's stop, taken after the batch
                break
            batch.append(nxt)
        cpu0, timings, frames = time.process_time(), {}, []
        t0 = time.perf_counter()
        for jid, body in batch:                  # decoded here, beside the system: 100 kB over the pipe, not 1 MB
            try:
                frames.append((jid, decode_bytes(body, "request body")))
            except KilnError as e:
                results.put(("bad", os.getpid(), (jid, e.message, e.hint)))
        timings["decode"] = (time.perf_counter() - t0) * 1e3
        if not frames:
            continue
        ids = [jid for jid, _ in frames]
        try:
            found = system.identify_frames([rgb for _, rgb in frames], timings)
        except KilnError as e:
            results.put(("failed", os.getpid(), (ids, e.message, e.hint)))
            continue
        except Exception as e:  # noqa: BLE001 — one failed batch is its requests' 500s; the service goes on
            results.put(("failed", os.getpid(), (ids, f"{type(e).__name__}: {str(e)[:200]}", "see the service's log")))
            continue
        results.put(("done", os.getpid(), (ids, found, [rgb.shape[:2] for _, rgb in frames], timings,
                                           time.process_time() - cpu0)))


class Service:
    """`workers` worker processes, each with its own copy of the system (no interpreter lock shared between them),
    fed by one queue; at most `limit` frames in the service at once (waiting or being run): past it, `submit` raises
    queue.Full and the request is answered 503."""

    def __init__(self, tree: Path, release: str, version: int, workers: int, threads: int, max_batch: int,
                 limit: int) -> None:
        import multiprocessing as mp

        self.release, self.version, self.limit = release, version, limit
        self.metrics = Metrics()
        self.ready = self.draining = False
        self.worker_cpu = 0.0
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.lock = threading.Lock()
        self.next_id = 0
        ctx = mp.get_context("spawn")                # no fork after ONNX Runtime threads exist
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(str(tree), threads, max_batch, self.jobs, self.results),
                                  daemon=True) for _ in range(workers)]
        self.collector: threading.Thread | None = None
        try:
            for w in self.procs:
                w.start()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.collector = threading.Thread(target=self._collect, daemon=True, name="kiln-collector")
        self.collector.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for _ in self.procs:
            while True:
                try:
                    kind, pid, info = self.results.get(timeout=0.5)
                    break
                except queue.Empty:
                    if dead := next((w for w in self.procs if not w.is_alive()), None):
                        raise KilnError(f"a worker exited (code {dead.exitcode}) while loading the system",
                                        "check the release loads: kiln-run identify ARCHIVE --key K.pub PHOTO; a "
                                        "worker killed by the OS may have run out of memory") from None
                    if time.monotonic() > deadline:
                        raise KilnError(f"a worker did not load the system within {READY_TIMEOUT_S:.0f} s",
                                        "check the release loads: kiln-run identify ARCHIVE --key K.pub PHOTO") \
                            from None
            if kind == "error":
                raise KilnError(f"a worker could not load the system: {info}", "check the release loads: kiln-run "
                                "identify ARCHIVE --key K.pub PHOTO")

    def submit(self, body: bytes) -> concurrent.futures.Future:
        """Queue one frame (the image's bytes: a worker decodes them); queue.Full when `limit` frames are already in
        the service. The future: (matches, per-stage ms, (height, width)), or BadImage / KilnError."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if len(self.pending) >= self.limit:
                raise queue.Full
            jid, self.next_id = self.next_id, self.next_id + 1
            self.pending[jid] = done
        self.jobs.put((jid, body))
        return done

    def held(self) -> int:
        with self.lock:
            return len(self.pending)

    def _collect(self) -> None:
        """Hand each worker's answers to the requests waiting for them; a worker that died fails what is pending
        and makes the service unready (a supervisor restarts it)."""
        m = self.metrics
        while True:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.draining and any(not w.is_alive() for w in self.procs):
                    self.ready = False
                    with self.lock:
                        lost, self.pending = list(self.pending.values()), {}
                    for f in lost:
                        f.set_exception(KilnError("a worker process died", "restart the service"))
                continue
            if msg is None:
                return
            kind, _, info = msg
            if kind == "bad":
                jid, message, hint = info
                with self.lock:
                    fut = self.pending.pop(jid, None)
                if fut is not None:
                    fut.set_exception(BadImage(message, hint))
                continue
            if kind == "failed":
                ids, message, hint = info
                with self.lock:
                    futures = [self.pending.pop(i, None) for i in ids]
                for f in futures:
                    if f is not None:
                        f.set_exception(KilnError(message, hint))
                continue
            ids, found, shapes, timings, cpu = info
            share = {st: ms / len(ids) for st, ms in timings.items()}
            with m.lock:
                self.worker_cpu += cpu
                m.batches += 1
                m.frames += len(ids)
                m.faces += sum(len(f) for f in found)
                for _ in ids:
                    for st, ms in share.items():
                        if st in m.stages:
                            m.stages[st].observe(ms / 1e3)
            with self.lock:
                futures = [self.pending.pop(i, None) for i in ids]
            for fut, f, shape in zip(futures, found, shapes):
                if fut is not None:
                    fut.set_result((f, share, shape))

    def stop(self) -> None:
        """Stop the workers (each finishes its batch), then the collector; nothing left for the exit to wait on."""
        for _ in self.procs:
            self.jobs.put(None)
        deadline = time.monotonic() + 10
        for w in self.procs:
            if w.pid is not None:
                w.join(timeout=max(0.0, deadline - time.monotonic()))
                if w.is_alive():
                    w.terminate()
                    w.join(timeout=5)
        if self.collector is not None:
            self.results.put(None)
            self.collector.join(timeout=5)
        for q in (self.jobs, self.results):
            q.cancel_join_thread()
            q.close()


def warm(system: System) -> None:
    """Every engine's first call made (zeros of each graph's input) and the whole path once on a grey frame."""
    spec = system.spec
    sizes = {"pnet": 48, "rnet": 24, "onet": 48}
    for model, run in zip(spec.detector_graphs, system.nets):
        side = sizes.get(model, 64)
        run(np.zeros((1, 3, side, side), np.float32))
    if system.warp is not None:
        system.warp(np.zeros((1, 3, 64, 64), np.float32),
                    np.array([[[1, 0, 0], [0, 1, 0]]], np.float32))
    system.embed(np.zeros((1, 3, spec.chip_size, spec.chip_size), np.float32))
    system.identify_frames([np.full((120, 160, 3), 127, np.uint8)], {})


# ---------------------------------------------------------------------------------------------- the app
def app(service: Service, max_bytes: int = MAX_BYTES):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    m = service.metrics

    def refuse(status: int, reason: str, error: str, hint: str, **headers: str) -> JSONResponse:
        m.count(status, reason)
        return JSONResponse({"error": error, "hint": hint}, status_code=status, headers=headers or None)

    async def identify(request: Request) -> Response:
        t0 = time.perf_counter()
        with m.lock:
            m.inflight += 1
        try:
            size = request.headers.get("content-length")
            if size is not None and (not size.isdigit() or int(size) > max_bytes):
                return refuse(413, "too_large", f"request body of {size[:20]} bytes; the limit is {max_bytes}",
                              "send a smaller image (longest side ≤ 4096 is plenty for face detection)")
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    return refuse(413, "too_large", f"request body over {max_bytes} bytes",
                                  "send a smaller image (longest side ≤ 4096 is plenty for face detection)")
            if not body:
                return refuse(400, "bad_image", "empty request body", "POST the image's bytes as the body")
            if service.draining:
                return refuse(503, "draining", "the service is shutting down", "retry on another replica",
                              **{"Retry-After": "1"})
            try:
                done = service.submit(bytes(body))
            except queue.Full:
                return refuse(503, "overloaded", f"{service.limit} frames are already in the service",
                              "retry shortly, or add replicas", **{"Retry-After": "1"})
            try:
                found, share, shape = await asyncio.wrap_future(done)
            except BadImage as e:
                return refuse(400, "bad_image", e.message, e.hint)
            except KilnError as e:
                return refuse(500, "engine", e.message, e.hint)
            except Exception as e:  # noqa: BLE001 — one line, no trace; the service keeps serving
                return refuse(500, "internal", f"{type(e).__name__}: {str(e)[:200]}", "see the service's log")
            doc = answer(found, service.release, service.version, shape)
            doc["timings_ms"] = {s: round(v, 3) for s, v in share.items()}
            m.count(200)
            with m.lock:
                m.latency.observe(time.perf_counter() - t0)
            return JSONResponse(doc)
        finally:
            with m.lock:
                m.inflight -= 1

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ok = service.ready and not service.draining
        return JSONResponse({"ready": ok, "system": service.release, "version": service.version},
                            status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(m.text(service.release, service.version, service.ready and not service.draining,
                                        service.held(), time.process_time() + service.worker_cpu),
                                 media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/v1/identify", identify, methods=["POST"]), Route("/healthz", healthz),
                             Route("/readyz", readyz), Route("/metrics", metrics)])


def serve(archive: Path, key: Path, host: str, port: int, workers: int, max_batch: int, queue_size: int,
          max_bytes: int = MAX_BYTES, say=print) -> int:
    """Verify, load `workers` copies, warm them, serve until SIGTERM (drain, exit 0) or Ctrl-C."""
    import uvicorn

    from kiln_runtime import release
    from kiln_runtime.loadtest import cores

    t0 = time.perf_counter()
    threads = max(1, cores() // workers)
    with release.verified(archive, key) as (tree, checked), _listening(host, port) as sock:
        first = release.layout(tree)                  # refused here, in one line, before any worker starts
        service = Service(tree, first.name, first.version, workers, threads, max_batch, queue_size)
        service.ready = True
        say(f"kiln-run: {first.name} v{first.version} verified ({len(checked)} checks) and warmed: {workers} "
            f"worker process(es) × {threads} thread(s) per engine, in {time.perf_counter() - t0:.2f} s; serving on "
            f"http://{host}:{port}", flush=True)

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:       # noqa: ANN001 — uvicorn's signature
                service.draining = True
                if sig == signal.SIGTERM and not self.should_exit:
                    self.should_exit = True                  # drain, then return: exit 0 (uvicorn would re-raise)
                    return
                super().handle_exit(sig, frame)

        config = uvicorn.Config(app(service, max_bytes), host=host, port=port, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=30, lifespan="off")
        server = _Server(config)
        try:
            server.run(sockets=[sock])
        finally:
            service.draining = True
            service.stop()
    say(f"kiln-run: drained ({service.metrics.frames} frames served); bye", flush=True)
    return 0


@contextmanager
def _listening(host: str, port: int) -> Iterator[socket.socket]:
    """The service's socket, bound before anything loads: a port in use or an address not on this host is one line
    at once, not a log line after the workers started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))                     # reserved; uvicorn listens once the workers are ready
    except OSError as e:
        sock.close()
        raise KilnError(f"cannot listen on {host}:{port} ({e.strerror or e})",
                        "pick a free port with --port, or an address of this host with --host") from None
    try:
        yield sock
    finally:
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["MAX_BYTES", "Service", "answer", "app", "free_port", "serve", "warm"]
