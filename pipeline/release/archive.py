"""Release archives: the deterministic tar.gz writer and the strict one-pass reader both live in the runtime,
kiln_runtime/archive.py — a deployment host reads releases and writes signed gallery snapshots without Kiln's build
stack — and are re-exported here, so the build and the deployment host write and read archives with one
implementation.
"""

from __future__ import annotations

from kiln_runtime.archive import (DISK_FULL, MAX_BYTES, MAX_MEMBERS, MAX_NAME, MAX_PADDING,  # noqa: F401
                                  safe_extract, write_archive)
