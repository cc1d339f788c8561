"""What `kiln-run serve` counts and shows at /metrics (Prometheus text format 0.0.4): requests and errors by reason,
request and per-stage latency histograms, frames, faces and batches, the queue, the workers and their replacements,
connections and the bounds that closed them, the live gallery's version and size, CPU time; a shadow candidate's
frames and agreement (kiln_runtime/shadow.py). Every update under one lock: the feeder threads and the event loop both
write."""

from __future__ import annotations

import threading
import time

from kiln_runtime.errors import KilnError
from kiln_runtime.system import STAGES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


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


def _family(name: str, kind: str, doc: str, *lines: str) -> list[str]:
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]


class Metrics:
    """What /metrics shows; every update under one lock (feeder threads and the event loop both write)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.connection_events: dict[str, int] = {}
        self.latency = Histogram()
        self.stages = {s: Histogram() for s in ("decode", *STAGES)}
        self.frames = self.faces = self.batches = 0
        self.inflight = 0
        self.worker_cpu = 0.0
        self.gallery_writes: dict[str, int] = {}

    def gallery_write(self, op: str) -> None:
        with self.lock:
            self.gallery_writes[op] = self.gallery_writes.get(op, 0) + 1

    def count(self, status: int, reason: str | None = None) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            if reason:
                self.errors[reason] = self.errors.get(reason, 0) + 1

    def event(self, name: str) -> None:
        with self.lock:
            self.connection_events[name] = self.connection_events.get(name, 0) + 1

    def batch(self, frames: int, share: dict[str, float], cpu: float, faces: int) -> None:
        with self.lock:
            self.worker_cpu += cpu
            self.batches += 1
            self.frames += frames
            self.faces += faces
            for _ in range(frames):
                for st, ms in share.items():
                    if st in self.stages:
                        self.stages[st].observe(ms / 1e3)

    def text(self, service, connections: int) -> str:
        """The exposition of everything counted, with the service's (kiln_runtime/serve.py Service) pool, release,
        state and live gallery read now."""
        pool, info = service.pool, service.info
        gallery: list[str] = []
        if service.reader is not None and service.reader_lock.acquire(timeout=1.0):
            try:                                 # the read-only connection: never behind a write (WAL)
                with service.reader.reading():
                    version, (subjects, faces) = service.reader.version(), service.reader.counts()
            except KilnError:
                version = subjects = faces = -1
            finally:
                service.reader_lock.release()
            gallery = [*_family("kiln_gallery_version", "gauge", "The live gallery's version (its last event).",
                                f"kiln_gallery_version {version}"),
                       *_family("kiln_gallery_subjects", "gauge", "Subjects in the live gallery.",
                                f"kiln_gallery_subjects {subjects}"),
                       *_family("kiln_gallery_faces", "gauge", "Faces in the live gallery.",
                                f"kiln_gallery_faces {faces}")]
        with self.lock:
            out = [*_family("kiln_release_info", "gauge", "The system release served.",
                            f'kiln_release_info{{system="{info.name}",version="{info.version}"}} 1'),
                   *_family("kiln_ready", "gauge", "1 while /readyz answers 200 (a worker ready, not draining).",
                            f"kiln_ready {int(service.is_ready())}"),
                   *_family("kiln_draining", "gauge", "1 from SIGTERM on.", f"kiln_draining {int(service.draining)}"),
                   *_family("kiln_workers", "gauge", "Worker processes configured.",
                            f"kiln_workers {len(pool.slots)}"),
                   *_family("kiln_workers_ready", "gauge", "Worker processes ready to take frames.",
                            f"kiln_workers_ready {pool.ready}"),
                   *_family("kiln_worker_restarts_total", "counter", "Workers replaced after dying or running a "
                            "batch past the time bound.", f"kiln_worker_restarts_total {pool.restarts}"),
                   *_family("kiln_requests_total", "counter", "Requests to /v1/identify by HTTP status.",
                            *(f'kiln_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items()))),
                   *_family("kiln_errors_total", "counter", "Refused or failed identify requests by reason.",
                            *(f'kiln_errors_total{{reason="{r}"}} {n}' for r, n in sorted(self.errors.items()))),
                   *_family("kiln_request_duration_seconds", "histogram", "Identify requests answered 200: body "
                            "read to answer.", *self.latency.lines("kiln_request_duration_seconds")),
                   *_family("kiln_stage_duration_seconds", "histogram", "Time per frame in each stage of the system.",
                            *(ln for s, h in self.stages.items()
                              for ln in h.lines("kiln_stage_duration_seconds", f'stage="{s}"'))),
                   *_family("kiln_frames_total", "counter", "Frames identified.", f"kiln_frames_total {self.frames}"),
                   *_family("kiln_faces_total", "counter", "Faces found.", f"kiln_faces_total {self.faces}"),
                   *_family("kiln_batches_total", "counter", "Batches the workers ran (frames / batches = mean "
                            "batch).", f"kiln_batches_total {self.batches}"),
                   *_family("kiln_queue_depth", "gauge", "Frames in the service: queued or being run (--queue "
                            "bounds it).", f"kiln_queue_depth {pool.held()}"),
                   *_family("kiln_inflight_requests", "gauge", "Identify requests being answered.",
                            f"kiln_inflight_requests {self.inflight}"),
                   *_family("kiln_connections", "gauge", "Open HTTP connections (--max-connections bounds them).",
                            f"kiln_connections {connections}"),
                   *_family("kiln_connection_events_total", "counter", "Connections closed by a bound: header_timeout, "
                            "body_timeout, evicted (room for a new one at the limit), refused.",
                            *(f'kiln_connection_events_total{{event="{e}"}} {n}'
                              for e, n in sorted(self.connection_events.items()))),
                   *gallery,
                   *_family("kiln_gallery_writes_total", "counter", "Gallery writes acknowledged, by operation.",
                            *(f'kiln_gallery_writes_total{{op="{o}"}} {n}'
                              for o, n in sorted(self.gallery_writes.items()))),
                   *_family("process_cpu_seconds_total", "counter", "CPU time of the service: this process and its "
                            "workers' batches.",
                            f"process_cpu_seconds_total {time.process_time() + self.worker_cpu:.6f}")]
        if getattr(service, "shadow", None) is not None:
            out += service.shadow.metric_lines()
        return "\n".join(out) + "\n"


__all__ = ["Histogram", "LATENCY_BUCKETS", "Metrics"]
