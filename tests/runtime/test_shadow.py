"""The shadow rollout's comparison, log and report (kiln_runtime/shadow.py), on Match lists and a real `Shadow` fed by a
stand-in pool. Production and a real candidate release served together are in tests/release/test_system_release.py."""

from __future__ import annotations

import concurrent.futures
import json
import queue
import subprocess
import sys

import pytest

from kiln_runtime import shadow
from kiln_runtime.errors import KilnError
from kiln_runtime.system import Match
from kiln_runtime.workers import Done


def face(x: float, who: str = "ann") -> Match:
    return Match((x, 10.0, x + 50.0, 60.0), 0.99, who, who if who != "unknown" else "bob", 0.4)


def test_faces_pair_by_iou_and_each_aspect_is_judged_apart():
    same = shadow.compare([face(0), face(100, "unknown")], [face(1), face(101, "unknown")])
    assert same["agree"] == {"faces": True, "identities": True, "decisions": True}
    assert same["faces"] == [2, 2] and same["paired"] == 2 and 0.9 < same["iou_min"] < 1
    other = shadow.compare([face(0)], [face(0, "cy")])            # both known, another name: the decision agrees
    assert other["agree"] == {"faces": True, "identities": False, "decisions": True}
    unknown = shadow.compare([face(0)], [face(0, "unknown")])
    assert unknown["agree"] == {"faces": True, "identities": False, "decisions": False}
    moved = shadow.compare([face(0)], [face(40)])                  # IoU 0.11 < 0.5: not the same face
    assert moved["agree"]["faces"] is False and moved["paired"] == 0 and moved["iou_min"] is None
    extra = shadow.compare([face(0)], [face(0), face(200)])
    assert extra["agree"] == {"faces": False, "identities": True, "decisions": True}
    assert shadow.compare([], [])["agree"] == {"faces": True, "identities": True, "decisions": True}


class Pool:
    """A stand-in for the candidate's worker pool: a bounded queue whose frames the test settles by hand."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, []

    def submit(self, body: bytes):
        if len(self.held) >= self.limit:
            raise queue.Full
        fut = concurrent.futures.Future()
        self.held.append(fut)
        return fut


def side(version: int, digest: str) -> shadow.Side:
    return shadow.Side("kiln-system-x", version, "sha256:" + digest * 64, digest * 64, f"embedder-v{version}")


def test_a_share_of_frames_is_compared_logged_and_reported(tmp_path):
    log = tmp_path / "shadow.jsonl"
    head = shadow.header(side(1, "a"), side(2, "b"), 0.5, "its release's build gallery")
    pool = Pool(limit=2)
    s = shadow.Shadow(pool, head, shadow.open_log(log, head))
    prod = Done([face(0)], {"decode": 1.0, "embed": 3.0, "match": 1.0}, (480, 640))
    for i in range(8):                                           # a share of 0.5: every second frame
        s.offer(b"frame %d" % i, prod)
    assert len(pool.held) == 2                                   # four sampled, two past the queue's bound: skipped
    pool.held[0].set_result(Done([face(2)], {"embed": 6.0}, (480, 640)))
    pool.held[1].set_result(Done([face(2, "unknown")], {"embed": 8.0}, (480, 640)))
    s.close()
    header, records = shadow.read_log(log)
    assert header == head and len(records) == 4
    rep = shadow.summarize(header, records)
    assert rep["frames"] == {"sampled": 4, "compared": 2, "skipped": 2, "failed": 0}
    assert rep["agreement"]["faces"] == {"agree": 2, "disagree": 0}
    assert rep["agreement"]["identities"] == rep["agreement"]["decisions"] == {"agree": 1, "disagree": 1}
    assert rep["ms"]["production"]["p99"] == 4.0 and rep["ms"]["candidate"]["p99"] == 8.0   # decode not counted
    assert s.summary()["agreement"] == rep["agreement"]
    assert "kiln_shadow_agreement_total{aspect=\"identities\",result=\"disagree\"} 1" in s.metric_lines()
    text = "\n".join(shadow.report_lines(rep))
    assert "identities         1         1      50.0%" in text and "skipped 2" in text
    assert "2 frame(s) compared (2 skipped, 0 failed)" in shadow.verdict_line(rep)
    assert "ann" not in log.read_text() and "bob" not in log.read_text()    # no names in the log


def test_a_log_is_appended_to_by_its_own_pair_only_and_read_strictly(tmp_path):
    log = tmp_path / "shadow.jsonl"
    head = shadow.header(side(1, "a"), side(2, "b"), 1.0, "the live gallery")
    s = shadow.Shadow(Pool(4), head, shadow.open_log(log, head))
    s.offer(b"x", Done([], {"embed": 1.0}, (1, 1)))
    s.pool.held[0].set_exception(KilnError("the worker running this frame died"))
    s.close()
    with log.open("a") as f:                                     # a service killed mid-line
        f.write('{"frame": "cut')
    shadow.open_log(log, head).close()                           # a restart of the same pair: appended to
    header, records = shadow.read_log(log)
    assert [r.get("failed") for r in records] == ["the worker running this frame died"]
    with pytest.raises(KilnError, match="not of this pair"):
        shadow.open_log(log, shadow.header(side(1, "a"), side(3, "c"), 1.0, "x"))
    bad = tmp_path / "bad.jsonl"
    for text, msg in (("", "no kiln-shadow/1 header"), ("{\n", "a line is not JSON"),
                      (json.dumps(head) + "\n" + '{"frame": 1}\n', "malformed")):
        bad.write_text(text)
        with pytest.raises(KilnError, match=msg):
            shadow.read_log(bad)


def test_shadow_options_are_checked_at_the_edge(tmp_path):
    def run(*args: str):
        return subprocess.run([sys.executable, "-m", "kiln_runtime.cli", *args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)

    base = ("serve", "x.tar.gz", "--key", "k.pub", "--port", "8080")
    r = run(*base, "--shadow", "y.tar.gz")
    assert r.returncode == 2 and "--shadow needs --shadow-log FILE" in r.stderr and "Traceback" not in r.stderr
    r = run(*base, "--shadow-log", "s.jsonl")
    assert r.returncode == 2 and "--shadow-log without --shadow CANDIDATE" in r.stderr
    r = run(*base, "--shadow", "y.tar.gz", "--shadow-log", "s.jsonl", "--shadow-share", "1.5")
    assert r.returncode == 2 and "above 0 and at most 1" in r.stderr
    r = run("shadow-report", str(tmp_path / "none.jsonl"))
    assert r.returncode == 2 and "cannot read the shadow log" in r.stderr and "Traceback" not in r.stderr


def test_promote_takes_a_shadow_report_only_for_a_system_and_reads_it_first(tmp_path, capsys, monkeypatch):
    """`kiln promote --shadow-report LOG`: a face system's only; a log that is not one is refused in one line before
    the registry is asked anything (the move with a real report: tests/release/test_system_release.py)."""
    from pipeline import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")          # nothing listens: never asked
    assert cli.main(["promote", "kiln-x", "1", "--shadow-report", "s.jsonl"]) == 2
    assert "--shadow-report is for a face system" in capsys.readouterr().err
    (tmp_path / "s.jsonl").write_text("not json\n")
    assert cli.main(["promote", "--system", "dlib-mtcnn", "2", "--shadow-report", "s.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "s.jsonl: not a shadow log" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2
