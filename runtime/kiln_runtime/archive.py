"""Release archives: the deterministic tar.gz writer (`write_archive`) and a strict one-pass reader (`safe_extract`)
that extracts what the writer makes and refuses everything else. Both live in the runtime because a deployment host
reads a release before it trusts anything in it, without Kiln's build stack, and writes signed gallery snapshots
(kiln_runtime/gallery.py) in the same format; the build re-exports them (pipeline/release/archive.py), so one
implementation writes and reads every archive.

The reader and GNU tar must never disagree: Python's tarfile stops quietly at a header with a bad checksum while
`tar -xzf` skips it and extracts what follows, and `gzip -d` goes on to a second gzip member or past trailing
bytes. So the reader consumes the whole stream — one gzip member, plain ustar/GNU headers, files and directories
only, canonical names, only zeros after the end-of-archive marker — and applies every cap (members, bytes, name
length, padding) before reading what it bounds (tests/test_reliability_release.py checks it against GNU tar).
"""

from __future__ import annotations

import errno
import gzip
import os
import re
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from kiln_runtime.errors import GateFailed, KilnError

MAX_MEMBERS, MAX_BYTES = 10_000, 8 << 30         # members (files + directories) and file bytes in one archive
MAX_NAME = 4096                                   # bytes of one member name
MAX_PADDING = 1 << 20                             # zero bytes after the end-of-archive marker (tar writes 10 KiB)
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)     # re-raised as they are: the caller names where


class _Inflate:
    """The decompressed bytes of a gzip file, read in order, as much as asked for. A release is one gzip member and
    nothing after it: `gzip -d` (so `tar -xzf`) would go on to a second member or past trailing bytes."""

    def __init__(self, f) -> None:
        self._f, self._z, self.started = f, zlib.decompressobj(wbits=31), False

    def read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n and not self._z.eof:
            data = self._z.unconsumed_tail or self._f.read(1 << 20)
            if not data:
                break                                                 # the file ends inside the gzip stream
            out += self._z.decompress(data, n - len(out))            # bounded: a bomb inflates n bytes at a time
            self.started = True
        return bytes(out)

    def after_end(self) -> str | None:
        """What is wrong after the gzip member (zlib checked its CRC and length), None when nothing is."""
        if not self._z.eof:
            return "the gzip stream is truncated"
        if self._z.unused_data or self._f.read(1):
            return "data follows the gzip stream (a second member or trailing bytes)"
        return None


_GNU_MAGIC, _USTAR_MAGIC = b"ustar  \0", b"ustar\x0000"
_BLOCK = tarfile.BLOCKSIZE


def _header(block: bytes) -> tarfile.TarInfo:
    """One tar header, strictly: checksum, a ustar or GNU magic, a plain octal size, and no field that GNU tar and
    Python's tarfile read differently (a GNU header's bytes 345-500 are a name prefix to Python, times to tar)."""
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as e:
        raise ValueError(f"a header is invalid ({e})") from None
    magic = block[257:265]
    if magic not in (_GNU_MAGIC, _USTAR_MAGIC) or (magic == _GNU_MAGIC and any(block[345:500])):
        raise ValueError("a header is not plain ustar or GNU tar")
    if not re.fullmatch(rb"[0-7]{11}\0", block[124:136]):
        raise ValueError("a header's size field is not plain octal")
    if block[156:157] not in (tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE):
        raise ValueError(f"member {info.name[:200]!r} is not a plain file inside the archive")
    if info.mode & 0o7000:            # tar run as root would restore setuid/setgid bits; a release has none
        raise ValueError(f"member {info.name[:200]!r} has mode {info.mode:o}; a release has plain permissions")
    return info


def _pax_path(data: bytes) -> str:
    """The `path` of a pax extended header (Python's tarfile writes one for a long name); any other keyword is
    refused rather than interpreted (readers disagree on several)."""
    path, pos = None, 0
    while pos < len(data):
        m = re.match(rb"([1-9][0-9]{0,5}) ", data[pos:pos + 8])
        record = data[pos:pos + int(m[1])] if m else b""
        key, eq, value = record[m.end():-1].partition(b"=") if m else (b"", b"", b"")
        if not m or not record.endswith(b"\n") or not eq or key != b"path" or path is not None:
            raise ValueError(f"a pax header holds {key[:40]!r}; a release uses only 'path'")
        path, pos = value.decode("utf-8"), pos + len(record)
    if path is None:
        raise ValueError("a pax header without a path")
    return path


def _member_name(raw: str, is_dir: bool) -> str:
    name = raw.removesuffix("/") if is_dir else raw
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).as_posix() != name or name.startswith("/") or ".." in parts or \
            len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise ValueError(f"member {name[:200]!r} is not a plain file inside the archive")
    return name


def _read_exact(stream: _Inflate, n: int, sink: Callable[[bytes], Any] | None = None) -> None:
    while n:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            raise ValueError("the archive is truncated")
        if sink:
            sink(chunk)
        n -= len(chunk)


