"""A shadow rollout: `kiln-run serve PROD --shadow CANDIDATE` runs a candidate system release beside production on a
sampled share of the requests. It never answers with the candidate; it records, per frame, whether the candidate
finds the same faces, names the same identities and makes the same decisions as production, and both systems'
per-frame time.

    request ─► production's workers ─► its answer, sent as without a shadow
                   └─ sampled: the same bytes ─► the candidate's pool ─► compared with production's ─► the log

* **Off the request's path.** A frame is offered to the candidate once production's answer has been sent (a
  background task of that response): a put on an in-process queue, never a wait. The candidate's frames run in worker
  processes of their own (kiln_runtime/workers.py), one thread per engine, at a lower CPU priority (nice +10) than
  production's.
* **Bounded.** At most `queue` candidate frames wait or run; a frame sampled while the candidate is that far behind
  is skipped and counted (`skipped`), never queued without bound. A candidate worker that dies is replaced as
  production's are; its frames are counted `failed`; production never sees it.
* **Compared as system@'s gate compares** (pipeline/gates/system.py): each production face (best first) is paired
  with the candidate face of best box IoU, at least MATCH_IOU. `faces` agree when both found as many faces and every
  production face is paired; `identities` when every paired face has the same identity (a name, or unknown);
  `decisions` when every paired face gets the same decision (a known person, or not) at each system's own
  threshold. A frame without faces in either agrees.
* **The log** (`--shadow-log FILE`, JSON lines) is the record: a header naming both releases by content (archive
  sha256, system digest, embedder engine), then one line per sampled frame — its sha256 prefix, the time, what was
  compared (counts, the smallest paired IoU, the three agreements, both systems' per-frame ms) or why it was not.
  No names and no pixels: an erased person stays erased. A restarted service appends to a log of the same pair and
  refuses one of another pair. `kiln-run shadow-report LOG` summarises it; `/v1/shadow` and /metrics show the same
  counts live; `kiln promote --system NAME V --shadow-report LOG` records the summary with the move.

A frame's time is its share of its batch's stage times (the sum over detect, align, embed, match), as /metrics'
stage histograms count it: the same definition for both systems, measured in each system's own workers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln_runtime.errors import KilnError
from kiln_runtime.mtcnn import box_iou

FORMAT = "kiln-shadow/1"
MATCH_IOU = 0.5                # pipeline/gates/system.py's pairing rule
ASPECTS = ("faces", "identities", "decisions")
NICE = 10                      # the candidate's workers: below production's CPU priority
LIVE_WINDOW = 10_000           # compared frames the live percentiles (/v1/shadow, /metrics) cover; counts are all


# ---------------------------------------------------------------------------------------------- comparing
def compare(prod: list, cand: list) -> dict[str, Any]:
    """One frame: production's matches against the candidate's (kiln_runtime.system.Match lists, best first)."""
    used: set[int] = set()
    pairs, ious = [], []
    for p in prod:
        iou, j = max(((box_iou(p.box, c.box), j) for j, c in enumerate(cand) if j not in used), default=(0.0, None))
        if j is not None and iou >= MATCH_IOU:
            used.add(j)
            pairs.append((p, cand[j]))
            ious.append(iou)
    return {"faces": [len(prod), len(cand)], "paired": len(pairs),
            "iou_min": round(min(ious), 4) if ious else None,
            "agree": {"faces": len(prod) == len(cand) == len(pairs),
                      "identities": all(p.identity == c.identity for p, c in pairs),
                      "decisions": all((p.identity == "unknown") == (c.identity == "unknown") for p, c in pairs)}}


def frame_ms(share: dict[str, float]) -> float:
    return round(sum(v for k, v in share.items() if k != "decode"), 3)


# ---------------------------------------------------------------------------------------------- the summary
def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))], 3)     # nearest rank


class Tally:
    """Counts over frame records, and the frame times for the percentiles (the last `window` compared frames; all of
    them when None): one summary for the log (`shadow-report`, promote) and the live service (/v1/shadow, /metrics,
    whose counters must only grow)."""

    def __init__(self, window: int | None = None) -> None:
        self.frames = {"sampled": 0, "compared": 0, "skipped": 0, "failed": 0}
        self.agreement = {a: {"agree": 0, "disagree": 0} for a in ASPECTS}
        self.faces = {"production": 0, "candidate": 0}
        self.ms = {"production": deque(maxlen=window), "candidate": deque(maxlen=window)}
        self.first = self.last = None

    def add(self, r: dict) -> None:
        self.frames["sampled"] += 1
        if "agree" in r:
            self.frames["compared"] += 1
            for a in ASPECTS:
                self.agreement[a]["agree" if r["agree"][a] else "disagree"] += 1
            for i, k in enumerate(("production", "candidate")):
                self.faces[k] += r["faces"][i]
                self.ms[k].append(r["ms"][k])
        else:
            self.frames["skipped" if "skipped" in r else "failed"] += 1
        if (at := r.get("at")) is not None:
            self.first = at if self.first is None else min(self.first, at)
            self.last = at if self.last is None else max(self.last, at)

    def summary(self, header: dict) -> dict[str, Any]:
        return {"format": FORMAT, "production": header["production"], "candidate": header["candidate"],
                "share": header.get("share"), "candidate_gallery": header.get("candidate_gallery"),
                "frames": dict(self.frames), "agreement": {a: dict(v) for a, v in self.agreement.items()},
                "faces": dict(self.faces), "first": self.first, "last": self.last,
                "ms": {k: {"p50": _pct(list(v), 50), "p99": _pct(list(v), 99), "n": len(v)}
                       for k, v in self.ms.items()}}


def summarize(header: dict, records) -> dict[str, Any]:
    """The report over a log's header and every frame record (what `shadow-report` and promote show)."""
    t = Tally()
    for r in records:
        t.add(r)
    return t.summary(header)


