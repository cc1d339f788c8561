"""N concurrent streams of frames against one face system, at a fixed rate, until the p99 budget breaks: the
sustained-load sweep sysbench@ runs on a checkout's system and `kiln-run bench` on a release, in process or over HTTP.

How a point of the sweep runs (`streams` streams at `fps` each):

* The parent process is the cameras: stream `s` has its k-th frame arrive at `t0 + k/fps + s/(fps·streams)` (the
  streams staggered evenly), and puts it on one shared job queue at that moment. Latency is counted from that
  scheduled arrival, so a parent that falls behind makes latency worse, never better.
* Worker processes (params `sysbench.workers`, 0 = one per CPU core) each hold the whole system — every engine
  loaded verified, with `cores / workers` intra-op threads each — and take up to `max_batch` waiting frames at
  once. A frame already older than the budget when a worker picks it up is dropped (a live system skips stale
  frames: its answer would be useless). The rest run as one batch: detection and the aligner per frame, ONE
  embedder call for every face of the batch and ONE gallery search (`System.identify_frames`).
* Latency = decision time − arrival (CLOCK_MONOTONIC, shared by the processes). The first second of arrivals is
  warm-up and not counted; then `seconds` are measured; then the point drains for at most
  `max(2 s, 5 × budget)` — a frame not decided by then counts as dropped, and a worker still busy skips what is
  left of that point.
* CPU-seconds per frame: each worker's process CPU time (all its threads) across each batch, summed, over the
  frames decided.

The sweep stops at the first point that misses the budget (p99 over it, or any frame dropped), so its time is
bounded by `len(streams) × (1 + seconds + drain)` plus worker start-up. The headline is the most streams that
held the budget: streams per machine at that frame rate and resolution.

Then the workers stop (`_stop`): STOP in the shared point id tells each to quit at its next job — frames still
queued are never run — and one still busy after `STOP_TIMEOUT_S` is terminated; the queues' feeder threads are not
waited for at exit (what they hold is for workers that are gone), and a SIGINT / SIGTERM during the stop acts when
it ends. Workers ignore SIGINT: a Ctrl-C reaches the whole process group, and the parent stops them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from kiln_runtime.errors import KilnError, deferred_signals
from kiln_runtime.frames import pick

WARMUP_S = 1.0
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0       # all workers together, to finish the batch in hand once told to stop
STOP = -2                   # the shared point id that tells the workers to quit


@dataclass(frozen=True)
class Plan:
    streams: tuple[int, ...]
    fps: float
    seconds: float
    budget_ms: float
    max_batch: int
    workers: int
    threads: int            # intra-op threads per engine in each worker

    @property
    def drain_s(self) -> float:
        return max(2.0, 5 * self.budget_ms / 1e3)

    @property
    def bound_s(self) -> float:
        """The most the sweep's points can take (worker start-up aside)."""
        return len(self.streams) * (WARMUP_S + self.seconds + self.drain_s)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------- worker process
def _worker(maker: str, kwargs: dict, threads: int, frames: list, budget_ms: float, max_batch: int, current, jobs,
            results) -> None:
    """Make the system (`maker`: "module:function" called with `threads=` and `kwargs` — the build's checkout
    system, or a release's: `release_system`), say ready, then run batches of jobs until told to stop (None)."""
    import importlib
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)            # the parent stops the workers (`_stop`)
    try:
        module, fn = maker.split(":")
        s = getattr(importlib.import_module(module), fn)(threads=threads, **kwargs)
        for _ in range(2):                                  # warm every engine's first-call paths
            s.identify_frames([frames[0]], {})
        results.put(("ready", os.getpid(), s.threads_used))
    except BaseException as e:   # noqa: BLE001 - the parent reports it as one line
        results.put(("error", os.getpid(), f"{type(e).__name__}: {e}"))
        return
    stop = False
    while not stop:
        item = jobs.get()
        if item is None or current.value == STOP:
            break
        batch = [item]
        while len(batch) < max_batch:
            try:
                nxt = jobs.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                stop = True
                break
            batch.append(nxt)
        now = time.monotonic()
        live = [b for b in batch if b[0] == current.value]           # a finished point's leftovers: skipped
        fresh = [b for b in live if (now - b[3]) * 1e3 <= budget_ms]
        stale = [b for b in live if (now - b[3]) * 1e3 > budget_ms]
        timings: dict[str, float] = {}
        decided = []
        if fresh:
            cpu0 = time.process_time()
            found = s.identify_frames([frames[b[4]] for b in fresh], timings)
            done, cpu = time.monotonic(), time.process_time() - cpu0
            decided = [(b[1], b[2], b[3], now, done, len(f)) for b, f in zip(fresh, found)]
        else:
            cpu = 0.0
        if live:
            results.put(("batch", live[0][0], decided, [(b[1], b[2], b[3]) for b in stale], timings, cpu))
    results.cancel_join_thread()        # told to stop: the parent reads no more, so exit without flushing to it


