"""The service's worker processes (`kiln-run serve`): each holds its own copy of the verified system and is fed by
one thread of the server over a pipe of its own — nothing is shared between processes that a dead one could hold.

    frames ─► one in-process queue ─► slot i: a feeder thread ─pipe─► worker process i (its own system)

A frame waits in the server's own queue (a lock of this process only). Each slot's feeder thread takes up to
`max_batch` waiting frames, sends them to its worker, waits for the answer — at most `batch_timeout_s` — and hands
each frame its result; a busy worker's feeder takes nothing, so frames go to whichever worker is free. The worker
decodes the bytes (the pixel cap and the format allow-list before any pixel is decoded) and runs ONE embedder call and
ONE gallery search for all the batch's faces, as sysbench@ runs it.

A worker that dies (SIGKILL, the OOM killer) closes its pipe: its feeder fails only the frames of the batch it held
(`WorkerDied`), starts a replacement — the verified tree loaded again, each engine verified as it loads, warmed —
while the other workers go on serving, and `ready` counts the workers that can take frames (/readyz reports it). A
batch that runs past its bound has its worker killed and replaced the same way; its frames fail with `TooSlow`. The
workers ignore SIGINT and SIGTERM (the server decides when they stop); `stop` asks each to finish, then SIGKILLs
what is left after a bound, so shutdown always ends.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kiln_runtime.errors import KilnError, deferred_signals
from kiln_runtime.images import MAX_PIXELS

READY_TIMEOUT_S = 120.0          # load + warm of one worker
STOP_TIMEOUT_S = 5.0             # a worker asked to stop that has not within this is killed
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class BadImage(KilnError):
    """A request body that is not an image this service reads (400), or one past the pixel cap (413)."""

    def __init__(self, message: str, hint: str = "", too_large: bool = False) -> None:
        super().__init__(message, hint)
        self.too_large = too_large


class WorkerDied(KilnError):
    """The worker running this frame died (killed, out of memory): the frame's request fails, the service goes on."""


class TooSlow(KilnError):
    """The frame's batch ran past the time bound: its worker was replaced."""


class NoWorker(KilnError):
    """No worker is ready (every one is being replaced): the request is answered 503 at once."""


@dataclass(frozen=True)
class Options:
    tree: str                    # the verified, extracted release
    workers: int
    threads: int                 # intra-op threads per engine, in each worker
    max_batch: int
    batch_timeout_s: float       # a batch in a worker past this: the worker is killed and replaced
    max_pixels: int = MAX_PIXELS
    gallery: str | None = None   # a live gallery store (kiln_runtime/gallery.py) instead of the release's own
    nice: int = 0                # added to the workers' CPU niceness (a shadow candidate's: below production's)


IDENTIFY, FACES = "identify", "faces"     # a job's kind: who is in the frame, or its faces to enrol or verify


@dataclass
class Done:
    """One frame's answer: the faces, the batch's per-stage ms shared per frame, the image's (height, width); for a
    FACES job, each face's crop (PNG) and landmarks in the crop (kiln_runtime/enrolment.py)."""
    found: list
    share: dict[str, float]
    shape: tuple[int, int]
    crops: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- the worker process
def warm(system) -> None:
    """Every engine's first call made (zeros of each graph's input) and the whole path once on a grey frame."""
    spec = system.spec
    sizes = {"pnet": 48, "rnet": 24, "onet": 48}
    for model, run in zip(spec.detector_graphs, system.nets):
        side = sizes.get(model, 64)
        run(np.zeros((1, 3, side, side), np.float32))
    if system.warp is not None:
        system.warp(np.zeros((1, 3, 64, 64), np.float32), np.array([[[1, 0, 0], [0, 1, 0]]], np.float32))
    system.embed(np.zeros((1, 3, spec.chip_size, spec.chip_size), np.float32))
    system.identify_frames([np.full((120, 160, 3), 127, np.uint8)], {})


