"""Release archives. The deterministic tar.gz writer is here, on the build side; the strict one-pass reader that
extracts what the writer makes and refuses everything else (`safe_extract`) lives in the runtime,
kiln_runtime/archive.py, because a deployment host must read a release without Kiln's build stack. It is
re-exported here, so the build and the deployment host read archives with one implementation.
"""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

from kiln_runtime.archive import (DISK_FULL, MAX_BYTES, MAX_MEMBERS, MAX_NAME, MAX_PADDING,  # noqa: F401
                                  safe_extract)
from pipeline.errors import KilnError
from pipeline.manifest import sha256_file


def write_archive(dest: Path, top: Path, entries: list[str]) -> str:
    """tar.gz of `entries` (paths relative to `top`; directories recurse), byte-for-byte deterministic. Returns its
    sha256. Written to a temporary sibling and renamed."""
    from pipeline.manifest import atomic_path

    names: list[Path] = []
    for e in entries:
        p = top / e
        names.append(p)
        if p.is_dir():
            names.extend(p.rglob("*"))
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
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
    return sha256_file(dest)
