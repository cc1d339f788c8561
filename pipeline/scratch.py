"""Rebuild one stage in a fresh process, in a scratch project whose inputs are the real ones (linked, read-only use).

The scratch root holds a copy of the params file, the toolchain fingerprints the stage tracks and links to each
of its data deps; the stage's own command runs there with this checkout's code. What it writes stays in the scratch
root, so the real artifacts are never touched. compile@ uses it to prove an engine reproducible; `kiln
rebuild-check` (pipeline/dagtools/rebuild.py) uses it for any stage and classifies what differs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, portable
from pipeline.checkout import cli_env
from pipeline.dvcfiles import address
from pipeline.errors import KilnError
from pipeline.manifest import file_digests, read_manifest
from pipeline.toolchain import PYTHON_TOOLCHAIN

if TYPE_CHECKING:
    from pipeline.config import Config

if TYPE_CHECKING:
    from pipeline.stage import Stage


def emulator(cpu: str) -> list[str]:
    """The command prefix that runs a process on an emulated x86-64 CPU model (qemu-user: that CPU's CPUID, so
    every library picks the kernels it would pick there), e.g. `EPYC-Rome` (a Zen 2: AVX2, no AVX-512)."""
    hint = "name one of qemu-x86_64's CPU models (qemu-x86_64 -cpu help), e.g. EPYC-Rome"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", cpu):    # an option, a feature list (,+avx512f), …
        raise KilnError(f"--cpu {cpu[:80]!r}: not a CPU model name", hint)
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        raise KilnError("qemu-x86_64 not found: emulating another CPU needs qemu-user",
                        "apt-get install qemu-user (scripts/setup.sh --test installs it)")
    r = subprocess.run([qemu, "-cpu", "help"], capture_output=True, text=True, encoding="utf-8", errors="replace")
    models = set(re.findall(r"^x86\s+(\S+)", r.stdout, re.M))       # the emulator's own list, nothing else
    if cpu not in models:
        raise KilnError(f"--cpu {cpu!r}: not a CPU model qemu-x86_64 knows", hint)
    return [qemu, "-cpu", cpu]


def rebuild(spec: Stage, cfg: Config, key: str | None, root: Path = Path("."),
            args: tuple[str, ...] = (), prefix: tuple[str, ...] | list[str] = ()) -> tempfile.TemporaryDirectory:
    """Run `spec`'s command for `key` in a fresh scratch root (under `prefix`: e.g. an emulator); return it (the
    caller cleans it up)."""
    root = Path(root).resolve()
    tmp = tempfile.TemporaryDirectory(prefix=f"kiln-rebuild-{spec.group}-")
    scratch = Path(tmp.name)
    try:
        shutil.copyfile(cfg.source, scratch / "params.yaml")
        needed = [*(paths.toolchain_file(t) for t in spec.targets(cfg, key)), Path(PYTHON_TOOLCHAIN)]
        for rel in needed:
            if (root / rel).is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / rel, scratch / rel)
        linked: list[Path] = []      # a dep may be listed twice, or lie inside a folder that is one: link each once
        for dep in sorted(set(spec.deps(cfg, key)), key=lambda d: len(Path(d).parts)):
            if any(Path(dep).is_relative_to(d) for d in linked):
                continue
            linked.append(Path(dep))
            src, dst = root / dep, scratch / dep
            if not src.exists():
                raise KilnError(f"{src}: input of {spec.name(key)} missing",
                                f"build it first: dvc repro {address(spec.name(key))}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src, dst)
        cmd = [*prefix, sys.executable, "-m", spec.module, "--params", "params.yaml", *args, *([key] if key else [])]
        env = cli_env()
        if spec.portable:    # set from the start: a relaunch (portable.pin) would leave an emulator's process
            env.update(portable.ENV)
        r = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, encoding="utf-8",
                           errors="replace")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])
            raise KilnError(f"{spec.name(key)}: the rebuild in a fresh process failed: {last[-1][:300]}",
                            f"run it directly to see why: kiln {spec.group} {key or ''}".rstrip())
    except BaseException:
        tmp.cleanup()
        raise
    return tmp


def differing_files(manifest_file: Path, other_dir: Path) -> list[str]:
    """Files the manifest lists whose bytes differ in `other_dir` (same relative paths), or are missing there."""
    out = []
    for entry in read_manifest(manifest_file)["files"]:
        other = Path(other_dir) / entry["path"]
        if not other.is_file() or file_digests(other)["sha256"] != entry["sha256"]:
            out.append(entry["path"])
    return out