def run_batch(system, batch: list[tuple[int, str, bytes]], max_pixels: int, live=None) -> tuple:
    """("batch", [(id, message, hint, past the pixel cap) of bodies that are no image], failure (ids, message, hint)
    or None, (ids, faces per frame, shapes, per-stage ms, CPU s) or None, {id: [(crop PNG, landmarks)] of FACES
    jobs}) — decoded here, beside the system: the bytes cross the pipe, not the pixels. With a live gallery, the
    search first catches up with the store: a write acknowledged before this batch was sent is in it."""
    from kiln_runtime.enrolment import crop
    from kiln_runtime.images import TooLarge, decode_bytes

    cpu0, timings, frames, bad = time.process_time(), {}, [], []
    ids = [jid for jid, _, _ in batch]
    try:
        if live is not None and live.refresh():
            system.gallery = live.gallery()
    except Exception as e:  # noqa: BLE001 — the store unreadable now: this batch fails, the worker goes on
        return "batch", [], (ids, f"the live gallery could not be read ({type(e).__name__}: {str(e)[:200]})",
                             "check the gallery store (kiln-run gallery audit STORE)"), None, {}
    kinds = {jid: kind for jid, kind, _ in batch}
    t0 = time.perf_counter()
    for jid, _, body in batch:
        try:
            frames.append((jid, decode_bytes(body, "request body", max_pixels=max_pixels)))
        except KilnError as e:
            bad.append((jid, e.message, e.hint, isinstance(e, TooLarge)))
        except Exception as e:  # noqa: BLE001 — a decoder's own failure on hostile bytes: that body's 400, no more
            bad.append((jid, f"request body: not a readable image ({type(e).__name__})", "send a JPEG, PNG, BMP or "
                        "WebP image", False))
    timings["decode"] = (time.perf_counter() - t0) * 1e3
    if not frames:
        return "batch", bad, None, None, {}
    ids = [jid for jid, _ in frames]
    try:
        found = system.identify_frames([rgb for _, rgb in frames], timings)
        crops = {jid: [crop(rgb, m.box, m.landmarks) for m in f] for (jid, rgb), f in zip(frames, found)
                 if kinds[jid] == FACES}
    except KilnError as e:
        return "batch", bad, (ids, e.message, e.hint), None, {}
    except Exception as e:  # noqa: BLE001 — one failed batch is its requests' 500s; the service goes on
        return "batch", bad, (ids, f"{type(e).__name__}: {str(e)[:200]}", "see the service's log"), None, {}
    return "batch", bad, None, (ids, found, [rgb.shape[:2] for _, rgb in frames], timings,
                                time.process_time() - cpu0), crops


