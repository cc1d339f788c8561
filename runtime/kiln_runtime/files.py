"""Opening a file a user named (a photo, a key, a config): a regular file or a KilnError.

The file is opened without blocking and checked on the open descriptor — a FIFO or device named like a file would
otherwise hang the read (or never end), and a check before opening would race a swap."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from kiln_runtime.errors import KilnError


def open_regular(path: Path, hint: str, missing: tuple[str, str] | None = None) -> BinaryIO:
    """`path` opened for reading in binary mode. Not found: KilnError `missing` (message, hint), else
    "<path>: not found" with `hint`; not a regular file or unreadable: KilnError naming it, with `hint`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        message, why = missing or (f"{path}: not found", hint)
        raise KilnError(message, why) from None
    except OSError as e:
        raise KilnError(f"{path}: cannot open it ({e.strerror})", hint) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KilnError(f"{path}: not a regular file (a folder, FIFO or device)", hint)
    return os.fdopen(fd, "rb")