def verdict_line(s: dict) -> str:
    """One line: what promote records and prints."""
    a, f = s["agreement"], s["frames"]
    p99 = {k: s["ms"][k]["p99"] for k in ("production", "candidate")}
    return (f"shadow of {s['candidate']['name']} v{s['candidate']['version']} beside {s['production']['name']} "
            f"v{s['production']['version']}: {f['compared']} frame(s) compared ({f['skipped']} skipped, {f['failed']} "
            "failed); agree on " + ", ".join(f"{k} {a[k]['agree']}/{f['compared']}" for k in ASPECTS) +
            f"; p99 {p99['production']} ms vs {p99['candidate']} ms")


def read_log(path: Path) -> tuple[dict, list[dict]]:
    """A shadow log's header and frame records; one `KilnError` line for anything that is not one. A last line cut
    short (the service killed mid-write) is left out."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise KilnError(f"{path}: cannot read the shadow log ({e.strerror})",
                        "pass the file kiln-run serve --shadow-log wrote") from None
    lines = raw.split(b"\n")
    if lines and lines[-1]:
        lines = lines[:-1]                     # no newline yet: a write the service did not finish
    try:
        docs = [json.loads(ln) for ln in lines if ln.strip()]
    except (ValueError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not a shadow log (a line is not JSON: {str(e)[:80]})",
                        "pass the file kiln-run serve --shadow-log wrote") from None
    if not docs or not isinstance(docs[0], dict) or docs[0].get("format") != FORMAT:
        raise KilnError(f"{path}: not a shadow log (no {FORMAT} header)",
                        "pass the file kiln-run serve --shadow-log wrote")
    body = docs[1:]
    if not all(isinstance(d, dict) and ("agree" in d and isinstance(d.get("faces"), list) and "ms" in d
                                        or "skipped" in d or "failed" in d) for d in body):
        raise KilnError(f"{path}: a frame record of the shadow log is malformed", "pass the file kiln-run serve "
                        "--shadow-log wrote, unedited")
    return docs[0], body


# ---------------------------------------------------------------------------------------------- the service side
@dataclass(frozen=True)
class Side:
    """A release as the log names it: by content."""
    name: str
    version: int
    archive_sha256: str
    system_sha256: str
    embedder: str

    def doc(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "archive_sha256": self.archive_sha256,
                "system_sha256": self.system_sha256, "embedder": self.embedder}


def side(info) -> Side:
    """A kiln_runtime.serve.ReleaseInfo as the log names it."""
    return Side(info.name, info.version, info.archive_sha256, info.system_sha256, str(info.embedder.get("engine")))


class Shadow:
    """The candidate's pool, the sampling, the comparison and the log, for one service."""

    def __init__(self, pool, header: dict, log, say: Callable[..., None] = print) -> None:
        self.pool, self.header, self.log, self.say = pool, header, log, say    # log: open_log's file
        self.share = float(header["share"])
        self.lock = threading.Lock()
        self.acc = 0.0
        self.tally = Tally(LIVE_WINDOW)

    # -- the request's side: never waits
    def offer(self, body: bytes, done) -> None:
        """Production answered `done` for `body`: run the candidate on it too when this frame is in the share."""
        with self.lock:
            self.acc += self.share
            if self.acc < 1.0 - 1e-9:
                return
            self.acc -= 1.0
        base = {"frame": hashlib.sha256(body).hexdigest()[:16], "at": round(time.time(), 3)}
        try:
            fut = self.pool.submit(body)
        except queue.Full:
            return self._record({**base, "skipped": "the candidate is behind: its queue is full"})
        except KilnError as e:                         # no candidate worker ready (one being replaced)
            return self._record({**base, "skipped": e.message[:200]})
        prod, prod_ms = done.found, frame_ms(done.share)
        fut.add_done_callback(lambda f: self._compared(f, base, prod, prod_ms))

    def _compared(self, fut, base: dict, prod: list, prod_ms: float) -> None:
        try:
            got = fut.result()
        except KilnError as e:
            return self._record({**base, "failed": e.message[:200]})
        except Exception as e:  # noqa: BLE001 — the candidate's failure is a count, never production's problem
            return self._record({**base, "failed": f"{type(e).__name__}: {str(e)[:200]}"})
        self._record({**base, **compare(prod, got.found), "ms": {"production": prod_ms,
                                                                  "candidate": frame_ms(got.share)}})

    def _record(self, rec: dict) -> None:
        line = json.dumps(rec, sort_keys=True) + "\n"
        with self.lock:
            self.tally.add(rec)
            if self.log is not None:
                try:
                    self.log.write(line)
                    self.log.flush()
                except (OSError, ValueError) as e:    # a full disk: the shadow stops logging, production serves on
                    self.say(f"kiln-run: shadow: the log could not be written ({e}); no more frames are logged",
                             file=sys.stderr, flush=True)
                    self.log = None

    # -- what the service shows
    def summary(self) -> dict[str, Any]:
        with self.lock:
            s = self.tally.summary(self.header)
        s["ms_window"] = LIVE_WINDOW
        return s

    def metric_lines(self) -> list[str]:
        s = self.summary()
        out = ["# HELP kiln_shadow_frames_total Frames sampled for the shadow candidate, by outcome.",
               "# TYPE kiln_shadow_frames_total counter",
               *(f'kiln_shadow_frames_total{{outcome="{k}"}} {s["frames"][k]}'
                 for k in ("compared", "skipped", "failed")),
               "# HELP kiln_shadow_agreement_total Compared frames on which the candidate agrees with production.",
               "# TYPE kiln_shadow_agreement_total counter",
               *(f'kiln_shadow_agreement_total{{aspect="{a}",result="{r}"}} {s["agreement"][a][r]}'
                 for a in ASPECTS for r in ("agree", "disagree")),
               "# HELP kiln_shadow_frame_ms_p99 The 99th percentile of a compared frame's system time, per system.",
               "# TYPE kiln_shadow_frame_ms_p99 gauge",
               *(f'kiln_shadow_frame_ms_p99{{system="{k}"}} {_gauge(s["ms"][k]["p99"])}'
                 for k in ("production", "candidate")),
               "# HELP kiln_shadow_info The candidate release run in shadow.",
               "# TYPE kiln_shadow_info gauge",
               f'kiln_shadow_info{{system="{s["candidate"]["name"]}",version="{s["candidate"]["version"]}"}} 1']
        return out

    def close(self) -> None:
        with self.lock:
            if self.log is not None:
                self.log.close()
                self.log = None