def _worker(tree: str, threads: int, max_pixels: int, gallery: str | None, nice: int, conn) -> None:
    """A worker process: load the verified tree's system (each engine verified again as it loads; its gallery the
    live store's when one is given), warm it, say ready, then answer each batch the server sends until it sends None
    or goes away (its end of the pipe closes, as when the server is killed: nothing lingers as an orphan). SIGINT and
    SIGTERM are ignored: the server stops it. `nice` lowers its CPU priority first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if nice:
        os.nice(nice)
    from kiln_runtime import release

    live = None
    try:
        system = release.load(Path(tree), threads=threads).system
        if gallery is not None:
            from kiln_runtime.gallery import binding_of
            from kiln_runtime.gallery_cache import Live

            live = Live(Path(gallery), binding_of(Path(tree)))
            system.gallery = live.gallery()
        warm(system)
        conn.send(("ready", os.getpid(), None))
    except BaseException as e:  # noqa: BLE001 — the server reports it as one line
        try:
            conn.send(("error", os.getpid(), f"{type(e).__name__}: {str(e)[:300]}"))
        except OSError:
            pass
        return
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        try:
            conn.send(("took", len(batch)))          # from here on a death fails this batch; before, it is resent
            conn.send(run_batch(system, batch, max_pixels, live))
        except OSError:
            return


# ---------------------------------------------------------------------------------------------- the server side
@dataclass
class Job:
    id: int
    kind: str
    body: bytes
    future: concurrent.futures.Future
    tries: int = 0               # times a worker died before it took the job (it is sent to a replacement once)
    released: bool = False       # counted out of the pool's bound


_STOP = object()
_UNTAKEN = object()
_GONE = (EOFError, OSError, AttributeError)      # a pipe closed under us, or taken by `kill` (None) at shutdown


class Slot:
    """One worker process, its pipe, and the feeder thread in the server that owns both. `lock` guards the process
    and pipe against `Pool.stop` (another thread) starting or killing them at the same time."""

    def __init__(self, pool: "Pool", index: int) -> None:
        self.pool, self.index = pool, index
        self.proc = None
        self.conn = None
        self.ready = False
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    # -- the process
    def start(self) -> None:
        with self.lock:
            if self.pool.stopping.is_set() and self.thread is not None:
                raise KilnError("the service is stopping", "")
            ctx = self.pool.ctx
            mine, theirs = ctx.Pipe(duplex=True)
            o = self.pool.options
            self.proc = ctx.Process(target=_worker, daemon=True, name=f"kiln-worker-{self.index}",
                                    args=(o.tree, o.threads, o.max_pixels, o.gallery, o.nice, theirs))
            with deferred_signals():   # a SIGTERM mid-start would cut the child's start-up data (its traceback)
                try:
                    self.proc.start()
                finally:
                    theirs.close()     # only the worker holds its end: its death is an EOF here
            self.conn = mine

    def wait_ready(self, deadline: float) -> None:
        """Until the worker says ready; KilnError naming why when it says otherwise, dies or takes too long."""
        conn, proc = self.conn, self.proc
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KilnError(f"a worker did not load the system within {READY_TIMEOUT_S:.0f} s",
                                "check the release loads: kiln-run identify ARCHIVE --key K.pub PHOTO")
            try:
                if not conn.poll(min(left, 0.5)):
                    continue
                kind, _, info = conn.recv()
            except _GONE:
                proc.join(timeout=1)
                raise KilnError(f"a worker exited ({_exit(proc.exitcode)}) while loading the system",
                                "check the release loads: kiln-run identify ARCHIVE --key K.pub PHOTO; a worker "
                                "killed by the OS may have run out of memory") from None
            if kind == "ready":
                return
            raise KilnError(f"a worker could not load the system: {info}",
                            "check the release loads: kiln-run identify ARCHIVE --key K.pub PHOTO")

    def kill(self) -> None:
        """SIGKILL (a worker ignores SIGTERM) and reap; the pipe closed."""
        with self.lock:
            proc, conn = self.proc, self.conn
            self.conn, self.ready = None, False
            if proc is not None and proc.pid is not None:
                if proc.exitcode is None:
                    proc.kill()
                proc.join(timeout=STOP_TIMEOUT_S)
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        """Ask the worker to finish (None), wait a bound, then kill it."""
        conn, proc = self.conn, self.proc
        if conn is not None and proc is not None and proc.exitcode is None:
            try:
                conn.send(None)
                proc.join(timeout=STOP_TIMEOUT_S)
            except _GONE:
                pass
        self.kill()

    # -- the feeder thread
    def feed(self) -> None:
        """The slot's loop: (re)start the worker when it is not ready, take a batch, run it, deliver, again — until
        the pool stops. Anything unexpected fails only the frames held and restarts the worker: one log line, never a
        dead feeder."""
        pool, held, failures = self.pool, [], 0
        while not pool.stopping.is_set():
            try:
                if not self.ready:
                    if not self._restart(failures):
                        failures += 1
                        continue
                    failures = 0
                held = self._step(held)
            except Exception as e:  # noqa: BLE001 — a feeder must outlive whatever its worker does
                if pool.stopping.is_set():
                    break
                pool.say(f"kiln-run: worker {self.index + 1}: {type(e).__name__}: {str(e)[:200]}; replacing it")
                self._lost("failed", held)
                held = []
        pool.settle_all(held, KilnError("the service stopped before this frame ran", "retry on another replica"))
        self.stop()

    def _step(self, held: list[Job]) -> list[Job]:
        """One batch: taken (or the one a dead worker never took), sent, answered; what is still to send next."""
        pool = self.pool
        if not held:
            job = pool.take(0.5)
            if job is _STOP or job is None:
                if job is None and self.proc is not None and self.proc.exitcode is not None:
                    self._lost(f"died while idle ({_exit(self.proc.exitcode)})", [])
                return []
            held = [job, *pool.take_more(pool.options.max_batch - 1)]
        held = pool.live(held)                     # a request that gave up (timed out) is not run
        if not held:
            return []
        try:
            self.conn.send([(j.id, j.kind, j.body) for j in held])
        except _GONE:                  # died before it took them: they never ran; a replacement runs them, once
            self._lost(f"died while idle ({_exit(self.proc.exitcode)})", [])
            return pool.retry(held)
        reply = self._answer(held)
        if reply is _UNTAKEN:
            return pool.retry(held)
        if reply is not None:
            pool.deliver(held, reply)
        return []

    def _answer(self, batch: list[Job]):
        """The worker's reply to `batch`; None when it died running it or ran past the bound (the batch's frames
        failed, the worker killed: the loop starts a replacement); _UNTAKEN when it died before it took the batch
        (killed while idle, just as the batch was sent: nothing of it ran)."""
        bound = self.pool.options.batch_timeout_s
        deadline = time.monotonic() + bound
        took = False
        conn, proc = self.conn, self.proc
        try:
            while True:
                while not conn.poll(max(0.0, min(deadline - time.monotonic(), 0.5))):
                    if time.monotonic() >= deadline:
                        self._lost(f"ran a batch past {bound:g} s: killed", batch,
                                   TooSlow(f"the frame's batch ran past the service's bound of {bound:g} s",
                                           "send a smaller image, or raise --request-timeout"))
                        return None
                msg = conn.recv()
                if msg[0] != "took":
                    return msg
                took = True
        except _GONE:
            proc.join(timeout=1)
            if not took:
                self._lost(f"died while idle ({_exit(proc.exitcode)})", [])
                return _UNTAKEN
            self._lost(f"died running {len(batch)} frame(s) ({_exit(proc.exitcode)})", batch)
            return None

    def _lost(self, what: str, batch: list[Job], error: KilnError | None = None) -> None:
        pid = self.proc.pid if self.proc is not None else None
        self.kill()
        self.pool.lost(self, f"worker {self.index + 1} (pid {pid}) {what}", batch, error)

    def _restart(self, failures: int) -> bool:
        if failures:
            self.pool.stopping.wait(RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S)) - 1])
        if self.pool.stopping.is_set():
            return False
        t0 = time.monotonic()
        try:
            self.start()
            self.wait_ready(t0 + READY_TIMEOUT_S)
        except (KilnError, OSError) as e:           # OSError: no pipe or process to be had (EMFILE, ENOMEM)
            self.kill()
            if not self.pool.stopping.is_set():
                why = e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
                self.pool.say(f"kiln-run: worker {self.index + 1} could not be replaced: {why[:300]}; trying again")
            return False
        if self.pool.stopping.is_set():
            self.kill()
            return False
        self.ready = True
        self.pool.replaced(self, time.monotonic() - t0)
        return True


def _exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (": out of memory?" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


class Pool:
    """`options.workers` worker processes behind one in-process queue of at most `limit` frames (waiting, being run,
    or given up by their request but still queued): past it, `submit` raises queue.Full (the request is answered
    503). So what the queue holds in memory is bounded whatever the workers do."""

    def __init__(self, options: Options, limit: int, on_batch: Callable[[int, dict, float, int], None],
                 say: Callable[[str], None] | None = None) -> None:
        import multiprocessing as mp

        self.options, self.limit, self.on_batch = options, limit, on_batch
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.ctx = mp.get_context("spawn")               # no fork after ONNX Runtime threads exist
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.pending = 0                                 # frames in the pool: not yet released
        self.next_id = 0
        self.restarts = 0
        self.stopping = threading.Event()
        self.slots = [Slot(self, i) for i in range(options.workers)]
        try:
            for s in self.slots:
                s.start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            for s in self.slots:
                s.wait_ready(deadline)
                s.ready = True
        except BaseException:
            for s in self.slots:
                s.kill()
            raise
        for s in self.slots:
            s.thread = threading.Thread(target=s.feed, daemon=True, name=f"kiln-feeder-{s.index}")
            s.thread.start()

    @property
    def ready(self) -> int:
        return sum(s.ready for s in self.slots)

    def held(self) -> int:
        with self.lock:
            return self.pending

    def submit(self, body: bytes, kind: str = IDENTIFY) -> concurrent.futures.Future:
        """Queue one frame (the image's bytes: a worker decodes them). The future: Done, or BadImage / WorkerDied /
        TooSlow / KilnError. queue.Full past the bound; NoWorker while no worker is ready."""
        if self.ready == 0:
            raise NoWorker(f"no worker is ready ({len(self.slots)} being replaced)", "retry shortly")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.pending >= self.limit:
                raise queue.Full
            jid, self.next_id = self.next_id, self.next_id + 1
            self.pending += 1
        self.jobs.put(Job(jid, kind, body, fut))
        return fut

    def release(self, jobs: list[Job]) -> None:
        """These frames leave the pool (answered, failed, or dropped after their request gave up)."""
        with self.lock:
            for j in jobs:
                if not j.released:
                    j.released = True
                    self.pending -= 1

    def live(self, jobs: list[Job]) -> list[Job]:
        """The jobs whose request still waits; the others are released (their bodies dropped)."""
        gone = [j for j in jobs if j.future.done()]
        self.release(gone)
        return [j for j in jobs if not j.future.done()]

    def retry(self, jobs: list[Job]) -> list[Job]:
        """Jobs a worker died before taking: sent again once, to its replacement; a second time they fail (whatever
        kills a worker as it arrives is not sent to a third)."""
        again = [j for j in self.live(jobs) if j.tries == 0]
        for j in again:
            j.tries += 1
        self.settle_all([j for j in jobs if j not in again], WorkerDied(
            "two workers died as this frame was sent to them", "retry the request; the service replaced them"))
        return again

    def take(self, timeout: float):
        try:
            return self.jobs.get(timeout=timeout)
        except queue.Empty:
            return None

    def take_more(self, n: int) -> list[Job]:
        out: list[Job] = []
        while len(out) < n:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                self.jobs.put(_STOP)                       # another feeder's stop; this one finishes its batch
                break
            out.append(job)
        return out

    def settle_all(self, jobs: list[Job], value: Any) -> None:
        for j in jobs:
            _settle(j.future, value)
        self.release(jobs)

    def deliver(self, batch: list[Job], reply: tuple) -> None:
        _, bad, failed, done, crops = reply
        by_id = {j.id: j.future for j in batch}
        for jid, message, hint, too_large in bad:
            _settle(by_id.pop(jid, None), BadImage(message, hint, too_large))
        if failed is not None:
            ids, message, hint = failed
            for jid in ids:
                _settle(by_id.pop(jid, None), KilnError(message, hint))
        if done is not None:
            ids, found, shapes, timings, cpu = done
            share = {st: ms / len(ids) for st, ms in timings.items()}
            self.on_batch(len(ids), share, cpu, sum(len(f) for f in found))
            for jid, faces, shape in zip(ids, found, shapes):
                _settle(by_id.pop(jid, None), Done(faces, share, tuple(shape), crops.get(jid, [])))
        for fut in by_id.values():                         # a reply that left a frame out: never silently
            _settle(fut, KilnError("the worker's answer left this frame out", "see the service's log"))
        self.release(batch)

    def lost(self, slot: Slot, what: str, batch: list[Job], error: KilnError | None) -> None:
        """A worker gone: the frames it held fail (and only those), its engines' private copies are removed; the
        slot's loop starts a replacement."""
        from kiln_runtime.files import sweep_stale

        sweep_stale()
        with self.lock:
            self.restarts += 1
        self.settle_all(batch, error or WorkerDied(
            "the worker process running this frame died", "retry the request; the service replaced the worker (a "
            "worker killed by the OS may have run out of memory)"))
        if not self.stopping.is_set():
            held = f"the {len(batch)} request(s) it held failed" if batch else "no request was lost"
            self.say(f"kiln-run: {what}; {held}; starting a replacement ({self.ready}/{len(self.slots)} worker(s) "
                     "ready)")

    def replaced(self, slot: Slot, seconds: float) -> None:
        self.say(f"kiln-run: worker {slot.index + 1} replaced (pid {slot.proc.pid}), verified and warmed in "
                 f"{seconds:.2f} s ({self.ready}/{len(self.slots)} worker(s) ready)")

    def stop(self, timeout_s: float = 2 * STOP_TIMEOUT_S) -> None:
        """Stop every worker within a bound: each feeder finishes its batch and asks its worker to stop; frames
        still queued fail; whatever is left at the bound is killed (and a feeder that outlives the bound starts
        nothing new: it sees `stopping`)."""
        self.stopping.set()
        for _ in self.slots:
            self.jobs.put(_STOP)
        deadline = time.monotonic() + timeout_s
        for s in self.slots:
            if s.thread is not None:
                s.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for s in self.slots:
            s.kill()                                       # what did not stop in time (a no-op for the rest)
        while True:                                        # frames no worker will run
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job):
                self.settle_all([job], KilnError("the service stopped before this frame ran", "retry on another "
                                                 "replica"))


def _settle(fut: concurrent.futures.Future | None, value: Any) -> None:
    """Give a frame's future its answer once (a request that gave up already has one)."""
    if fut is None or fut.done():
        return
    try:
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


__all__ = ["BadImage", "Done", "FACES", "IDENTIFY", "NoWorker", "Options", "Pool", "TooSlow", "WorkerDied", "run_batch",
           "warm"]
