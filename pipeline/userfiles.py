"""Opening a file a user named (params.yaml, a profile, a photo, a model's ONNX file): a regular file or a KilnError
(kiln_runtime/files.py: a deployment host opens its files the same way)."""

from __future__ import annotations

from kiln_runtime.files import open_regular  # noqa: F401