def header(production: Side, candidate: Side, share: float, candidate_gallery: str) -> dict[str, Any]:
    """A log's first line: the pair by content, the share, the gallery the candidate identified against."""
    return {"format": FORMAT, "production": production.doc(), "candidate": candidate.doc(), "share": share,
            "candidate_gallery": candidate_gallery}


def open_log(path: Path, header: dict):
    """The log opened for appending: a new file starts with `header`; an existing one must be of the same pair
    (a restart goes on with it), else one line naming both."""
    path = Path(path)
    if path.exists():
        old, _ = read_log(path)
        keys = ("archive_sha256", "system_sha256")
        if any({k: old[side].get(k) for k in keys} != {k: header[side][k] for k in keys}
               for side in ("production", "candidate")):
            raise KilnError(f"{path} is the shadow log of {old['candidate'].get('name')} "
                            f"v{old['candidate'].get('version')} beside {old['production'].get('name')} "
                            f"v{old['production'].get('version')}, not of this pair",
                            "pass a new --shadow-log FILE for this pair")
        try:
            data = path.read_bytes()
            if not data.endswith(b"\n"):            # a line a killed service left unfinished: dropped
                os.truncate(path, data.rfind(b"\n") + 1)
            return open(path, "a", encoding="utf-8")
        except OSError as e:
            raise KilnError(f"{path}: cannot append to the shadow log ({e.strerror})", "pass a writable "
                            "--shadow-log FILE") from None
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise KilnError(f"{path}: its folder {folder} does not exist or is not writable",
                        "pass --shadow-log in a writable folder")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(header, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)                      # the header whole or no log at all
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KilnError(f"{path}: cannot write the shadow log ({e.strerror})", "pass a writable --shadow-log FILE") \
            from None


