"""A live gallery: the people a site enrols and erases, in a store of its own beside the signed release.

A release is immutable code-like content; the people it knows change daily. So a gallery is not inside the release:
it is one SQLite file (WAL: one writer at a time, readers never blocked; every acknowledged write is a committed,
fsynced transaction) that any number of `kiln-run serve` workers and `kiln-run gallery` commands open, and it is
**bound to the embedder that made its vectors by content** — the embedder engine's manifest identity digest, the
embedding width, the chip geometry (size, landmark template) and preprocessing, the metric and threshold
(`Binding`). A release whose embedder differs in any of them refuses the store in one line; a new embedder means a
new gallery (re-enrolled, or migrated through a gate), never silently mixed vectors.

The store's source of truth is an **append-only, hash-chained event log** (table `events`: create, enrol, delete,
erase, restore): each event records the actor, reason, time, subject, the face's digest and the previous event's
hash, and its own hash covers all of it. The faces table holds what the events leave: per face its embedding, the
face crop it came from (for a later re-embedding), its landmarks, box and score, the source image's sha256. The
gallery version is the last event's number; `audit` re-verifies the chain, replays it, and names every row that
differs from what the log says (a row edited, added or removed behind Kiln's back). Search arrays in memory are a
cache of the store (`Live`), brought up to date from the log before each batch.

An erasure removes every face of the subject — embedding, crop, landmarks — in the same transaction as its event,
and returns a **receipt**: the event's hash, the versions that held the subject, the version that no longer does,
and the signed snapshots taken while it was held (they still hold the person: delete them). Snapshots (`snapshot`)
are signed, content-addressed archives in the release signing format; `restore` verifies one before anything is
replaced, refuses one made for another embedder, and refuses to bring back a subject erased since unless told to.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sqlite3
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kiln_runtime.digests import canonical_json
from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.names import is_identity
from kiln_runtime.text import first_hidden, shown

SCHEMA = "kiln.gallery/1"
SNAPSHOT_SCHEMA = "kiln.gallery-snapshot/1"
RECEIPT_SCHEMA = "kiln.erasure-receipt/1"
CREATE, ENROL, DELETE, ERASE, RESTORE, SNAPSHOT = "create", "enrol", "delete", "erase", "restore", "snapshot"
MAX_TEXT = 500                        # characters of an actor or a reason
BUSY_MS = 30_000                      # how long a write waits for another writer's transaction
HINT_MIGRATE = ("its vectors were made by another embedder: serve it with the release it was enrolled for, or give "
                "this release a new store (kiln-run gallery init NEW_STORE --release …) and enrol the people again "
                "(each face's crop is kept for a re-embedding)")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---------------------------------------------------------------------------------------------- the binding
@dataclass(frozen=True)
class Binding:
    """What made a gallery's vectors, by content: two galleries compare only when their bindings are equal."""
    embedder: str                     # the engine's name (for people; the digest decides)
    embedder_xxh3_128: str            # its manifest's identity digest, as the release pins it
    dim: int
    chip_size: int
    template: tuple[tuple[float, float], ...]
    preprocess: dict | None
    metric: str
    threshold: float

    def doc(self) -> dict[str, Any]:
        d = asdict(self)
        d["template"] = [list(p) for p in self.template]
        return d

    @property
    def digest(self) -> str:
        return hashlib.sha256(canonical_json(self.doc())).hexdigest()

    @classmethod
    def of_doc(cls, doc: dict[str, Any]) -> "Binding":
        return cls(str(doc["embedder"]), str(doc["embedder_xxh3_128"]), int(doc["dim"]), int(doc["chip_size"]),
                   tuple(tuple(float(v) for v in p) for p in doc["template"]), doc.get("preprocess"),
                   str(doc["metric"]), float(doc["threshold"]))


def binding_of(tree: Path) -> Binding:
    """The binding of a verified release tree's embedder (release.json's pin, system.json's geometry)."""
    from kiln_runtime import release

    lay = release.layout(tree)
    rel = json.loads((tree / "release.json").read_bytes())
    part = lay.parts[lay.spec.embedder]
    pre = lay.spec.preprocess
    return Binding(str(part["engine"]), str(part["xxh3_128"]), int(rel["gallery"]["dim"]), int(lay.spec.chip_size),
                   tuple((float(x), float(y)) for x, y in np.asarray(lay.spec.template)),
                   None if pre is None else {"channels": pre.channels, "mean": list(pre.mean), "std": list(pre.std)},
                   lay.spec.metric, float(lay.spec.threshold))