# ---------------------------------------------------------------------------------------------- one point
def _point(p: Plan, streams: int, point_id: int, n_frames: int, current, jobs, inbox: "queue.Queue") -> dict:
    current.value = point_id
    ticks = max(1, int(round((WARMUP_S + p.seconds) * p.fps)))       # a very low rate still offers one frame
    t0 = time.monotonic() + 0.05
    schedule = sorted((t0 + k / p.fps + s / (p.fps * streams), s, k) for s in range(streams) for k in range(ticks))
    for at, s, k in schedule:
        delay = at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        jobs.put((point_id, s, k, at, pick(n_frames, s, k)))
    measured_from = t0 + WARMUP_S
    expected = {(s, k) for at, s, k in schedule}
    seen: dict[tuple[int, int], tuple] = {}
    dropped: set[tuple[int, int]] = set()
    stage_ms: dict[str, float] = {}
    cpu, batches, batch_frames = 0.0, 0, 0
    deadline = schedule[-1][0] + p.drain_s
    while len(seen) + len(dropped) < len(expected):
        try:
            _, point, decided, stale, timings, c = inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if point != point_id:
            continue
        for s, k, at, start, done, faces in decided:
            seen[(s, k)] = (at, start, done, faces)
        dropped.update((s, k) for s, k, at in stale)
        if any(at >= measured_from for *_, at, _, _, _ in decided) or any(at >= measured_from for _, _, at in stale):
            batches += 1
            batch_frames += len(decided)
            cpu += c
            for st, ms in timings.items():
                stage_ms[st] = stage_ms.get(st, 0.0) + ms
        if time.monotonic() > deadline:
            break
    current.value = -1                        # what is still queued for this point is skipped by the workers
    window = [(s, k) for at, s, k in schedule if at >= measured_from]
    lat = np.array([(seen[x][2] - seen[x][0]) * 1e3 for x in window if x in seen])
    wait = np.array([(seen[x][1] - seen[x][0]) * 1e3 for x in window if x in seen])
    lost = sum(x not in seen for x in window)             # dropped as stale, or not decided before the drain ended
    n = len(lat)
    pct = (lambda q: round(float(np.percentile(lat, q)), 3) if n else None)  # noqa: E731
    p99 = pct(99)
    per_frame = {st: round(ms / batch_frames, 3) for st, ms in sorted(stage_ms.items())} if batch_frames else {}
    return {
        "streams": streams, "offered_fps": round(streams * p.fps, 3), "frames": len(window), "decided": n,
        "dropped": lost, "late": int((lat > p.budget_ms).sum()) if n else 0,
        "latency_ms": {"p50": pct(50), "p95": pct(95), "p99": p99, "max": round(float(lat.max()), 3) if n else None},
        "queue_wait_ms": {"mean": round(float(wait.mean()), 3) if n else None,
                          "p99": round(float(np.percentile(wait, 99)), 3) if n else None},
        "achieved_fps": round(n / p.seconds, 3),
        "cpu_s_per_frame": round(cpu / batch_frames, 5) if batch_frames else None,
        "mean_batch": round(batch_frames / batches, 3) if batches else None,
        "stage_ms_per_frame": per_frame,
        "faces_per_frame": round(float(np.mean([seen[x][3] for x in window if x in seen])), 3) if n else None,
        "within_budget": bool(n and lost == 0 and p99 is not None and p99 <= p.budget_ms),
    }


