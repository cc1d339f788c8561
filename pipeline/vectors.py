"""Embedding vectors in the space a face system decides in: `as_l2` (numpy only; kiln_runtime/system.py holds it, so
a deployment host decides the same way), shared by golden@, the end-to-end gate and the face-task metrics."""

from __future__ import annotations

from kiln_runtime.system import as_l2  # noqa: F401