# ---------------------------------------------------------------------------------------------- the report
def report_lines(s: dict) -> list[str]:
    """`kiln-run shadow-report`'s table."""
    from kiln_runtime.text import shown

    p, c, f = s["production"], s["candidate"], s["frames"]
    when = ""
    if s["first"] is not None:
        fmt = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))     # noqa: E731
        when = f", {fmt(s['first'])} to {fmt(s['last'])} UTC"
    out = [f"shadow: {shown(c['name'], 200)} v{c['version']} (candidate, embedder {shown(c['embedder'], 200)}) beside "
           f"{shown(p['name'], 200)} v{p['version']} (production, embedder {shown(p['embedder'], 200)})",
           f"share {s['share']}{when}; the candidate identified against {shown(str(s['candidate_gallery']), 200)}",
           f"frames sampled {f['sampled']}: compared {f['compared']}, skipped {f['skipped']} (the candidate behind), "
           f"failed {f['failed']}",
           f"{'':12}{'agree':>8}{'disagree':>10}{'agreement':>11}"]
    for a in ASPECTS:
        g, d = s["agreement"][a]["agree"], s["agreement"][a]["disagree"]
        out.append(f"{a:12}{g:>8}{d:>10}{(f'{g / (g + d):.1%}' if g + d else '—'):>11}")
    out.append(f"faces found: production {s['faces']['production']}, candidate {s['faces']['candidate']}")
    out.append(f"{'frame ms':12}{'p50':>8}{'p99':>10}")
    for k in ("production", "candidate"):
        m = s["ms"][k]
        out.append(f"{k:12}{_num(m['p50']):>8}{_num(m['p99']):>10}")
    return out


def _gauge(v) -> str:
    return "NaN" if v is None else f"{v:g}"


def _num(v) -> str:
    return "—" if v is None else f"{v:.2f}"


__all__ = ["ASPECTS", "FORMAT", "MATCH_IOU", "Shadow", "Side", "Tally", "compare", "header", "open_log", "read_log",
           "report_lines", "side", "summarize", "verdict_line"]
