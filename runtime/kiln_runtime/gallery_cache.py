"""The search cache of a live gallery: the store's vectors in memory, kept in step with its log before every batch a
worker runs (kiln_runtime/workers.py) — the store stays the truth, this is what is searched."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln_runtime.gallery import DELETE, ENROL, ERASE, RESTORE, Binding, Store


class Live:
    """The store's vectors in memory for search, brought up to date from the log (`refresh`): enrolments appended,
    deletions and erasures removed (the last row moved into the hole), a restore reloads. What a worker searches."""

    def __init__(self, path: Path, binding: Binding) -> None:
        self.store = Store(path, readonly=True).bound_to(binding)
        self.dim = binding.dim
        self.version = -1
        self.refresh()

    def _reload(self) -> None:
        ids, subjects, emb = self.store.vectors()
        self.ids, self.labels = ids, subjects
        self.pos = {f: i for i, f in enumerate(ids)}
        self.buf = np.zeros((max(64, 2 * len(ids)), self.dim), np.float32)
        self.buf[:len(ids)] = emb

    def refresh(self) -> bool:
        """Catch up with the store (one read transaction: the version and what it holds agree); whether anything
        changed."""
        with self.store.reading():
            version = self.store.version()
            if version == self.version:
                return False
            events = self.store.events(self.version) if self.version >= 0 else []
            if self.version < 0 or len(events) > max(256, len(self.ids) // 4) or \
                    any(e.action == RESTORE for e in events):
                self._reload()
            else:
                rows = self.store.embeddings([e.face for e in events if e.action == ENROL])
                for e in events:
                    if e.action == ENROL and e.face in rows and e.face not in self.pos:
                        self._add(e.face, *rows[e.face])
                    elif e.action == DELETE:
                        self._remove(e.face)
                    elif e.action == ERASE:
                        for f in e.detail.get("faces", []):
                            self._remove(f)
        self.version = version
        return True

    def _add(self, face: str, subject: str, vec: np.ndarray) -> None:
        n = len(self.ids)
        if n == len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros_like(self.buf)])
        self.buf[n] = vec
        self.pos[face] = n
        self.ids.append(face)
        self.labels.append(subject)

    def _remove(self, face: str) -> None:
        i = self.pos.pop(face, None)
        if i is None:
            return
        last = len(self.ids) - 1
        if i != last:
            self.buf[i] = self.buf[last]
            self.ids[i], self.labels[i] = self.ids[last], self.labels[last]
            self.pos[self.ids[i]] = i
        self.ids.pop()
        self.labels.pop()

    def gallery(self) -> tuple[np.ndarray, list[str]]:
        return self.buf[:len(self.ids)], list(self.labels)


__all__ = ["Live"]