def closest(binding: Binding, probe: np.ndarray, vectors: np.ndarray) -> tuple[int, float]:
    """(index, value) of the row of `vectors` nearest `probe` in the binding's metric: the smallest L2 distance, or
    the largest cosine similarity."""
    probe, vectors = np.asarray(probe, np.float32).reshape(1, -1), np.asarray(vectors, np.float32)
    if binding.metric == "cosine":
        unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)  # noqa: E731
        sim = (unit(vectors) @ unit(probe).T)[:, 0]
        i = int(np.argmax(sim))
        return i, float(sim[i])
    d = np.linalg.norm(vectors - probe, axis=1)
    i = int(np.argmin(d))
    return i, float(d[i])


# ---------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Face:
    id: str
    subject: str
    digest: str
    box: list[float]
    score: float
    landmarks: list[list[float]] | None
    source_sha256: str | None
    created: str
    event: int                        # the event that enrolled (or restored) it


@dataclass(frozen=True)
class Event:
    seq: int
    at: str
    actor: str
    reason: str
    action: str
    subject: str | None
    face: str | None
    face_digest: str | None
    detail: dict
    prev: str
    hash: str


def canonical_box(box) -> list[float]:
    return [round(float(v), 3) for v in box]


def canonical_marks(landmarks) -> list[list[float]] | None:
    return None if landmarks is None else [[round(float(x), 3), round(float(y), 3)] for x, y in landmarks]


def canonical_score(score) -> float:
    return round(float(score), 6)


def face_digest(subject: str, embedding: np.ndarray, crop: bytes | None, source_sha256: str | None, box,
                score, landmarks) -> str:
    """A face's content digest: everything stored for it — its subject, its vector's bytes, its crop's bytes, its
    source image, its box, score and landmarks (as stored: `canonical_*`)."""
    e = np.ascontiguousarray(embedding, "<f4").tobytes()
    return hashlib.sha256(canonical_json({
        "subject": subject, "embedding": hashlib.sha256(e).hexdigest(),
        "crop": None if crop is None else hashlib.sha256(crop).hexdigest(), "source": source_sha256,
        "box": canonical_box(box), "score": canonical_score(score), "landmarks": canonical_marks(landmarks)})
    ).hexdigest()


def event_hash(seq: int, at: str, actor: str, reason: str, action: str, subject: str | None, face: str | None,
               digest: str | None, detail: dict, prev: str) -> str:
    return hashlib.sha256(canonical_json({
        "seq": seq, "at": at, "actor": actor, "reason": reason, "action": action, "subject": subject,
        "face": face, "face_digest": digest, "detail": detail, "prev": prev})).hexdigest()


GENESIS = "0" * 64


def check_subject(subject: object) -> str:
    if not is_identity(subject):
        text = shown(repr(subject), 80)
        raise KilnError(f"subject {text} is not a valid subject id",
                        "use 1-64 letters, digits, '-' or '_', starting with a letter or digit (not 'unknown')")
    return subject  # type: ignore[return-value]


def check_text(value: str | None, what: str, default: str) -> str:
    """An actor or a reason: at most MAX_TEXT characters, no control, format or separator character (it is shown
    on terminals and in receipts)."""
    text = default if value is None or value == "" else value
    if len(text) > MAX_TEXT or first_hidden(text) is not None:
        raise KilnError(f"the {what} is over {MAX_TEXT} characters or holds a control character "
                        f"({first_hidden(text) or len(text)})", f"give a plain one-line {what}")
    return text


# ---------------------------------------------------------------------------------------------- the store
_TABLES = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE faces(id TEXT PRIMARY KEY, subject TEXT NOT NULL, digest TEXT NOT NULL, embedding BLOB NOT NULL,
                   crop BLOB, landmarks TEXT, box TEXT NOT NULL, score REAL NOT NULL, source_sha256 TEXT,
                   created TEXT NOT NULL, event INTEGER NOT NULL);
CREATE INDEX faces_subject ON faces(subject);
CREATE UNIQUE INDEX faces_digest ON faces(digest);
CREATE TABLE events(seq INTEGER PRIMARY KEY, at TEXT NOT NULL, actor TEXT NOT NULL, reason TEXT NOT NULL,
                    action TEXT NOT NULL, subject TEXT, face TEXT, face_digest TEXT, detail TEXT NOT NULL,
                    prev TEXT NOT NULL, hash TEXT NOT NULL UNIQUE);
