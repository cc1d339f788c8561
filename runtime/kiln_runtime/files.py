"""Opening a file a user named (a photo, a key, a config): a regular file or a KilnError. And the private temporary
folders a command extracts a release into: named by the process that owns them, so what a killed one left behind is
removed by the next `kiln-run` command.

The file is opened without blocking and checked on the open descriptor — a FIFO or device named like a file would
otherwise hang the read (or never end), and a check before opening would race a swap."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from kiln_runtime.errors import KilnError
from kiln_runtime.text import shown


def open_regular(path: Path, hint: str, missing: tuple[str, str] | None = None) -> BinaryIO:
    """`path` opened for reading in binary mode. Not found: KilnError `missing` (message, hint), else
    "<path>: not found" with `hint`; not a regular file or unreadable: KilnError naming it, with `hint`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        message, why = missing or (f"{shown(path, 500)}: not found", hint)
        raise KilnError(message, why) from None
    except OSError as e:
        raise KilnError(f"{shown(path, 500)}: cannot open it ({e.strerror})", hint) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KilnError(f"{shown(path, 500)}: not a regular file (a folder, FIFO or device)", hint)
    return os.fdopen(fd, "rb")


def write_json(path: Path, doc: dict) -> None:
    """A `--json FILE` report, whole or not at all: a temporary sibling, then a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KilnError(f"cannot write {path} ({e.strerror})", "pass --json in a writable folder") from None


# ---------------------------------------------------------------------------------------------- scratch folders
_OWNED = re.compile(r"kiln-[a-z-]+?-pid([0-9]+)-ns([0-9]+)-")


def _pid_namespace() -> int:
    """This process's PID namespace (its inode): a pid means a process only within one namespace, so containers that
    share a temporary folder never judge each other's folders."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag() -> str:
    """What names a scratch folder's owner: `pid<PID>-ns<PID NAMESPACE>`."""
    return f"pid{os.getpid()}-ns{_pid_namespace()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:           # someone else's process: alive
        return True
    return True


def clear_dead_temps(dest: Path) -> None:
    """Remove temporary siblings `.<name>.<pid>.*.tmp` of `dest` left by a writer that was killed."""
    for old in Path(dest).parent.glob(f".{Path(dest).name}.*.tmp"):
        parts = old.name[len(Path(dest).name) + 2:].split(".")
        if parts and parts[0].isdigit() and int(parts[0]) != os.getpid() and not _alive(int(parts[0])):
            old.unlink(missing_ok=True)


def sweep_stale(folder: Path | None = None) -> list[Path]:
    """Remove the scratch folders (`scratch`, and engines' private copies) in the temporary folder whose owning
    process is gone — a `kiln-run serve` or a worker killed by SIGKILL cannot remove them itself. Only folders of this
    user; the ones removed."""
    base = Path(folder or tempfile.gettempdir())
    ns = _pid_namespace()
    gone: list[Path] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return gone
    for e in entries:
        m = _OWNED.match(e.name)
        try:
            if not m or not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if int(m[2]) == ns and int(m[1]) != os.getpid() and not _alive(int(m[1])):
            shutil.rmtree(e.path, ignore_errors=True)
            gone.append(Path(e.path))
    return gone


@contextmanager
def scratch(kind: str) -> Iterator[Path]:
    """A private temporary folder `kiln-<kind>-pid<PID>-ns<PID NAMESPACE>-…` (0700), removed on exit; first, the
    stale ones of dead processes are swept (`sweep_stale`)."""
    sweep_stale()
    with tempfile.TemporaryDirectory(prefix=f"kiln-{kind}-{owner_tag()}-") as tmp:
        yield Path(tmp)