# ---------------------------------------------------------------------------------------------- the sweep
def _stop(procs: list, current, jobs, results, collector: threading.Thread | None) -> None:
    """Stop the workers and leave nothing for the interpreter's exit to wait on (a queue feeder thread blocked on a
    pipe that no worker reads any more was a hang after the sweep, until killed)."""
    with deferred_signals():
        current.value = STOP
        for _ in procs:
            jobs.put(None)                      # wakes a worker waiting on an empty queue
        started = [w for w in procs if w.pid is not None]
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for w in started:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in started:
            if w.is_alive():                    # still in a batch (a stuck engine): ended, its batch discarded
                w.terminate()
                w.join(timeout=5)
            if w.is_alive():
                w.kill()
                w.join()
        if collector is not None:
            results.put(None)
            collector.join(timeout=5)
        for q in (jobs, results):
            q.cancel_join_thread()
            q.close()


def sweep(p: Plan, label: str, maker: str, kwargs: dict, frames: list[np.ndarray], progress=print,
          hint: str = "check that the system's engines load") -> dict:
    """Run the sweep of plan `p` on worker processes that each make the system with `maker` (see `_worker`); the
    points, the headline and what was picked. `label` names the system in progress lines and errors."""
    ctx = mp.get_context("spawn")              # no fork after ONNX Runtime / OpenVINO threads exist
    current = ctx.Value("i", -1)
    jobs, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(maker, kwargs, p.threads, frames, p.budget_ms, p.max_batch, current, jobs, results))
             for _ in range(p.workers)]
    inbox: queue.Queue = queue.Queue()
    threads_used = {}
    collector = None
    try:
        for w in procs:
            w.start()
        ready_by = time.monotonic() + READY_TIMEOUT_S
        for _ in procs:
            while True:                 # a worker that dies while loading (killed, out of memory) says nothing
                try:
                    msg = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = next((w for w in procs if not w.is_alive()), None)
                    if dead is not None:
                        try:                # what it said before it exited is in the pipe by now
                            msg = results.get(timeout=0.5)
                            break
                        except queue.Empty:
                            pass
                        raise KilnError(f"{label}: a worker exited (code {dead.exitcode}) while loading the system",
                                        f"{hint}; a worker killed by the OS may have run out of memory") from None
                    if time.monotonic() > ready_by:
                        raise KilnError(f"{label}: a worker did not load the system within "
                                        f"{READY_TIMEOUT_S:.0f} s", hint) from None
            if msg[0] == "error":
                raise KilnError(f"{label}: a worker could not load the system: {msg[2]}", hint)
            threads_used = msg[2]

        def collect():
            while True:
                msg = results.get()
                if msg is None:
                    return
                inbox.put(msg)
        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        points = []
        for i, n in enumerate(p.streams):
            progress(f"{label}: {n} stream(s) × {p.fps:g} fps for {p.seconds:g} s")
            points.append(_point(p, n, i, len(frames), current, jobs, inbox))
            if not points[-1]["within_budget"]:
                break
    finally:
        _stop(procs, current, jobs, results, collector)
    held = [pt["streams"] for pt in points if pt["within_budget"]]
    return {
        "plan": {**asdict(p), "drain_s": p.drain_s, "bound_s": round(p.bound_s, 3), "warmup_s": WARMUP_S,
                 "cores": cores(), "threads_per_engine": threads_used,
                 "why": f"{p.workers} worker process(es) on {cores()} core(s): frames run in parallel across "
                        f"workers, each engine with {p.threads} intra-op thread(s), so workers × threads = cores "
                        "and no engine's threads wait on another's"},
        "points": points,
        "stopped_at": None if len(points) == len(p.streams) and points[-1]["within_budget"] else points[-1]["streams"],
        "streams_at_budget": max(held, default=0),
        "batched": {"detect": "no: each frame its own pyramid and cascade", "align": "no: the aligner graph warps "
                    "one image's faces per call", "embed": "yes: one call for every face of a batch",
                    "match": "yes: one gallery search per batch"},
    }