def _stream_members(stream: _Inflate, dest: Path, top_file_max: int) -> tuple[list[str], list[str]]:
    """Read the tar stream to its end, writing files and directories under `dest`; returns (files, dirs). Raises
    ValueError at the first thing a release never holds (or a top-level file over `top_file_max` bytes). Every bound
    applies before the bytes it bounds are read, and everything after the end-of-archive marker must be zero padding, so
    no reader finds a member this one did not check (Python's tarfile stops quietly at a bad header; GNU tar skips it
    and extracts what follows)."""
    files: list[str] = []
    dirs: list[str] = []
    seen: set[str] = set()
    pending: str | None = None                        # a long name (GNU 'L' or pax path) for the next member
    total = 0
    while True:
        block = stream.read(_BLOCK)
        if len(block) < _BLOCK:
            raise ValueError("the archive is truncated (no end-of-archive marker)")
        if block.count(0) == _BLOCK:
            if pending is not None:
                raise ValueError("a long-name header is not followed by a member")
            break
        info = _header(block)
        if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE):
            if pending is not None or info.size > MAX_NAME + 64:
                raise ValueError("a long-name header is too long or follows another")
            data = bytearray()
            _read_exact(stream, info.size, data.extend)
            _read_exact(stream, -info.size % _BLOCK)
            pending = _pax_path(bytes(data)) if info.type == tarfile.XHDTYPE else \
                bytes(data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        is_dir = info.type == tarfile.DIRTYPE
        name = _member_name(pending if pending is not None else info.name, is_dir)
        pending = None
        if name in seen:              # tar readers disagree on which copy wins: a second copy is never fine
            raise ValueError(f"member {name[:200]!r} appears twice")
        seen.add(name)
        if len(seen) > MAX_MEMBERS:
            raise ValueError(f"more than {MAX_MEMBERS} members; a release has far fewer")
        size = 0 if is_dir else info.size
        if "/" not in name and size > top_file_max:          # never written out, never parsed
            raise ValueError(f"{name[:200]}: {size} bytes; no file at the top of a release archive is over "
                             f"{top_file_max >> 20} MiB")
        total += size
        if total > MAX_BYTES:
            raise ValueError(f"more than {MAX_BYTES >> 30} GiB of files; too large for a release")
        (dirs if is_dir else files).append(name)
        target = dest / name
        try:
            if is_dir:
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as out:
                _read_exact(stream, size, out.write)
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            raise ValueError(f"member {name[:200]!r} collides with another member's path") from None
        except OSError as e:
            if e.errno in DISK_FULL:
                raise
            raise ValueError(f"member {name[:200]!r} cannot be a file here ({e.strerror})") from None
        _read_exact(stream, -size % _BLOCK)
    padding = 0
    while chunk := stream.read(1 << 16):
        padding += len(chunk)
        if chunk.count(0) != len(chunk) or padding > MAX_PADDING:
            raise ValueError("data follows the end-of-archive marker (another tar reader could find members there)")
    if problem := stream.after_end():
        raise ValueError(problem)
    return files, dirs


def safe_extract(archive: Path, dest: Path, top_file_max: int = MAX_BYTES) -> None:
    """Extract a release archive into the empty directory `dest`: one pass over the stream, files and directories
    only (no links, devices, absolute paths or '..'), refused at the first thing a release never holds. A file at the
    top level over `top_file_max` bytes (a release's signature) is refused before it is written out."""
    try:
        f = open(archive, "rb")
    except OSError as e:
        raise GateFailed(f"{archive}: not a readable release archive ({e.strerror})", "get the archive again") from None
    with f:
        stream = _Inflate(f)
        try:
            files, dirs = _stream_members(stream, Path(dest), top_file_max)
        except zlib.error as e:
            what = "archive is corrupt" if stream.started else "not a readable release archive"
            raise GateFailed(f"{archive}: {what} ({e})", "get the archive again") from None
        except ValueError as e:
            raise GateFailed(f"{archive}: {e}", "refusing to use it; do not use this archive") from None
    held = {str(p) for f in files for p in PurePosixPath(f).parents}
    for d in dirs:                    # the signature covers files only: an empty directory is unsigned content
        if d not in held:
            raise GateFailed(f"{archive}: directory {d[:200]!r} holds no file (unsigned content)",
                             "do not use this archive")


# ---------------------------------------------------------------------------------------------- the writer
def write_archive(dest: Path, top: Path, entries: list[str], level: int = 9) -> str:
    """tar.gz of `entries` (paths relative to `top`; directories recurse), byte-for-byte deterministic (sorted
    names, no times, owners or modes of the host; gzip `level` 9, what every release is packed with — tests that
    forge an archive for the verifier, which reads any level, pass 1: a fifth of the time). Returns its sha256.
    Written to a temporary sibling, fsynced and renamed: a killed writer leaves nothing that looks finished (and its
    leftovers are removed by the next writer). A link is refused."""
    import hashlib

    from kiln_runtime.files import clear_dead_temps

    dest = Path(dest)
    names: list[Path] = []
    for e in entries:
        p = top / e
        names.append(p)
        if p.is_dir():
            names.extend(p.rglob("*"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_temps(dest)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                     compresslevel=level) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for p in sorted(names, key=lambda q: q.relative_to(top).as_posix()):
                if p.is_symlink():
                    raise KilnError(f"{p}: a link cannot go into a release", "release regular files only")
                info = tarfile.TarInfo(p.relative_to(top).as_posix())
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if p.is_dir():
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                else:
                    info.size, info.mode = p.stat().st_size, 0o644
                    with open(p, "rb") as f:
                        tar.addfile(info, f)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
            h = hashlib.sha256()
            while chunk := f.read(1 << 20):
                h.update(chunk)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)                  # mkstemp creates 0600: the file's usual permissions
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return h.hexdigest()
