"""`kiln-run gallery audit`: a gallery store's log verified and replayed against its faces (kiln_runtime/gallery.py
keeps both). The chain proves the log consistent with itself; heads kept outside the store (a receipt's event, a
snapshot's head) prove it was not cut short or rewritten whole."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from kiln_runtime.gallery import CREATE, DELETE, ENROL, ERASE, GENESIS, RESTORE, Store, event_hash, face_digest
from kiln_runtime.text import shown


@dataclass
class Audit:
    events: int
    faces: int
    subjects: int
    head: str
    problems: list[str]


def audit(store: Store, expect: list[str] | None = None) -> Audit:
    """Verify the chain (each event's hash over its content and the previous hash, numbered without a gap, first a
    create with the store's binding) and replay it: the faces it leaves must be exactly the faces stored, each
    row's bytes and values hashing to the digest its event recorded. `expect`: event hashes kept outside the store
    (a receipt's, a snapshot's head) that must be in the chain — the anchor that shows the log was not cut short or
    rewritten whole. Everything is read in one transaction; every difference is named."""
    problems: list[str] = []
    with store.reading() as conn:
        events = store.events()
        rows = conn.execute("SELECT id, subject, digest, embedding, crop, source_sha256, box, score, landmarks, event "
                            "FROM faces").fetchall()
    prev, expected = GENESIS, {}
    for i, e in enumerate(events, 1):
        if e.seq != i:
            problems.append(f"event #{i}: missing (the log jumps to #{e.seq}: events were removed)")
            break
        if e.prev != prev:
            problems.append(f"event #{e.seq}: its previous hash is not event #{e.seq - 1}'s (the chain was cut)")
        if event_hash(e.seq, e.at, e.actor, e.reason, e.action, e.subject, e.face, e.face_digest, e.detail,
                      e.prev) != e.hash:
            problems.append(f"event #{e.seq} ({e.action} {shown(e.subject, 64)}): its hash does not match its "
                            "content (the event was edited)")
        prev = e.hash
        if e.seq == 1 and (e.action != CREATE or e.detail.get("binding") != store.binding.digest):
            problems.append("event #1: not the creation of a store with this binding (the binding was edited)")
        if e.action in (ENROL, RESTORE):
            expected[e.face] = (e.subject, e.face_digest, e.seq)
        elif e.action == DELETE:
            expected.pop(e.face, None)
        elif e.action == ERASE:
            for f in e.detail.get("faces", []):
                expected.pop(f, None)
    hashes = {e.hash for e in events}
    for h in expect or []:
        if h not in hashes:
            problems.append(f"event {shown(h, 64)}: kept outside the store, but not in its log (the log was cut "
                            "short or rewritten)")
    seen = set()
    for face_id, subject, digest, emb, crop, source, box, score, marks, event in rows:
        seen.add(face_id)
        want = expected.get(face_id)
        if want is None:
            problems.append(f"face {shown(face_id, 40)} of {shown(subject, 64)}: stored, but no event enrolled it "
                            "(or it was deleted or erased): added behind Kiln's back")
            continue
        try:
            vec = np.frombuffer(emb, "<f4") if len(emb) == 4 * store.binding.dim else None
            actual = None if vec is None else face_digest(subject, vec, crop, source, json.loads(box), score,
                                                          json.loads(marks) if marks else None)
        except (ValueError, TypeError):
            actual = None
        if (subject, digest, event) != (want[0], want[1], want[2]) or actual != want[1]:
            problems.append(f"face {shown(face_id, 40)} of {shown(subject, 64)}: its stored bytes are not what event "
                            f"#{want[2]} enrolled (edited behind Kiln's back)")
    for face_id in sorted(set(expected) - seen):
        subject, _, seq = expected[face_id]
        problems.append(f"face {shown(face_id, 40)} of {shown(subject, 64)}: enrolled by event #{seq} and never "
                        "deleted, but missing from the store (removed behind Kiln's back)")
    subjects = len({r[1] for r in rows})
    return Audit(len(events), len(rows), subjects, prev, problems)


__all__ = ["Audit", "audit"]