# ---------------------------------------------------------------------------------------------- over HTTP
class _Current:
    """The point being measured, shared by the client threads (a multiprocessing Value's interface)."""
    value = -1


def _client(url: str, bodies: list[bytes], budget_ms: float, current: _Current, jobs: queue.Queue,
            inbox: queue.Queue) -> None:
    """One connection (a camera): take the next frame due, skip it if already older than the budget (as a worker
    does), POST it, put what came back where `_point` reads it. A 503 (queue full, draining) is a dropped frame."""
    import http.client
    import json
    from urllib.parse import urlsplit

    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        while True:
            item = jobs.get()
            if item is None:
                return
            point, s, k, at, fi = item
            if point != current.value:
                continue
            start = time.monotonic()
            if (start - at) * 1e3 > budget_ms:
                inbox.put(("batch", point, [], [(s, k, at)], {}, 0.0))
                continue
            try:
                conn.request("POST", "/v1/identify", body=bodies[fi], headers={"Content-Type": "image/jpeg"})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()                   # reconnect on the next frame; this one is lost
                inbox.put(("batch", point, [], [(s, k, at)], {}, 0.0))
                continue
            done = time.monotonic()
            if resp.status != 200:
                inbox.put(("batch", point, [], [(s, k, at)], {}, 0.0))
                continue
            doc = json.loads(data)
            inbox.put(("batch", point, [(s, k, at, start, done, len(doc["faces"]))], [], doc.get("timings_ms", {}),
                       0.0))
    finally:
        conn.close()


def _server_counters(url: str) -> dict[str, float]:
    """process CPU seconds, frames and batches from the service's /metrics."""
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode("utf-8")
    want = {"process_cpu_seconds_total": "cpu", "kiln_frames_total": "frames", "kiln_batches_total": "batches"}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


def jpeg(frame: np.ndarray) -> bytes:
    """A frame as a camera client posts it: JPEG, quality 95 (decode the bytes back with `images.decode_bytes` for
    the pixels the service sees)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def sweep_http(p: Plan, url: str, bodies: list[bytes], progress=print, label: str = "serve") -> dict:
    """The same sweep (plan, schedule, budget, stop rule) against a running `kiln-run serve` at `url`: one HTTP
    connection per stream (threads of this process), each frame POSTed as its JPEG `bodies`. CPU seconds per frame
    and the mean batch are the service's (its /metrics before and after each point; warm-up frames included)."""
    frames = bodies
    current = _Current()
    jobs: queue.Queue = queue.Queue()
    inbox: queue.Queue = queue.Queue()
    clients = [threading.Thread(target=_client, args=(url, bodies, p.budget_ms, current, jobs, inbox), daemon=True)
               for _ in range(min(max(p.streams), 256))]
    for c in clients:
        c.start()
    points = []
    try:
        for i, n in enumerate(p.streams):
            progress(f"{label}: {n} stream(s) × {p.fps:g} fps for {p.seconds:g} s over HTTP")
            before = _server_counters(url)
            pt = _point(p, n, i, len(frames), current, jobs, inbox)
            after = _server_counters(url)
            served = after["frames"] - before["frames"]
            pt["cpu_s_per_frame"] = round((after["cpu"] - before["cpu"]) / served, 5) if served else None
            pt["mean_batch"] = round(served / (after["batches"] - before["batches"]), 3) if served else None
            points.append(pt)
            if not pt["within_budget"]:
                break
    finally:
        current.value = STOP
        for _ in clients:
            jobs.put(None)
        for c in clients:
            c.join(timeout=35)
    held = [pt["streams"] for pt in points if pt["within_budget"]]
    return {"plan": {**asdict(p), "drain_s": p.drain_s, "warmup_s": WARMUP_S, "clients": len(clients),
                     "why": "one HTTP connection per stream from this process; the service batches what waits"},
            "points": points,
            "stopped_at": (None if len(points) == len(p.streams) and points[-1]["within_budget"]
                           else points[-1]["streams"]),
            "streams_at_budget": max(held, default=0)}
