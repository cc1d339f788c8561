"""`kiln-run serve`: a verified system release as an HTTP service (Starlette on uvicorn).

    POST /v1/identify   an image (JPEG, PNG, BMP or WebP bytes as the body) → its faces: box, score, landmarks,
                        identity ("unknown" past the threshold), nearest, distance; the system and version; per-stage
                        milliseconds. Each refusal is a JSON {"error", "hint"}, never a trace: a bad image or another
                        format 400, a body over the size bound 413, an image past the pixel cap 413 (from its header,
                        before any pixel is decoded), a full queue 503 + Retry-After, a frame whose worker died 503 +
                        Retry-After (only that worker's frames), as while no worker is ready, a frame past the time
                        bound 504.
    GET  /healthz       200 while the process serves (also while draining, and at the connection limit)
    GET  /readyz        200 once verified and warmed, while at least one worker is ready and not draining; its JSON
                        says how many workers of how many are ready and how many were replaced
    GET  /metrics       Prometheus text: requests, errors by reason, request and per-stage latency, frames, faces,
                        batches, queue depth, workers ready and replaced, connections and connection events; with a
                        shadow, its frames and agreement counts and both systems' p99
    GET  /v1/shadow     with --shadow CANDIDATE: the shadow's summary so far (kiln_runtime/shadow.py), else 404
    Open Inference Protocol (KServe v2) health and metadata, for gateways and probes that speak it:
    GET  /v2/health/live, /v2/health/ready, /v2, /v2/models/{system}[/versions/{version}][/ready] — the model's
         metadata carries the release version, the archive's sha256, the system's content digest and the embedder's
         engine digest. (Inference stays /v1/identify: an image is not a tensor a gateway should build.)

The archive is verified once, before the port opens (signature, content: kiln_runtime/release.py); any failure and
the service does not start. Its worker processes (kiln_runtime/workers.py) each hold their own copy of the system; a
dead or stuck worker is replaced while the others serve. Connections are bounded (kiln_runtime/connections.py): a
request's head and body must arrive in time, and past the connection limit the oldest connection holding no answer
is closed so health probes are still answered.

Shutdown, as an orchestrator expects (Kubernetes removes a pod's endpoints while it sends SIGTERM, so requests keep
arriving for a few seconds): on SIGTERM /readyz turns 503 at once and everything else is still answered for
`drain_delay_s` (responses then carry `Connection: close`, moving keep-alive clients on); then the port closes,
requests in flight finish (at most `graceful_timeout_s`), the workers stop (at most 10 s) and the process exits 0.
A second SIGTERM skips what is left of the delay; Ctrl-C (SIGINT) drains at once. So terminationGracePeriodSeconds
must exceed drain delay + graceful timeout + 10 s (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import queue
import signal
import socket
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kiln_runtime.connections import CUT, Bounds
from kiln_runtime.errors import KilnError
from kiln_runtime.images import WIRE_MAX_PIXELS
from kiln_runtime.metrics import Metrics
from kiln_runtime.system import Match
from kiln_runtime.shadow import NICE
from kiln_runtime.workers import IDENTIFY, BadImage, Done, NoWorker, Options, Pool, TooSlow, WorkerDied

MAX_BYTES = 20 << 20            # one request body: a 4096-side JPEG is a few MB


@dataclass(frozen=True)
class Settings:
    """Everything `kiln-run serve` takes (checked at the edge, kiln_runtime/cli.py)."""
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1
    max_batch: int = 8
    queue: int = 64
    max_bytes: int = MAX_BYTES
    max_pixels: int = WIRE_MAX_PIXELS       # the CLI's cap on a file is 100 MP
    request_timeout_s: float = 15.0
    bounds: Bounds = Bounds()
    drain_delay_s: float = 5.0
    graceful_timeout_s: float = 30.0
    gallery: Path | None = None              # a live gallery store (made from the release's gallery if missing)
    token: bytes | None = None               # the bearer token gallery writes need (None: writes refused)
    auth_reads: bool = False                 # gallery reads and identify need it too
    allow_runtime_drift: bool = False        # engines outside their runtime requirement, after their golden check
    shadow: "ShadowSettings | None" = None   # a candidate release run beside production (kiln_runtime/shadow.py)


@dataclass(frozen=True)
class ShadowSettings:
    """`--shadow CANDIDATE`: the candidate release (verified as production's is), its log, and its bounds."""
    archive: Path
    key: Path
    log: Path
    share: float = 0.1                       # of the identify requests production answered
    workers: int = 1                         # the candidate's worker processes (nice +10, one thread per engine)
    queue: int = 8                           # candidate frames waiting or running; past it a sampled frame is skipped


# ---------------------------------------------------------------------------------------------- answers
def answer(matches: list[Match], release: str, version: int, size: tuple[int, int]) -> dict[str, Any]:
    """One photo's answer, as the service and `kiln-run identify --json` give it."""
    return {"system": release, "version": version, "image": {"width": size[1], "height": size[0]},
            "faces": [{"box": [round(float(v), 2) for v in m.box], "score": round(float(m.score), 5),
                       "landmarks": [] if m.landmarks is None else
                       [[round(float(x), 2), round(float(y), 2)] for x, y in np.asarray(m.landmarks)],
                       "identity": m.identity, "nearest": m.nearest or None,
                       "distance": None if m.distance != m.distance else round(float(m.distance), 6),   # NaN: none
                       "metric": m.metric} for m in matches]}


# ---------------------------------------------------------------------------------------------- the service
@dataclass(frozen=True)
class ReleaseInfo:
    """What the service tells about the release it serves (/readyz, /metrics, the OIP metadata)."""
    name: str                 # kiln-system-<system>
    version: int
    system: str
    archive_sha256: str
    system_sha256: str
    embedder: dict[str, Any]  # the embedder part: model, engine, registered version, xxh3_128, sha256
    parts: list[dict[str, Any]]


def release_info(tree: Path, archive: Path) -> ReleaseInfo:
    from kiln_runtime import release

    lay = release.layout(tree)
    doc = json.loads((tree / "release.json").read_bytes())
    h = hashlib.sha256()
    with open(archive, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    part = {k: lay.parts[lay.spec.embedder].get(k) for k in ("model", "engine", "version", "xxh3_128", "sha256")}
    return ReleaseInfo(lay.name, lay.version, lay.system_name, "sha256:" + h.hexdigest(), str(doc["system_sha256"]),
                       part, [{k: p.get(k) for k in ("model", "engine", "version", "xxh3_128")}
                              for p in doc["parts"]])


class Service:
    def __init__(self, pool: Pool, info: ReleaseInfo, metrics: Metrics, store=None, policy=None,
                 shadow=None) -> None:
        self.pool, self.info, self.metrics = pool, info, metrics
        self.shadow = shadow                             # kiln_runtime/shadow.py Shadow, or None
        self.store, self.policy = store, policy          # a live gallery (kiln_runtime/gallery.py), or None
        self.store_lock = threading.Lock()
        self.reader = None                               # its read-only connection: reads, /metrics
        if store is not None:
            from kiln_runtime.gallery import Store

            self.reader = Store(store.path, readonly=True)
        self.reader_lock = threading.Lock()
        self.draining = False

    def is_ready(self) -> bool:
        return self.pool.ready > 0 and not self.draining


# ---------------------------------------------------------------------------------------------- the app
def app(service: Service, settings: Settings, live: dict):
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    m, info, pool = service.metrics, service.info, service.pool
    max_bytes = settings.max_bytes
    too_large_hint = "send a smaller image (longest side ≤ 4096 is plenty for face detection)"

    def reply(doc: dict, status: int = 200, **headers: str) -> JSONResponse:
        if service.draining:
            headers["Connection"] = "close"           # keep-alive clients move to another replica
        return JSONResponse(doc, status_code=status, headers=headers or None)

    def refuse(status: int, reason: str, error: str, hint: str, **headers: str) -> JSONResponse:
        m.count(status, reason)
        return reply({"error": error, "hint": hint}, status, **headers)

    async def read_body(request: Request):
        """The request's body (bytes), or the Response refusing it: too large, empty, or its client gone."""
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_bytes):
            return refuse(413, "too_large", f"request body of {size[:20]} bytes; the limit is {max_bytes}",
                          too_large_hint, Connection="close")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    return refuse(413, "too_large", f"request body over {max_bytes} bytes", too_large_hint,
                                  Connection="close")
        except ClientDisconnect:         # hung up mid-body — or cut by a bound (counted as that event)
            if request.scope.get("state", {}).get(CUT) is None:
                print(f"kiln-run: a client hung up after {len(body)} byte(s) of its request body",
                      file=sys.stderr, flush=True)
                m.count(499, "client_disconnected")
            return Response(status_code=499)          # nobody reads it: the connection is gone
        if not body:
            return refuse(400, "bad_image", "empty request body", "POST the image's bytes as the body")
        return bytes(body)

    async def run_frame(body: bytes, kind: str = IDENTIFY):
        """One frame through the workers: their answer (workers.Done), or the Response refusing it."""
        try:
            done = pool.submit(body, kind)
        except queue.Full:
            return refuse(503, "overloaded", f"{pool.limit} frames are already in the service",
                          "retry shortly, or add replicas", **{"Retry-After": "1"})
        except NoWorker as e:
            return refuse(503, "no_worker", e.message, e.hint, **{"Retry-After": "1"})
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), settings.request_timeout_s)
        except BadImage as e:
            return refuse(413, "too_large", e.message, e.hint) if e.too_large else \
                refuse(400, "bad_image", e.message, e.hint)
        except WorkerDied as e:
            return refuse(503, "worker_died", e.message, e.hint, **{"Retry-After": "1"})
        except (TooSlow, asyncio.TimeoutError) as e:
            msg = e.message if isinstance(e, TooSlow) else \
                f"no answer within the service's bound of {settings.request_timeout_s:g} s"
            return refuse(504, "timeout", msg, "send a smaller image, retry, or raise --request-timeout")
        except KilnError as e:
            return refuse(500, "engine", e.message, e.hint)
        except Exception as e:  # noqa: BLE001 — one line, no trace; the service keeps serving
            return refuse(500, "internal", f"{type(e).__name__}: {str(e)[:200]}", "see the service's log")

    gctx = None
    if service.store is not None:
        from kiln_runtime import gallery_api

        gctx = gallery_api.Context(service.store, service.store_lock, service.reader, service.reader_lock,
                                   service.policy, gallery_api.Access(settings.token, settings.auth_reads), read_body,
                                   run_frame, reply, refuse, m.gallery_write)

    async def identify(request: Request) -> Response:
        t0 = time.perf_counter()
        with m.lock:
            m.inflight += 1
        try:
            if gctx is not None and (no := gallery_api.refused(gctx, request, False)) is not None:
                return no
            body = await read_body(request)
            if not isinstance(body, bytes):
                return body
            got = await run_frame(body)
            if not isinstance(got, Done):
                return got
            doc = answer(got.found, info.name, info.version, got.shape)
            doc["timings_ms"] = {s: round(v, 3) for s, v in got.share.items()}
            m.count(200)
            with m.lock:
                m.latency.observe(time.perf_counter() - t0)
            resp = reply(doc)
            if service.shadow is not None:             # after the answer is sent: a put on the candidate's queue
                from starlette.background import BackgroundTask

                resp.background = BackgroundTask(service.shadow.offer, body, got)
            return resp
        finally:
            with m.lock:
                m.inflight -= 1

    def workers() -> dict[str, int]:
        return {"ready": pool.ready, "of": len(pool.slots), "replaced": pool.restarts}

    async def healthz(request: Request) -> Response:
        return reply({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ok = service.is_ready()
        return reply({"ready": ok, "system": info.name, "version": info.version, "draining": service.draining,
                      "workers": workers()}, 200 if ok else 503)

    async def shadow(request: Request) -> Response:
        if service.shadow is None:
            return reply({"error": "no shadow runs here", "hint": "kiln-run serve ARCHIVE --shadow CANDIDATE "
                          "--shadow-log FILE"}, 404)
        return reply(service.shadow.summary())

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(m.text(service, len(live)), media_type="text/plain; version=0.0.4",
                                 headers={"Connection": "close"} if service.draining else None)

    # -- the Open Inference Protocol's health and metadata (KServe v2 REST)
    async def live_(request: Request) -> Response:
        return reply({"live": True})

    async def ready_(request: Request) -> Response:
        return reply({"ready": service.is_ready()}, 200 if service.is_ready() else 503)

    async def server_meta(request: Request) -> Response:
        from kiln_runtime import __version__

        return reply({"name": "kiln-run", "version": __version__, "extensions": []})

    def model(request: Request) -> Response | None:
        """None when the path names this system (and, if given, its version); else the 404 to answer."""
        name, version = request.path_params["name"], request.path_params.get("version")
        if name not in (info.system, info.name) or (version is not None and version not in (str(info.version),
                                                                                            f"v{info.version}")):
            from kiln_runtime.text import shown

            return reply({"error": f"no model {shown(name, 64)}" + (f" version {shown(version, 16)}" if version
                                                                    else "") +
                          f" here; this service runs {info.system} v{info.version}"}, 404)
        return None

    async def model_meta(request: Request) -> Response:
        if (missing := model(request)) is not None:
            return missing
        return reply({"name": info.system, "versions": [str(info.version)], "platform": "kiln-system",
                      "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1]}],
                      "outputs": [{"name": "faces", "datatype": "BYTES", "shape": [-1]}],
                      "parameters": {"registered_model": info.name, "release_version": info.version,
                                     "archive_digest": info.archive_sha256, "system_sha256": info.system_sha256,
                                     "embedder": info.embedder, "parts": info.parts, "infer": "POST /v1/identify"}})

    async def model_ready(request: Request) -> Response:
        if (missing := model(request)) is not None:
            return missing
        return reply({"name": info.system, "ready": service.is_ready()}, 200 if service.is_ready() else 503)

    routes = [Route("/v1/identify", identify, methods=["POST"]), Route("/healthz", healthz),
              Route("/readyz", readyz), Route("/metrics", metrics), Route("/v1/shadow", shadow),
              Route("/v2", server_meta), Route("/v2/health/live", live_), Route("/v2/health/ready", ready_),
              Route("/v2/models/{name}", model_meta), Route("/v2/models/{name}/ready", model_ready),
              Route("/v2/models/{name}/versions/{version}", model_meta),
              Route("/v2/models/{name}/versions/{version}/ready", model_ready)]
    if gctx is not None:
        routes += gallery_api.routes(gctx)
    return Starlette(routes=routes)


# ---------------------------------------------------------------------------------------------- serving
def check_host(host: str) -> str:
    """--host: an address of this host, never '' (which binds every interface without saying so)."""
    text = host.strip("[]")
    if not text:
        raise KilnError("--host '' would listen on every interface without saying so",
                        "pass --host 0.0.0.0 (every IPv4 interface) or --host :: (every interface) to mean it, or an "
                        "address of this host (default 127.0.0.1)")
    return text


def serve(archive: Path, key: Path, settings: Settings, say=print) -> int:
    """Verify, start the workers (each loads and warms its copy), serve until SIGTERM (drain, exit 0) or Ctrl-C."""
    import uvicorn

    from kiln_runtime import connections, release

    t0 = time.perf_counter()
    host = check_host(settings.host)
    needed = connections.open_files_for(settings.bounds, settings.workers)
    if (allowed := connections.raise_open_files(needed)) < needed:
        raise KilnError(f"--max-connections {settings.bounds.max_connections} needs about {needed} open files; this "
                        f"process may open {allowed} (ulimit -n)", "lower --max-connections, or raise the limit "
                        f"(ulimit -n {needed})")
    metrics = Metrics()
    live: dict = {}
    with ExitStack() as stack:
        tree, checked = stack.enter_context(release.verified(archive, key, allow_drift=settings.allow_runtime_drift))
        cand = None if settings.shadow is None else stack.enter_context(release.verified(
            settings.shadow.archive, settings.shadow.key, allow_drift=settings.allow_runtime_drift))[0]
        sock = stack.enter_context(_listening(host, settings.port))
        info = release_info(tree, archive)            # refused here, in one line, before any worker starts
        store = None if settings.gallery is None else open_gallery(settings.gallery, tree, info, say)
        if store is not None:
            stack.callback(store.close)
        threads = max(1, _cores() // settings.workers)
        shadow = None if cand is None else start_shadow(settings, tree, cand, info, store, stack, say)
        pool = Pool(Options(str(tree), settings.workers, threads, settings.max_batch, settings.request_timeout_s,
                            settings.max_pixels, None if store is None else str(store.path)), settings.queue,
                    metrics.batch)
        stack.callback(pool.stop)
        from kiln_runtime.enrolment import policy

        service = Service(pool, info, metrics, store, policy(release.layout(tree).spec) if store else None, shadow)
        if service.reader is not None:
            stack.callback(service.reader.close)
        everywhere = _is_ip(host) and ipaddress.ip_address(host).is_unspecified
        url = f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"
        say(f"kiln-run: {info.name} v{info.version} verified ({len(checked)} checks) and warmed: {settings.workers} "
            f"worker process(es) × {threads} thread(s) per engine, in {time.perf_counter() - t0:.2f} s; serving on "
            f"{url}" + (" (every interface)" if everywhere else ""), flush=True)
        if shadow is not None:
            c = shadow.header["candidate"]
            say(f"kiln-run: shadow: {c['name']} v{c['version']} on {settings.shadow.share:.0%} of the frames "
                f"({settings.shadow.workers} worker(s) at nice +{NICE}, at most {settings.shadow.queue} frames "
                f"behind), against {shadow.header['candidate_gallery']}; never answered with; log "
                f"{settings.shadow.log}", flush=True)

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:       # noqa: ANN001 — uvicorn's signature
                if sig == signal.SIGTERM:                    # never re-raised after the drain: exit 0
                    if service.draining:
                        self.should_exit = True              # a second SIGTERM: what is left of the delay skipped
                        return
                    service.draining = True
                    delay = settings.drain_delay_s
                    say(f"kiln-run: SIGTERM: /readyz answers 503; still serving for {delay:g} s (--drain-delay), "
                        "then draining", flush=True)
                    if delay <= 0:
                        self.should_exit = True
                    else:
                        timer = threading.Timer(delay, lambda: setattr(self, "should_exit", True))
                        timer.daemon = True
                        timer.start()
                    return
                service.draining = True
                super().handle_exit(sig, frame)

        b = settings.bounds
        config = uvicorn.Config(app(service, settings, live), host=host, port=settings.port, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=settings.graceful_timeout_s,
                                timeout_keep_alive=b.keep_alive_s, lifespan="off",
                                http=connections.protocol(b, metrics.event, live))
        server = _Server(config)
        try:
            server.run(sockets=[sock])
        finally:
            service.draining = True
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)    # already stopping, within a bound: exit 0, not 143
            # the stack stops production's workers, then the shadow's and closes its log, then the gallery, the
            # socket and the extracted trees
    say(f"kiln-run: drained ({metrics.frames} frames served); bye", flush=True)
    return 0


def start_shadow(settings: Settings, tree: Path, cand: Path, info: ReleaseInfo, store, stack: ExitStack, say):
    """The candidate's pool (its own workers, nice +10) and the Shadow that feeds and logs it; stopped by `stack`.
    It identifies against the live gallery when its embedder's binding is the store's, else against its release's
    own gallery (the log says which)."""
    from kiln_runtime import shadow as sh
    from kiln_runtime.gallery import binding_of

    o = settings.shadow
    cinfo = release_info(cand, o.archive)
    same = store is not None and binding_of(cand) == binding_of(tree)
    gallery = ("the live gallery" if same else f"{cinfo.name} v{cinfo.version}'s build gallery" +
               (" (its embedder differs from the live gallery's)" if store is not None else ""))
    head = sh.header(sh.side(info), sh.side(cinfo), o.share, gallery)
    log = sh.open_log(o.log, head)                       # checked (or made) before any worker starts
    stack.callback(log.close)
    pool = Pool(Options(str(cand), o.workers, 1, settings.max_batch, settings.request_timeout_s, settings.max_pixels,
                        str(store.path) if same else None, nice=sh.NICE), o.queue, lambda *_: None,
                say=lambda m: print(m.replace("kiln-run: ", "kiln-run: shadow: ", 1), file=sys.stderr, flush=True))
    stack.callback(pool.stop)
    shadow = sh.Shadow(pool, head, log, say)
    stack.callback(shadow.close)
    return shadow


def open_gallery(path: Path, tree: Path, info: ReleaseInfo, say=print):
    """The live gallery store at `path`, bound to this release's embedder (refused in one line otherwise); made from
    the release's own gallery when it does not exist yet, so a release's people are the store's first."""
    import numpy as np

    from kiln_runtime import gallery as g
    from kiln_runtime.release import EMBEDDINGS, GALLERY_DIR, LABELS

    binding = g.binding_of(tree)
    path = Path(path)
    if not path.exists():
        emb = np.array(np.load(tree / GALLERY_DIR / EMBEDDINGS, allow_pickle=False, mmap_mode="r"))
        labels = json.loads((tree / GALLERY_DIR / LABELS).read_bytes())
        store = g.create(path, binding, "kiln-run serve", f"a new gallery for {info.name} v{info.version}",
                         (emb, labels), f"{info.name} v{info.version}'s build gallery")
        say(f"kiln-run: gallery {path} made from {info.name} v{info.version}'s build gallery ({len(labels)} faces, "
            f"bound to {binding.embedder} {binding.embedder_xxh3_128[:12]})", flush=True)
        return store
    store = g.Store(path)
    try:
        return store.bound_to(binding, f"{info.name} v{info.version}")
    except BaseException:
        store.close()
        raise


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _cores() -> int:
    from kiln_runtime.loadtest import cores

    return cores()


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


__all__ = ["MAX_BYTES", "Settings", "Service", "ShadowSettings", "answer", "app", "check_host",
           "free_port", "serve"]
