"""The deployment side's goals, measured side by side in one run on this host: the runtime venv's size on disk against
the build venv's, `kiln-run serve` process start → ready (verified and warmed), and the streams `serve` holds at the
p99 budget over loopback HTTP against the in-process sweep of the same release (`kiln-run bench --http`).

    python bench/runtime.py RUNTIME_VENV ARCHIVE KEY.pub PHOTO… [--build-venv .venv] [--trials 5] [--seconds 5]

RUNTIME_VENV: a venv made from runtime/lockfile.txt and `pip install --no-deps ./runtime` (README "Deploy").
Goals (issue 45): runtime venv ≤ 15 % of the build venv; start → ready ≤ 2 s on 2 cores; serve ≥ 80 % of the
in-process streams. Prints the host class; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def du(path: Path) -> int:
    """Bytes on disk of every regular file under `path` (links not followed)."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            p = Path(d) / f
            if not p.is_symlink():
                total += p.stat().st_blocks * 512
    return total


def start_to_ready(kiln_run: Path, archive: str, key: str) -> float:
    """Seconds from spawning `kiln-run serve` to its first 200 on /readyz; then SIGTERM (it must exit 0)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from kiln_runtime.serve import free_port

    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([str(kiln_run), "serve", archive, "--key", key, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, encoding="utf-8")
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited {proc.returncode}: {proc.stderr.read()[-500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGTERM)
        if proc.wait(timeout=30) != 0:
            raise SystemExit(f"serve exited {proc.returncode} on SIGTERM")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runtime_venv", type=Path)
    ap.add_argument("archive")
    ap.add_argument("key")
    ap.add_argument("photos", nargs="+")
    ap.add_argument("--build-venv", type=Path, default=Path(__file__).resolve().parents[1] / ".venv")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--streams", default="1,2,3,4,5,6,7,8",
                    help="a finer grid than sysbench@'s: the ratio's resolution")
    args = ap.parse_args()
    kiln_run = args.runtime_venv / "bin" / "kiln-run"
    host = subprocess.run([str(args.runtime_venv / "bin" / "python"), "-c",
                           "from kiln_runtime.host import host_class, cpu; print(host_class(), '|', cpu()['cpu'])"],
                          capture_output=True, text=True, encoding="utf-8", check=True).stdout.strip()
    print(f"host: {host}; {os.cpu_count()} logical CPU(s)")
    rt, build = du(args.runtime_venv), du(args.build_venv)
    print(f"venv on disk: runtime {rt / 2**20:.0f} MiB, build {build / 2**20:.0f} MiB: {rt / build:.1%} (goal ≤ 15 %)")
    ready = [start_to_ready(kiln_run, args.archive, args.key) for _ in range(args.trials)]
    print(f"serve start → ready (verified, warmed), {args.trials} trials: median {statistics.median(ready):.2f} s, "
          f"max {max(ready):.2f} s (goal ≤ 2 s)")
    r = subprocess.run([str(kiln_run), "bench", args.archive, "--key", args.key, *args.photos, "--http", "--streams",
                        args.streams,
                        "--seconds", str(args.seconds)], text=True, encoding="utf-8")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
