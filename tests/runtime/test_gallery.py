"""kiln_runtime/gallery.py, gallery_audit.py, gallery_cache.py and snapshots.py: the live gallery store on a real
SQLite file — binding by content, the hash-chained log and its audit, erasure receipts, the search cache, signed
snapshots and restore, crash safety.
(The store behind a real served release, enrolled from real photos: tests/release/test_system_release.py.)"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kiln_runtime import gallery as g
from kiln_runtime.gallery_audit import audit
from kiln_runtime.gallery_cache import Live
from kiln_runtime import snapshots
from kiln_runtime.errors import GateFailed, KilnError
from pipeline.release import signing

DIM = 8
BINDING = g.Binding("embedder-ort-cpu-int8", "ab" * 16, DIM, 150, ((46.4, 44.1), (100.9, 44.0), (73.3, 75.4),
                                                                   (49.3, 103.8), (101.4, 103.4)), None, "l2", 0.6)
OTHER = g.Binding("embedder-ort-cpu-fp32", "cd" * 16, DIM, 150, BINDING.template, None, "l2", 0.6)


def vec(i: int) -> np.ndarray:
    return np.random.default_rng(i).normal(size=DIM).astype(np.float32)


def enrol(store: g.Store, subject: str, i: int, crop: bytes | None = b"crop") -> g.Face:
    face, _, new = store.enrol(subject, vec(i), crop + bytes([i % 256]) if crop else None,
                               [[1, 2]] * 5, [0, 0, 10, 10], 0.99, f"{i:064x}", "alice", "test")
    assert new
    return face


@pytest.fixture
def store(tmp_path) -> g.Store:
    s = g.create(tmp_path / "gallery.sqlite", BINDING, "alice", "a site's gallery")
    yield s
    s.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return signing.keygen(tmp_path_factory.mktemp("gallery-keys") / "site.pem")


def test_a_store_is_bound_to_its_embedder_by_content(store, tmp_path):
    store.bound_to(BINDING)
    with pytest.raises(GateFailed, match=r"enrolled by embedder embedder-ort-cpu-int8 abababababab, but the release "
                                         r"embeds with embedder-ort-cpu-fp32 cdcdcdcdcdcd \(differs in embedder, "
                                         r"embedder_xxh3_128\): refusing to mix vectors") as e:
        store.bound_to(OTHER, "the release")
    assert "enrol the people again" in e.value.hint
    moved = g.Binding(**{**BINDING.__dict__, "threshold": 0.5})             # same weights, another threshold
    with pytest.raises(GateFailed, match=r"differs in threshold"):
        store.bound_to(moved)
    with pytest.raises(KilnError, match="already exists"):
        g.create(store.path, BINDING, "a", "b")
    (tmp_path / "not.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(KilnError, match="not a Kiln gallery store"):
        g.Store(tmp_path / "not.sqlite")


def test_enrol_delete_erase_and_the_receipt(store, tmp_path, keys):
    a1, a2 = enrol(store, "ada", 1), enrol(store, "ada", 2)
    b1 = enrol(store, "bob", 3)
    again, version, new = store.enrol("ada", vec(1), b"crop\x01", [[1, 2]] * 5, [0, 0, 10, 10], 0.99, f"{1:064x}",
                                      "alice", "twice")
    assert not new and again.id == a1.id and version == 4                   # the same face: nothing written
    assert store.subjects() == [("ada", 2), ("bob", 1)] and store.version() == 4
    path, sha, at = snapshots.take(store, tmp_path, keys[0])
    assert at == 4 and path.name.startswith("kiln-gallery-") and path.name.endswith("-v4.tar.gz")
    assert store.delete_face(a2.id, "alice", "blurry") == 6
    with pytest.raises(KilnError, match="no face"):
        store.delete_face(a2.id, "alice", "again")
    receipt = store.erase("ada", "dpo", "GDPR art. 17 request #12")
    assert receipt["faces_erased"] == [a1.digest] and receipt["versions_that_held"] == [[2, 6]]
    assert receipt["version_without"] == 7 and receipt["snapshots_that_hold"] == [
        {"sha256": sha, "version": 4, "path": str(path.resolve()), "event": 5}]     # the snapshot is event #5
    assert receipt["event"] == store.head() and "delete them" in receipt["note"]
    with sqlite3.connect(store.path) as raw:                                # nothing of her is left
        assert raw.execute("SELECT count(*) FROM faces WHERE subject = 'ada'").fetchone() == (0,)
    assert [f.id for f in store.faces()] == [b1.id]
    again = store.erase("ada", "dpo", "again")                              # held before: still a receipt
    assert again["faces_erased"] == [] and again["versions_that_held"] == [[2, 6]] and again["snapshots_that_hold"]
    with pytest.raises(KilnError, match="no subject nobody in the gallery, now or before"):
        store.erase("nobody", "dpo", "never here")
    for bad in ("unknown", "../x", "a b", "x" * 65, "\x1b[2J"):
        with pytest.raises(KilnError, match="not a valid subject id"):
            store.enrol(bad, vec(9), None, None, [0, 0, 1, 1], 1.0, None, "a", "r")
    for bad in ("\x1b]8;;https://e\x07", "r" * 501, "two\nlines"):
        with pytest.raises(KilnError, match="control character|over 500"):
            g.check_text(bad, "reason", "")
    report = audit(store, expect=[receipt["event"]])
    assert report.problems == [] and (report.events, report.faces, report.subjects) == (8, 1, 1)
    assert "not in its log" in audit(store, expect=["ab" * 32]).problems[0]


def test_the_audit_names_what_was_changed_behind_kilns_back(store):
    """Rows edited, added or removed with plain SQL, and events edited or removed (triggers dropped first): each
    is named; the log itself refuses an UPDATE or DELETE while its triggers stand."""
    a, b = enrol(store, "ada", 1), enrol(store, "bob", 2)
    c = enrol(store, "cy", 3)
    raw = sqlite3.connect(store.path, isolation_level=None)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        raw.execute("UPDATE events SET reason = 'x' WHERE seq = 2")
    raw.execute("UPDATE faces SET embedding = ? WHERE id = ?", (vec(7).tobytes(), a.id))          # swapped vector
    raw.execute("UPDATE faces SET subject = 'eve' WHERE id = ?", (b.id,))                         # relabelled
    raw.execute("UPDATE faces SET landmarks = '[[0, 0]]' WHERE id = ?", (c.id,))                   # moved marks
    d = enrol(store, "dee", 4)
    raw.execute("DELETE FROM faces WHERE id = ?", (d.id,))                                        # quietly removed
    raw.execute("INSERT INTO faces SELECT 'planted', 'mallory', 'x' || digest, embedding, crop, landmarks, box, "
                "score, source_sha256, created, event FROM faces WHERE id = ?", (a.id,))
    raw.execute("DROP TRIGGER events_no_update")
    raw.execute("UPDATE events SET actor = 'someone-else' WHERE seq = 2")
    raw.close()
    problems = audit(store).problems
    joined = "\n".join(problems)
    assert f"face {a.id} of ada: its stored bytes are not what event #2 enrolled" in joined
    assert f"face {b.id} of eve: its stored bytes are not what event #3 enrolled" in joined
    assert f"face {c.id} of cy: its stored bytes are not what event #4 enrolled" in joined
    assert f"face {d.id} of dee: enrolled by event #5 and never deleted, but missing" in joined
    assert "face planted of mallory: stored, but no event enrolled it" in joined
    assert "event #2 (enrol ada): its hash does not match its content" in joined
    raw = sqlite3.connect(store.path, isolation_level=None)
    raw.execute("DROP TRIGGER events_no_delete")
    raw.execute("DELETE FROM events WHERE seq = 3")
    raw.close()
    assert any("event #3: missing" in p for p in audit(store).problems)


def test_the_search_cache_follows_the_store_incrementally(store, tmp_path):
    """`Live` after enrolments, deletions and an erasure made by another connection (another process's writes look
    the same) holds exactly what a fresh load holds."""
    live = Live(store.path, BINDING)
    assert live.gallery()[0].shape == (0, DIM)
    faces = [enrol(store, f"p{i % 7}", i) for i in range(40)]
    assert live.refresh() and not live.refresh()
    store.delete_face(faces[3].id, "a", "r")
    store.erase("p5", "a", "r")
    enrol(store, "late", 99)
    live.refresh()
    emb, labels = live.gallery()
    fresh = Live(store.path, BINDING).gallery()
    got = sorted(zip(labels, map(tuple, emb)))
    assert got == sorted(zip(fresh[1], map(tuple, fresh[0]))) and "p5" not in labels and "late" in labels
    with pytest.raises(GateFailed, match="refusing to mix vectors"):
        Live(store.path, OTHER)


def test_a_signed_snapshot_restores_and_never_brings_back_an_erased_subject(store, tmp_path, keys):
    a, b = enrol(store, "ada", 1), enrol(store, "bob", 2)
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    twin = tmp_path / "twin.sqlite"                                          # the same store, byte for byte
    twin.write_bytes(store.path.read_bytes())
    path, sha, version = snapshots.take(store, tmp_path, keys[0])
    (tmp_path / "other").mkdir()
    again, sha2, version2 = snapshots.take(g.Store(twin), tmp_path / "other", keys[0])
    assert (again.name, sha2, version2) == (path.name, sha, version) == (path.name, sha, 3)   # content-addressed
    assert store.events()[-1].action == g.SNAPSHOT and store.version() == 4   # the snapshot is in the log
    store.delete_face(b.id, "a", "gone")
    enrol(store, "cy", 3)
    summary = snapshots.restore(store, path, keys[1], "ops", "roll back a bad import")
    assert (summary["added"], summary["removed"]) == (1, 1) and summary["erased_brought_back"] == []
    assert sorted(f.subject for f in store.faces()) == ["ada", "bob"] and audit(store).problems == []
    store.erase("ada", "dpo", "request")
    with pytest.raises(GateFailed, match=r"holds 1 subject\(s\) erased from this gallery since it was taken \(ada\)"):
        snapshots.restore(store, path, keys[1], "ops", "again")
    assert "ada" not in {f.subject for f in store.faces()}
    forced = snapshots.restore(store, path, keys[1], "ops", "court order", allow_erased=True)
    assert forced["erased_brought_back"] == ["ada"] and "brings back erased ada" in store.events()[-1].reason
    assert audit(store).problems == []
    # another key, a flipped byte, another embedder's snapshot: refused before anything changes
    _, other_pub = signing.keygen(tmp_path / "other" / "k.pem")
    before = store.version()
    with pytest.raises(GateFailed, match="signature"):
        snapshots.restore(store, path, other_pub, "ops", "x")
    bad = tmp_path / "bad.tar.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(GateFailed):
        snapshots.restore(store, bad, keys[1], "ops", "x")
    foreign = g.create(tmp_path / "foreign.sqlite", OTHER, "a", "b")
    enrol(foreign, "zed", 5)
    fpath, _, _ = snapshots.take(foreign, tmp_path, keys[0])
    with pytest.raises(GateFailed, match="a snapshot of a gallery enrolled by embedder embedder-ort-cpu-fp32"):
        snapshots.restore(store, fpath, keys[1], "ops", "x")
    assert store.version() == before


def test_model_signing_verifies_a_snapshot_as_it_verifies_a_release(store, tmp_path, keys):
    """The runtime signs snapshots without model-signing; model-signing's own verifier accepts what it signed."""
    import tarfile

    from model_signing import hashing, verifying

    enrol(store, "ada", 1)
    path, _, _ = snapshots.take(store, tmp_path, keys[0])
    with tarfile.open(path) as t:
        t.extractall(tmp_path / "x", filter="data")
    tree = next(p for p in (tmp_path / "x").iterdir() if p.is_dir())
    verifying.Config().use_elliptic_key_verifier(public_key=keys[1]).set_hashing_config(
        hashing.Config().use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
        .set_ignored_paths(paths=[], ignore_git_paths=False)).verify(tree, tree.with_name(tree.name + ".sig"))