CREATE INDEX events_subject ON events(subject);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events BEGIN SELECT RAISE(ABORT, 'the event log is append-only'); END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events BEGIN SELECT RAISE(ABORT, 'the event log is append-only'); END;
"""


def _connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    """A connection (the path as a file: URI, escaped — a '%' or '#' in a name is that character); the store's
    journal settings are applied by `Store` once it knows the file is a gallery store."""
    try:
        uri = Path(path).resolve().as_uri() + ("?mode=ro" if readonly else "")
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=BUSY_MS / 1e3, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={BUSY_MS}")
        return conn
    except sqlite3.Error as e:
        raise KilnError(f"{shown(path, 300)}: cannot open the gallery store ({shown(str(e), 200)})",
                        "pass a gallery store made by `kiln-run gallery init` (or serve --gallery, which makes one)") \
            from None


def _writable(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")                  # an acknowledged write survives a crash of the host


class StoreError(KilnError):
    """The store itself failed (locked past the wait, disk full, I/O): the service's 503, not the client's fault."""


@contextmanager
def db_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{shown(path, 300)}: the gallery store failed ({shown(str(e), 200)})",
                        "check the file is a gallery store, the disk has room, and `kiln-run gallery audit` it") \
            from None


class Store:
    """One gallery store. Every write is one transaction (BEGIN IMMEDIATE: one writer at a time, across processes)
    that appends its event to the chain."""

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise KilnError(f"{shown(path, 300)}: no such gallery store", "make one: kiln-run gallery init STORE "
                            "--release ARCHIVE --key KEY.pub (serve --gallery STORE makes it when it is missing)")
        self.conn = _connect(self.path, readonly)
        try:
            with db_errors(self.path):
                meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
        except StoreError:
            self.conn.close()
            raise KilnError(f"{shown(path, 300)}: not a Kiln gallery store (no meta table)",
                            "pass a store made by `kiln-run gallery init`") from None
        if meta.get("schema") != SCHEMA:
            self.conn.close()
            raise KilnError(f"{shown(path, 300)}: not a Kiln gallery store (schema {shown(meta.get('schema'), 60)})",
                            "pass a store made by `kiln-run gallery init`")
        self.binding = Binding.of_doc(json.loads(meta["binding"]))
        if not readonly:
            with db_errors(self.path):
                _writable(self.conn)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading
    def bound_to(self, binding: Binding, release: str = "this release") -> "Store":
        """GateFailed in one line unless the store's vectors were made by `binding`'s embedder and geometry."""
        if self.binding.digest != binding.digest:
            mine, theirs = self.binding.doc(), binding.doc()
            diff = [k for k in mine if mine[k] != theirs.get(k)]
            raise GateFailed(f"{shown(self.path, 300)}: enrolled by embedder {shown(self.binding.embedder, 64)} "
                             f"{self.binding.embedder_xxh3_128[:12]}, but {release} embeds with "
                             f"{shown(binding.embedder, 64)} {binding.embedder_xxh3_128[:12]} (differs in "
                             f"{', '.join(diff)}): refusing to mix vectors", HINT_MIGRATE)
        return self

    def version(self) -> int:
        with db_errors(self.path):
            row = self.conn.execute("SELECT max(seq) FROM events").fetchone()
        return int(row[0] or 0)

    def head(self) -> str:
        with db_errors(self.path):
            row = self.conn.execute("SELECT hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        return row[0] if row else GENESIS

    def counts(self) -> tuple[int, int]:
        """(subjects, faces)."""
        with db_errors(self.path):
            return tuple(self.conn.execute("SELECT count(DISTINCT subject), count(*) FROM faces").fetchone())

    def subjects(self, limit: int = 1000, after: str = "") -> list[tuple[str, int]]:
        with db_errors(self.path):
            return [(s, int(n)) for s, n in self.conn.execute(
                "SELECT subject, count(*) FROM faces WHERE subject > ? GROUP BY subject ORDER BY subject LIMIT ?",
                (after, limit))]

    def faces(self, subject: str | None = None) -> list[Face]:
        q = "SELECT id, subject, digest, box, score, landmarks, source_sha256, created, event FROM faces"
        with db_errors(self.path):
            rows = self.conn.execute(q + (" WHERE subject = ?" if subject else "") + " ORDER BY rowid",
                                     (subject,) if subject else ()).fetchall()
        return [Face(r[0], r[1], r[2], json.loads(r[3]), float(r[4]), json.loads(r[5]) if r[5] else None, r[6], r[7],
                     int(r[8])) for r in rows]

    def vectors(self, subject: str | None = None) -> tuple[list[str], list[str], np.ndarray]:
        """(face ids, subjects, (n, dim) float32 embeddings) in store order, or of one subject."""
        q = "SELECT id, subject, embedding FROM faces"
        with db_errors(self.path):
            rows = self.conn.execute(q + (" WHERE subject = ?" if subject else "") + " ORDER BY rowid",
                                     (subject,) if subject else ()).fetchall()
        dim = self.binding.dim
        emb = np.frombuffer(b"".join(r[2] for r in rows), "<f4").reshape(len(rows), dim) if rows else \
            np.zeros((0, dim), np.float32)
        return [r[0] for r in rows], [r[1] for r in rows], emb.astype(np.float32, copy=False)

    def events(self, after: int = 0) -> list[Event]:
        with db_errors(self.path):
            rows = self.conn.execute("SELECT seq, at, actor, reason, action, subject, face, face_digest, detail, prev, "
                                     "hash FROM events WHERE seq > ? ORDER BY seq", (after,)).fetchall()
        return [Event(*r[:8], json.loads(r[8]), r[9], r[10]) for r in rows]

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: everything read inside sees one version of the store."""
        with db_errors(self.path):
            self.conn.execute("BEGIN")
            try:
                yield self.conn
            finally:
                self.conn.execute("COMMIT")

    # -- writing
    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): the caller appends its events (`append_event`) and changes the
        faces (`insert_face`, DELETE) inside it; committed whole or rolled back whole."""
        with db_errors(self.path):
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    @staticmethod
    def append_event(conn: sqlite3.Connection, actor: str, reason: str, action: str, subject: str | None = None,
                face: str | None = None, digest: str | None = None, detail: dict | None = None) -> Event:
        last = conn.execute("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        seq, prev = (int(last[0]) + 1, last[1]) if last else (1, GENESIS)
        at, detail = now(), detail or {}
        h = event_hash(seq, at, actor, reason, action, subject, face, digest, detail, prev)
        conn.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (seq, at, actor, reason, action, subject, face, digest,
                      json.dumps(detail, sort_keys=True, separators=(",", ":")), prev, h))
        return Event(seq, at, actor, reason, action, subject, face, digest, detail, prev, h)

    @staticmethod
    def insert_face(conn: sqlite3.Connection, face_id: str, subject: str, digest: str, embedding: np.ndarray,
                crop: bytes | None, landmarks, box, score: float, source: str | None, created: str, seq: int) -> None:
        marks = canonical_marks(landmarks)
        conn.execute("INSERT INTO faces VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (face_id, subject, digest, np.ascontiguousarray(embedding, "<f4").tobytes(), crop,
                      None if marks is None else json.dumps(marks), json.dumps(canonical_box(box)),
                      canonical_score(score), source, created, seq))

    def enrol(self, subject: str, embedding: np.ndarray, crop: bytes | None, landmarks, box, score: float,
              source_sha256: str | None, actor: str, reason: str) -> tuple[Face, int, bool]:
        """Add one face of `subject`; (the face, the version after, whether it is new — the same face of the same
        subject enrolled again is the one already there, and nothing is written)."""
        check_subject(subject)
        vec = np.asarray(embedding, np.float32).reshape(-1)
        if vec.shape != (self.binding.dim,) or not np.isfinite(vec).all():
            raise KilnError(f"an embedding of shape {vec.shape} for a {self.binding.dim}-d gallery",
                            "enrol with the release this gallery is bound to")
        digest = face_digest(subject, vec, crop, source_sha256, box, score, landmarks)
        with self.transaction() as conn:
            found = conn.execute("SELECT id FROM faces WHERE digest = ?", (digest,)).fetchone()
            if found:
                version = int(conn.execute("SELECT max(seq) FROM events").fetchone()[0])
                return self.face(found[0]), version, False      # type: ignore[return-value]
            face_id = uuid.uuid4().hex[:20]
            e = self.append_event(conn, actor, reason, ENROL, subject, face_id, digest)
            self.insert_face(conn, face_id, subject, digest, vec, crop, landmarks, box, score, source_sha256, e.at,
                             e.seq)
        return Face(face_id, subject, digest, canonical_box(box), canonical_score(score), canonical_marks(landmarks),
                    source_sha256, e.at, e.seq), e.seq, True

    def face(self, face_id: str) -> Face | None:
        with db_errors(self.path):
            r = self.conn.execute("SELECT id, subject, digest, box, score, landmarks, source_sha256, created, event "
                                  "FROM faces WHERE id = ?", (face_id,)).fetchone()
        return None if r is None else Face(r[0], r[1], r[2], json.loads(r[3]), float(r[4]),
                                           json.loads(r[5]) if r[5] else None, r[6], r[7], int(r[8]))

    def embeddings(self, ids: list[str]) -> dict[str, tuple[str, np.ndarray]]:
        """{face id: (subject, vector)} of those of `ids` still stored."""
        out: dict[str, tuple[str, np.ndarray]] = {}
        with db_errors(self.path):
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                for f, subject, emb in self.conn.execute(
                        f"SELECT id, subject, embedding FROM faces WHERE id IN ({','.join('?' * len(chunk))})", chunk):
                    out[f] = (subject, np.frombuffer(emb, "<f4").astype(np.float32))
        return out

    def enrol_many(self, rows: list[tuple[str, np.ndarray]], actor: str, reason: str) -> int:
        """Enrol many (subject, embedding) faces with no crop in ONE transaction (an import, a benchmark's fill): one
        event each, as `enrol` writes them; the version after."""
        with self.transaction() as conn:
            seq = 0
            for subject, vec in rows:
                check_subject(subject)
                vec = np.asarray(vec, np.float32).reshape(-1)
                if vec.shape != (self.binding.dim,) or not np.isfinite(vec).all():
                    raise KilnError(f"an embedding of shape {vec.shape} for a {self.binding.dim}-d gallery",
                                    "import vectors of the embedder this gallery is bound to")
                digest = face_digest(subject, vec, None, None, [0, 0, 0, 0], 1.0, None)
                if conn.execute("SELECT 1 FROM faces WHERE digest = ?", (digest,)).fetchone():
                    continue                                       # the same face again adds nothing
                face_id = uuid.uuid4().hex[:20]
                e = self.append_event(conn, actor, reason, ENROL, subject, face_id, digest)
                self.insert_face(conn, face_id, subject, digest, vec, None, None, [0, 0, 0, 0], 1.0, None, e.at,
                                 e.seq)
                seq = e.seq
        return seq or self.version()

    def delete_face(self, face_id: str, actor: str, reason: str, subject: str | None = None) -> int:
        """Remove one face (its embedding, crop and all); the version after."""
        with self.transaction() as conn:
            row = conn.execute("SELECT subject, digest FROM faces WHERE id = ?", (face_id,)).fetchone()
            if row is None or (subject is not None and row[0] != subject):
                raise KilnError(f"no face {shown(face_id, 40)}" + (f" of subject {shown(subject, 64)}" if subject
                                                                   else "") + " in the gallery",
                                "list the faces: kiln-run gallery list STORE SUBJECT (or GET /v1/subjects/SUBJECT)")
            e = self.append_event(conn, actor, reason, DELETE, row[0], face_id, row[1])
            conn.execute("DELETE FROM faces WHERE id = ?", (face_id,))
        return e.seq

    def erase(self, subject: str, actor: str, reason: str) -> dict[str, Any]:
        """Remove every face of `subject` and everything stored for them, in one transaction with its event; the
        receipt (RECEIPT_SCHEMA). A subject no longer enrolled but held before still gets one (the snapshots that
        hold them matter); one never held is unknown."""
        check_subject(subject)
        with self.transaction() as conn:
            rows = conn.execute("SELECT id, digest FROM faces WHERE subject = ? ORDER BY rowid", (subject,)).fetchall()
            last = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
            if not rows and not _held(conn, subject, last + 1):
                raise KilnError(f"no subject {shown(subject, 64)} in the gallery, now or before",
                                "list the subjects: kiln-run gallery list STORE (or GET /v1/subjects)")
            e = self.append_event(conn, actor, reason, ERASE, subject, None, None,
                                  {"faces": [r[0] for r in rows], "digests": [r[1] for r in rows]})
            conn.execute("DELETE FROM faces WHERE subject = ?", (subject,))
            held = _held(conn, subject, e.seq)
            snaps = [{"version": d["version"], "path": d["path"], "sha256": d["sha256"], "event": seq}
                     for seq, d in ((seq, json.loads(d)) for seq, d in conn.execute(
                         "SELECT seq, detail FROM events WHERE action = ? ORDER BY seq", (SNAPSHOT,)))
                     if any(a <= d["version"] <= b for a, b in held)]
        return {"receipt": RECEIPT_SCHEMA, "subject": subject, "event": e.hash, "seq": e.seq, "at": e.at,
                "actor": actor, "reason": reason, "faces_erased": [r[1] for r in rows],
                "versions_that_held": [list(h) for h in held], "version_without": e.seq, "snapshots_that_hold": snaps,
                "gallery": {"binding": self.binding.digest, "store": self.path.name},
                "note": "the snapshots listed still hold this subject: delete them to complete the erasure"
                if snaps else "no snapshot holds this subject"}


def _held(conn: sqlite3.Connection, subject: str, until: int) -> list[tuple[int, int]]:
    """The version ranges [a, b] in which `subject` had at least one face, up to (not including) version `until`."""
    out, count, start = [], 0, None
    for seq, action, _ in conn.execute("SELECT seq, action, detail FROM events WHERE subject = ? AND seq < ? "
                                       "ORDER BY seq", (subject, until)):
        before = count
        if action in (ENROL, RESTORE):
            count += 1
        elif action == DELETE:
            count -= 1
        elif action == ERASE:
            count = 0
        if before == 0 and count > 0:
            start = seq
        elif before > 0 and count == 0:
            out.append((start, seq - 1))
    if count > 0:
        out.append((start, until - 1))
    return out


def create(path: Path, binding: Binding, actor: str, reason: str,
           seed: tuple[np.ndarray, list[str]] | None = None, seed_from: str | None = None) -> Store:
    """A new store bound to `binding`, written whole (a temporary sibling, then a rename), optionally seeded with a
    release's build gallery (one enrol event per face, `seed_from` naming it). Never over an existing file."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise KilnError(f"{shown(path, 300)} already exists", "a store is never overwritten: pass a new path, or use "
                        "the store as it is")
    if not path.parent.is_dir():
        raise KilnError(f"{shown(path, 300)}: its folder does not exist", "create the folder first")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        conn = _connect(tmp)
        with db_errors(tmp):
            _writable(conn)
            conn.executescript(_TABLES)
            conn.executemany("INSERT INTO meta VALUES (?, ?)", [
                ("schema", SCHEMA), ("binding", json.dumps(binding.doc(), sort_keys=True)),
                ("binding_digest", binding.digest)])
            conn.execute("BEGIN IMMEDIATE")
            Store.append_event(conn, actor, reason, CREATE, detail={"binding": binding.digest, "embedder":
                                                                binding.embedder})
            if seed is not None:
                emb, labels = seed
                for vec, subject in zip(np.asarray(emb, np.float32), labels):
                    check_subject(subject)
                    digest = face_digest(subject, vec, None, None, [0, 0, 0, 0], 1.0, None)
                    if conn.execute("SELECT 1 FROM faces WHERE digest = ?", (digest,)).fetchone():
                        continue                                   # a face given twice is one face
                    face_id = uuid.uuid4().hex[:20]
                    e = Store.append_event(conn, actor, f"seeded from {seed_from}", ENROL, subject, face_id, digest)
                    Store.insert_face(conn, face_id, subject, digest, vec, None, None, [0, 0, 0, 0], 1.0, None, e.at,
                                  e.seq)
            conn.execute("COMMIT")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")       # one file to rename; WAL again when opened
        conn.close()
        try:
            os.link(tmp, path)                 # never over a store another process made meanwhile
        except FileExistsError:
            raise KilnError(f"{shown(path, 300)} was made by another process meanwhile", "use that store: start "
                            "again, and it is opened instead of made") from None
        tmp.unlink()
    except BaseException:
        for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm"), Path(f"{tmp}-journal")):
            p.unlink(missing_ok=True)
        raise
    return Store(path)


__all__ = ["Binding", "Event", "Face", "RECEIPT_SCHEMA", "SCHEMA", "Store", "StoreError", "binding_of",
           "check_subject", "check_text", "closest", "create", "db_errors", "face_digest"]
