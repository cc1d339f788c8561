"""Signed gallery snapshots: a gallery store's state at one version as a signed, content-addressed archive in the
release signing format (kiln_runtime/signature.py), and `restore`, which verifies one before anything is replaced.

    kiln-gallery-<binding12>-v<version>/
      gallery.json     schema, the binding (what made the vectors), version, the log's head hash, counts
      faces.jsonl      one face per line: id, subject, digest, box, score, landmarks, source sha256, created, and
                       where its crop is in crops.bin
      embeddings.npy   (faces, dim) float32, in faces.jsonl's order
      crops.bin        the face crops (PNG), concatenated
      events.jsonl     the hash-chained log up to this version
    kiln-gallery-<binding12>-v<version>.sig

Nothing in it depends on time, host or path, so one store version is one archive, byte for byte: its sha256 names
it.
Restoring appends to the log (never rewrites it): a `restore` event for each snapshot face the store lacks, a
`delete` for each face the snapshot lacks — so `audit` replays a restore like any other change, and a snapshot cannot
bring back a subject erased since it was taken unless the operator says so (`allow_erased`, recorded).
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kiln_runtime import gallery as g
from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.text import shown

MAX_FACES = 10_000_000


@dataclass
class Snapshot:
    name: str
    binding: g.Binding
    version: int
    head: str
    faces: list[dict[str, Any]]
    embeddings: np.ndarray
    crops: Any                         # bytes, or the mapped crops.bin
    events: list[dict[str, Any]]

    def crop(self, face: dict[str, Any]) -> bytes | None:
        at, n = face.get("crop_at"), face.get("crop_bytes")
        return None if at is None else bytes(self.crops[at:at + n])


def _name(binding: g.Binding, version: int) -> str:
    return f"kiln-gallery-{binding.digest[:12]}-v{version}"


def take(store: g.Store, out_dir: Path, private_key: Path) -> tuple[Path, str, int]:
    """Write a signed snapshot of the store's current version into `out_dir`; (its path, its sha256, the version).
    The same version again is the same archive (already there: left as it is); other bytes under its name are
    refused (nothing is overwritten)."""
    from kiln_runtime.archive import write_archive
    from kiln_runtime.digests import sha256_file
    from kiln_runtime.files import scratch
    from kiln_runtime.signature import load_private_key, sign_tree

    load_private_key(Path(private_key))                      # a bad key is one line before anything is read
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise KilnError(f"{shown(out_dir, 300)}: no such folder", "create it, or pass --out an existing folder")
    with scratch("snapshot") as tmp:
        with store.reading() as conn:                         # one consistent read of faces and events
            events = store.events()
            version = events[-1].seq if events else 0
            head = events[-1].hash if events else g.GENESIS
            name = _name(store.binding, version)
            tree = tmp / name
            tree.mkdir()
            n = conn.execute("SELECT count(*) FROM faces").fetchone()[0]
            emb = np.zeros((n, store.binding.dim), "<f4")
            subjects: set[str] = set()
            at = 0
            with open(tree / "faces.jsonl", "w", encoding="utf-8") as faces, open(tree / "crops.bin", "wb") as crops:
                for i, r in enumerate(conn.execute("SELECT id, subject, digest, embedding, crop, landmarks, box, "
                                                   "score, source_sha256, created, event FROM faces ORDER BY rowid")):
                    emb[i] = np.frombuffer(r[3], "<f4")
                    subjects.add(r[1])
                    if r[4] is not None:
                        crops.write(r[4])
                    faces.write(json.dumps({
                        "id": r[0], "subject": r[1], "digest": r[2], "landmarks": json.loads(r[5]) if r[5] else None,
                        "box": json.loads(r[6]), "score": r[7], "source_sha256": r[8], "created": r[9],
                        "event": r[10], "crop_at": None if r[4] is None else at,
                        "crop_bytes": None if r[4] is None else len(r[4])}, sort_keys=True) + "\n")
                    at += 0 if r[4] is None else len(r[4])
        doc = {"schema": g.SNAPSHOT_SCHEMA, "binding": store.binding.doc(), "binding_digest": store.binding.digest,
               "version": version, "head": head, "faces": n, "subjects": len(subjects)}
        (tree / "gallery.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        with open(tree / "embeddings.npy", "wb") as f:
            np.save(f, emb, allow_pickle=False)
        (tree / "events.jsonl").write_text("".join(json.dumps(e.__dict__, sort_keys=True) + "\n" for e in events),
                                           encoding="utf-8")
        sign_tree(tree, tmp / f"{name}.sig", Path(private_key))
        dest = out_dir / f"{name}.tar.gz"
        staged = out_dir / f".{dest.name}.{os.getpid()}.staged"      # beside it: the rename below is atomic
        try:
            sha = write_archive(staged, tmp, [name, f"{name}.sig"])
            if dest.exists() or dest.is_symlink():
                if dest.is_symlink() or not dest.is_file() or sha256_file(dest) != sha:
                    raise KilnError(f"{shown(dest, 300)} exists with other bytes", "a snapshot is never overwritten: "
                                    "pass another --out folder, or move that file away")
            else:
                os.replace(staged, dest)
        finally:
            staged.unlink(missing_ok=True)
    _record(store, dest, sha, version, subjects)
    return dest, sha, version


def _record(store: g.Store, dest: Path, sha: str, version: int, subjects: set[str]) -> None:
    """The snapshot as an event of the log (so an erasure's receipt finds it, and the audit covers the record) —
    unless a subject it holds was erased after the version it was read at: then an erasure's receipt already went
    out without it, so the archive is removed and the snapshot refused."""
    with store.transaction() as conn:
        erased = sorted({row[0] for row in conn.execute("SELECT subject FROM events WHERE action = ? AND seq > ?",
                                                        (g.ERASE, version)) if row[0] in subjects})
        if erased:
            dest.unlink(missing_ok=True)
            raise KilnError(f"{shown(', '.join(erased[:5]), 200)} erased while the snapshot was written: it would "
                            "hold an erased subject, so it was removed", "take the snapshot again")
        store.append_event(conn, "kiln-run gallery snapshot", f"snapshot of version {version}", g.SNAPSHOT,
                           detail={"version": version, "path": str(dest.resolve()), "sha256": sha})


@contextmanager
def read(archive: Path, public_key: Path) -> Iterator[Snapshot]:
    """A snapshot archive verified (the strict reader, exactly <name>/ and <name>.sig, the signature over every file)
    and parsed, each face's digest recomputed from its bytes; GateFailed naming what is wrong."""
    from kiln_runtime.archive import safe_extract
    from kiln_runtime.files import scratch
    from kiln_runtime.signature import load_public_key, verify_tree

    archive = Path(archive)
    if not archive.is_file():
        raise KilnError(f"{shown(archive, 300)}: no such snapshot", "pass the .tar.gz `kiln-run gallery snapshot` "
                        "wrote")
    load_public_key(Path(public_key))
    with scratch("snapshot-read") as tmp:
        safe_extract(archive, tmp)
        top = sorted(p.name for p in tmp.iterdir())
        dirs = [p for p in tmp.iterdir() if p.is_dir()]
        if len(top) != 2 or len(dirs) != 1 or f"{dirs[0].name}.sig" not in top:
            raise GateFailed(f"{shown(archive, 300)}: expected exactly <S>/ and <S>.sig at the top",
                             "pass a snapshot `kiln-run gallery snapshot` wrote")
        tree = dirs[0]
        verify_tree(tree, tmp / f"{tree.name}.sig", Path(public_key))
        try:
            doc = json.loads((tree / "gallery.json").read_text(encoding="utf-8"))
            if doc.get("schema") != g.SNAPSHOT_SCHEMA:
                raise ValueError(f"schema {shown(doc.get('schema'), 60)}")
            binding = g.Binding.of_doc(doc["binding"])
            if binding.digest != doc["binding_digest"]:
                raise ValueError("its binding digest is not its binding's")
            faces = [json.loads(ln) for ln in (tree / "faces.jsonl").read_text(encoding="utf-8").splitlines()]
            if len(faces) != doc["faces"] or len(faces) > MAX_FACES:
                raise ValueError("faces.jsonl does not hold the faces gallery.json counts")
            emb = np.load(tree / "embeddings.npy", allow_pickle=False)
            if emb.dtype != np.dtype("<f4") or emb.shape != (len(faces), binding.dim) or not np.isfinite(emb).all():
                raise ValueError(f"embeddings.npy is {emb.dtype} {emb.shape}, not {len(faces)} × {binding.dim} "
                                 "finite float32")
            import mmap

            with open(tree / "crops.bin", "rb") as f:                 # mapped, not read: a big gallery's crops
                crops = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
            events = [json.loads(ln) for ln in (tree / "events.jsonl").read_text(encoding="utf-8").splitlines()]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise GateFailed(f"{shown(archive, 300)}: not a gallery snapshot Kiln reads ({shown(str(e), 200)})",
                             "pass a snapshot `kiln-run gallery snapshot` wrote") from None
        snap = Snapshot(tree.name, binding, int(doc["version"]), str(doc["head"]), faces, emb, crops, events)
        for f, vec in zip(faces, emb):
            g.check_subject(f.get("subject"))
            if g.face_digest(f["subject"], vec, snap.crop(f), f.get("source_sha256"), f["box"], f["score"],
                             f.get("landmarks")) != f.get("digest"):
                raise GateFailed(f"{shown(archive, 300)}: face {shown(f.get('id'), 40)} does not match its digest",
                                 "do not restore it")
        if snap.events and snap.events[-1].get("hash") != snap.head:
            raise GateFailed(f"{shown(archive, 300)}: its log does not end at its head", "do not restore it")
        yield snap


def restore(store: g.Store, archive: Path, public_key: Path, actor: str, reason: str,
            allow_erased: bool = False) -> dict[str, Any]:
    """Bring the store to a verified snapshot's faces by appending to its log; a summary. Refused for a snapshot of
    another binding, and — unless `allow_erased` — for one holding a subject this store erased since the snapshot
    was taken (since ever, when the snapshot is not of this store's log)."""
    with read(archive, public_key) as snap:
        if snap.binding.digest != store.binding.digest:
            raise GateFailed(f"{shown(archive, 300)}: a snapshot of a gallery enrolled by embedder "
                             f"{shown(snap.binding.embedder, 64)} {snap.binding.embedder_xxh3_128[:12]}, this store's "
                             f"is {shown(store.binding.embedder, 64)} {store.binding.embedder_xxh3_128[:12]}",
                             g.HINT_MIGRATE)
        detail = {"snapshot": snap.name, "snapshot_version": snap.version, "snapshot_head": snap.head}
        added = removed = 0
        with store.transaction() as conn:           # the erasures checked and the changes made as one
            log = store.events()
            since = next((e.seq for e in log if e.hash == snap.head), 0)
            subjects = {f["subject"] for f in snap.faces}
            erased = sorted({e.subject for e in log if e.action == g.ERASE and e.seq > since and e.subject in subjects})
            if erased and not allow_erased:
                raise GateFailed(f"{shown(archive, 300)} holds {len(erased)} subject(s) erased from this gallery since "
                                 f"it was taken ({shown(', '.join(erased[:5]), 200)}): restoring would bring them back",
                                 "take a new snapshot, or pass --allow-erased (recorded in the log) if that is "
                                 "intended")
            note = f"restore of snapshot {snap.name}" + (f"; brings back erased {', '.join(erased)}" if erased else "")
            reason = f"{reason}; {note}" if reason else note
            wanted = {f["digest"] for f in snap.faces}
            present = set()
            for face_id, subject, digest in conn.execute("SELECT id, subject, digest FROM faces").fetchall():
                if digest in wanted:
                    present.add(digest)
                    continue
                store.append_event(conn, actor, reason, g.DELETE, subject, face_id, digest, detail)
                conn.execute("DELETE FROM faces WHERE id = ?", (face_id,))
                removed += 1
            for f, vec in zip(snap.faces, snap.embeddings):
                if f["digest"] in present:
                    continue
                present.add(f["digest"])
                taken = conn.execute("SELECT 1 FROM faces WHERE id = ?", (f["id"],)).fetchone()
                face_id = uuid.uuid4().hex[:20] if taken else f["id"]
                e = store.append_event(conn, actor, reason, g.RESTORE, f["subject"], face_id, f["digest"], detail)
                store.insert_face(conn, face_id, f["subject"], f["digest"], vec, snap.crop(f), f.get("landmarks"),
                                  f["box"], float(f["score"]), f.get("source_sha256"), e.at, e.seq)
                added += 1
    return {"snapshot": snap.name, "snapshot_version": snap.version, "added": added, "removed": removed,
            "version": store.version(), "erased_brought_back": erased}


__all__ = ["Snapshot", "read", "restore", "take"]
