"""The live gallery over HTTP (`kiln-run serve --gallery STORE`): enrol, list, delete, erase, verify 1:1 — beside
`/v1/identify`, which then searches the store's people.

    GET    /v1/gallery                          the binding, version, head hash, subjects and faces
    GET    /v1/subjects[?limit=N&after=ID]      subjects and their face counts, in order, a page at a time
    GET    /v1/subjects/{subject}               a subject's faces (id, digest, box, score, created, event)
    POST   /v1/subjects/{subject}/faces         body: an image with exactly one face → 201 the face enrolled
    DELETE /v1/subjects/{subject}/faces/{face}  → the version after
    DELETE /v1/subjects/{subject}               erase: every face and everything stored for them → the receipt
    POST   /v1/subjects/{subject}/verify        body: an image with one face → same person or not, the distance

Writes need `Authorization: Bearer TOKEN` (the token from `--token-file` or $KILN_GALLERY_TOKEN, compared in constant
time, never printed or logged); with no token configured, writes are refused. Reads are open unless `--auth-reads`.
The actor and the reason recorded in the log come from `X-Kiln-Actor` / `X-Kiln-Reason` (one plain line each). A
write is one committed transaction in the store before it is answered, and every worker catches up with the store
before the next batch it runs, so the next request any worker answers sees it.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from kiln_runtime import gallery as g
from kiln_runtime.enrolment import NotEnrolable, Policy, the_face
from kiln_runtime.errors import KilnError
from kiln_runtime.workers import FACES

MAX_PAGE = 1000


@dataclass
class Access:
    token: bytes | None           # None: writes are refused
    reads: bool = False           # reads need the token too


@dataclass
class Context:
    """What the gallery routes need from the service (kiln_runtime/serve.py), so this module imports none of it."""
    store: g.Store                # the writer's connection: writes wait for each other, never for reads
    lock: threading.Lock          # it is used from worker threads one at a time
    reader: g.Store               # a read-only connection: reads never wait for a write (WAL)
    read_lock: threading.Lock
    policy: Policy
    access: Access
    body: Callable[[Any], Awaitable[Any]]             # request → bytes, or the Response refusing it
    frame: Callable[[bytes, str], Awaitable[Any]]     # (body, kind) → workers.Done, or the Response refusing it
    reply: Callable[..., Any]                         # (doc, status, **headers) → JSONResponse
    refuse: Callable[..., Any]                        # (status, reason, error, hint, **headers) → JSONResponse
    count: Callable[[str], None]                      # a gallery write, by operation (/metrics)


def refused(ctx: Context, request, write: bool):
    """The Response refusing a request the access rules do not allow, else None: a write (or, with `reads`, any
    request) needs the bearer token, compared in constant time."""
    if not write and not ctx.access.reads:
        return None
    if ctx.access.token is None:
        return ctx.refuse(403, "forbidden", "gallery writes are disabled on this service",
                          "start kiln-run serve with --token-file FILE (or KILN_GALLERY_TOKEN) to allow them")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1", "replace"),
                                                             ctx.access.token):     # the header's own bytes
        return ctx.refuse(401, "unauthorized", "a gallery " + ("write" if write else "read") + " needs the "
                          "service's bearer token", "send Authorization: Bearer TOKEN",
                          **{"WWW-Authenticate": 'Bearer realm="kiln-gallery"'})
    return None


def routes(ctx: Context) -> list:
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def db(fn: Callable, *args):
        """A write, on the writer's connection, in a worker thread (the event loop never waits on SQLite)."""
        def locked():
            with ctx.lock:
                return fn(*args)
        return await asyncio.to_thread(locked)

    async def read(fn: Callable, *args):
        def locked():
            with ctx.read_lock:
                return fn(*args)
        return await asyncio.to_thread(locked)

    def denied(request: Request, write: bool) -> Response | None:
        return refused(ctx, request, write)

    def header(request: Request, name: str) -> str | None:
        raw = request.headers.get(name)              # HTTP headers arrive as latin-1: a UTF-8 value decoded as such
        return None if raw is None else raw.encode("latin-1", "replace").decode("utf-8", "replace")

    def who(request: Request, default_reason: str) -> tuple[str, str]:
        return (g.check_text(header(request, "x-kiln-actor"), "actor", "api"),
                g.check_text(header(request, "x-kiln-reason"), "reason", default_reason))

    def subject_of(request: Request) -> str:
        return g.check_subject(request.path_params["subject"])

    def user_error(e: KilnError) -> Response:
        if isinstance(e, g.StoreError):              # the store's own failure: the service's, retry later
            return ctx.refuse(503, "store", e.message, e.hint, **{"Retry-After": "1"})
        if isinstance(e, NotEnrolable):
            return ctx.refuse(422, "not_enrolable", e.message, e.hint)
        if "no subject" in e.message or "no face" in e.message:
            return ctx.refuse(404, "not_found", e.message, e.hint)
        return ctx.refuse(400, "bad_request", e.message, e.hint)

    async def one_face(request: Request):
        """The request body's one face, fit for the policy: (the match, its crop, the body), or a Response."""
        body = await ctx.body(request)
        if not isinstance(body, (bytes, bytearray)):
            return body
        got = await ctx.frame(bytes(body), FACES)
        if not hasattr(got, "found"):
            return got
        m = the_face(got.found, ctx.policy, "request body", got.shape)
        return m, got.crops[0], bytes(body)

    async def info(request: Request) -> Response:
        if (no := denied(request, False)) is not None:
            return no

        def summary():
            s = ctx.reader
            with s.reading():
                subjects, faces = s.counts()
                return {"binding": s.binding.doc(), "binding_digest": s.binding.digest, "version": s.version(),
                        "head": s.head(), "subjects": subjects, "faces": faces, "store": s.path.name}
        try:
            return ctx.reply(await read(summary))
        except KilnError as e:
            return user_error(e)

    async def subjects(request: Request) -> Response:
        if (no := denied(request, False)) is not None:
            return no
        try:
            limit = min(MAX_PAGE, max(1, int(request.query_params.get("limit", MAX_PAGE))))
        except ValueError:
            return ctx.refuse(400, "bad_request", "limit is not a number", f"pass limit=1..{MAX_PAGE}")
        after = request.query_params.get("after", "")
        try:
            page = await read(ctx.reader.subjects, limit, after)
            version = await read(ctx.reader.version)
        except KilnError as e:
            return user_error(e)
        return ctx.reply({"version": version, "subjects": [{"subject": s, "faces": n} for s, n in page],
                          "next": page[-1][0] if len(page) == limit else None})

    async def subject(request: Request) -> Response:
        if (no := denied(request, False)) is not None:
            return no
        try:
            name = subject_of(request)
            faces = await read(ctx.reader.faces, name)
        except KilnError as e:
            return user_error(e)
        if not faces:
            return ctx.refuse(404, "not_found", f"no subject {name} in the gallery", "list them: GET /v1/subjects")
        return ctx.reply({"subject": name, "faces": [
            {"face": f.id, "digest": f.digest, "box": f.box, "score": f.score, "created": f.created,
             "event": f.event} for f in faces]})

    async def enrol(request: Request) -> Response:
        if (no := denied(request, True)) is not None:
            return no
        try:
            name = subject_of(request)
            actor, reason = who(request, "enrolled over HTTP")
            got = await one_face(request)
            if not isinstance(got, tuple):
                return got
            m, (png, marks), body = got
            import hashlib

            face, version, new = await db(ctx.store.enrol, name, m.embedding, png, marks, m.box, m.score,
                                          hashlib.sha256(body).hexdigest(), actor, reason)
        except KilnError as e:
            return user_error(e)
        if new:                                       # the same face again writes nothing
            ctx.count("enrol")
        return ctx.reply({"subject": name, "face": face.id, "digest": face.digest, "version": version, "new": new,
                          "box": face.box, "score": face.score}, 201 if new else 200)

    async def delete(request: Request) -> Response:
        if (no := denied(request, True)) is not None:
            return no
        try:
            name = subject_of(request)
            actor, reason = who(request, "deleted over HTTP")
            version = await db(ctx.store.delete_face, request.path_params["face"], actor, reason, name)
        except KilnError as e:
            return user_error(e)
        ctx.count("delete")
        return ctx.reply({"subject": name, "face": request.path_params["face"], "deleted": True, "version": version})

    async def erase(request: Request) -> Response:
        if (no := denied(request, True)) is not None:
            return no
        try:
            name = subject_of(request)
            actor, reason = who(request, "erased over HTTP")
            receipt = await db(ctx.store.erase, name, actor, reason)
        except KilnError as e:
            return user_error(e)
        ctx.count("erase")
        return ctx.reply(receipt)

    async def verify(request: Request) -> Response:
        if (no := denied(request, False)) is not None:
            return no
        try:
            name = subject_of(request)
            ids, _, vectors = await read(ctx.reader.vectors, name)
            if not ids:
                return ctx.refuse(404, "not_found", f"no subject {name} in the gallery", "enrol them first")
            got = await one_face(request)
            if not isinstance(got, tuple):
                return got
            m = got[0]
        except KilnError as e:
            return user_error(e)
        b = ctx.store.binding
        best, value = g.closest(b, m.embedding, vectors)
        same = value >= b.threshold if b.metric == "cosine" else value < b.threshold
        return ctx.reply({"subject": name, "same": bool(same), "metric": b.metric, "distance": round(value, 6),
                          "threshold": b.threshold, "face": ids[best], "faces": len(ids),
                          "box": [round(float(v), 2) for v in m.box], "score": round(float(m.score), 5)})

    return [Route("/v1/gallery", info), Route("/v1/subjects", subjects),
            Route("/v1/subjects/{subject}", subject, methods=["GET"]),
            Route("/v1/subjects/{subject}", erase, methods=["DELETE"]),
            Route("/v1/subjects/{subject}/faces", enrol, methods=["POST"]),
            Route("/v1/subjects/{subject}/faces/{face}", delete, methods=["DELETE"]),
            Route("/v1/subjects/{subject}/verify", verify, methods=["POST"])]


__all__ = ["Access", "Context", "refused", "routes"]