WRITER = """
import sys, numpy as np
from kiln_runtime import gallery as g
from kiln_runtime.gallery_audit import audit
from kiln_runtime.gallery_cache import Live
s = g.Store(sys.argv[1])
for i in range(100000):
    face, version, _ = s.enrol(f"s{i % 50}", np.random.default_rng(i).normal(size=8).astype(np.float32),
                               b"crop" * 2000, None, [0, 0, 1, 1], 1.0, None, "writer", "load")
    print(face.id, flush=True)
"""


def test_sigkill_mid_enrol_loses_nothing_acknowledged_and_leaves_nothing_half_written(store, tmp_path):
    """A writer enrolling as fast as it can, killed with SIGKILL: every face it acknowledged (printed after its
    commit) is in the store, nothing else is half there, and the chain verifies."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store.path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(g.__file__).parents[1])})
    acked: list[str] = []
    t0 = time.monotonic()
    while len(acked) < 150:
        acked.append(proc.stdout.readline().strip())
        assert time.monotonic() - t0 < 60
    proc.send_signal(signal.SIGKILL)
    acked += [ln.strip() for ln in proc.stdout.read().splitlines()]
    proc.wait()
    stored = {f.id for f in g.Store(store.path).faces()}
    assert set(filter(None, acked)) <= stored
    report = audit(g.Store(store.path))
    assert report.problems == [] and report.faces == report.events - 1 == len(stored)


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_a_large_gallery_is_searched_by_one_product_with_the_same_answers(metric, monkeypatch):
    """Above BRUTE_FORCE_ROWS rows (a live gallery of thousands) the search computes distances from one matrix
    product without copying the gallery: the same nearest identity as the pairwise search, distances within
    float32 rounding."""
    from kiln_runtime import system as rt_system

    rng = np.random.default_rng(3)
    n = rt_system.BRUTE_FORCE_ROWS + 904
    gallery = rng.normal(size=(n, 16)).astype(np.float32)
    names = [f"p{i}" for i in range(n)]
    queries = gallery[rng.choice(n, 12)] + rng.normal(scale=0.05, size=(12, 16)).astype(np.float32)
    spec = type("S", (), {"metric": metric, "threshold": 0.6})()
    fast = rt_system.nearest(spec, gallery, names, queries)
    monkeypatch.setattr(rt_system, "BRUTE_FORCE_ROWS", 10 * n)                 # the pairwise path, as gated
    slow = rt_system.nearest(spec, gallery, names, queries)
    assert [a for a, _ in fast] == [a for a, _ in slow] and np.allclose([d for _, d in fast], [d for _, d in slow],
                                                                         atol=1e-4)
