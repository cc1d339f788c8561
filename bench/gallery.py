"""The live gallery measured on this host, side by side in one run: enrol throughput over HTTP (faces/s through
`kiln-run serve --gallery`, real photos, concurrent clients), identify latency (p50/p99, one client) at 1 000 and
100 000 enrolled identities (synthetic vectors fill the size, drawn like the release's own embeddings; a real photo
enrolled over HTTP checks every answer), and memory per identity (the workers' RSS and the store's bytes).

    python bench/gallery.py ARCHIVE KEY.pub PHOTOS_DIR [--kiln-run PATH] [--sizes 1000,100000] [--requests 200]

PHOTOS_DIR holds obama.jpg, obama2.jpg, obama3.jpg and biden.jpg (tests/conftest.py `site_photos`: the pinned
face_recognition sdist's test images). Prints the host class; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

TOKEN = "bench-token-" + "b" * 32


def call(url: str, method: str = "GET", body: bytes | None = None, token: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Serving:
    def __init__(self, kiln_run: str, archive: str, key: str, store: Path, workers: int) -> None:
        from kiln_runtime.serve import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "KILN_GALLERY_TOKEN": TOKEN}
        t0 = time.monotonic()
        self.proc = subprocess.Popen([kiln_run, "serve", archive, "--key", key, "--port", str(self.port), "--workers",
                                      str(workers), "--gallery", str(store), "--drain-delay", "0"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, encoding="utf-8")
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited {self.proc.returncode}: {self.proc.stderr.read()[-800:]}")
            try:
                if call(self.url + "/readyz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        self.ready_s = time.monotonic() - t0

    def workers_rss(self) -> int:
        """Bytes resident in the worker processes (the server's children running the system)."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for kid in (task / "children").read_text(encoding="ascii").split():
                if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():
                    rss = next(ln for ln in Path(f"/proc/{kid}/status").read_text(encoding="utf-8").splitlines()
                               if ln.startswith("VmRSS"))
                    total += int(rss.split()[1]) * 1024
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def fill(store: Path, n: int, dim: int, ref) -> None:
    """n synthetic identities, one face each, drawn per dimension like the release's own embeddings."""
    import numpy as np

    from kiln_runtime import gallery as g

    rng = np.random.default_rng(0)
    mean, std = ref.mean(axis=0), ref.std(axis=0) + 1e-3
    with g.Store(store) as s:
        for start in range(0, n, 10_000):
            k = min(10_000, n - start)
            vecs = (mean + std * rng.standard_normal((k, dim))).astype(np.float32)
            s.enrol_many([(f"synthetic-{start + i:07d}", v) for i, v in enumerate(vecs)], "bench", "fill")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archive")
    ap.add_argument("key")
    ap.add_argument("photos", type=Path)
    ap.add_argument("--kiln-run", default=shutil.which("kiln-run") or "kiln-run")
    ap.add_argument("--sizes", default="1000,100000")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--enrols", type=int, default=40)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()

    import numpy as np

    from kiln_runtime import gallery as g
    from kiln_runtime import release
    from kiln_runtime.host import host_class
    from kiln_runtime.loadtest import cores

    photos = {n: (args.photos / n).read_bytes() for n in ("obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg")}
    workers = cores()
    print(f"host class {host_class()}, {workers} core(s); {args.kiln_run}")
    with release.verified(Path(args.archive), Path(args.key)) as (tree, _):
        binding = g.binding_of(tree)
        ref = np.load(tree / release.GALLERY_DIR / release.EMBEDDINGS)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-gallery-") as tmp:
        tmp = Path(tmp)
        # 1. enrol throughput over HTTP
        store = tmp / "enrol.sqlite"
        s = Serving(args.kiln_run, args.archive, args.key, store, workers)
        bodies = list(photos.values())

        def enrol(i: int) -> int:
            return call(f"{s.url}/v1/subjects/bench-{i:04d}/faces", "POST", bodies[i % len(bodies)], TOKEN)[0]

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            codes = list(pool.map(enrol, range(args.enrols)))
        wall = time.perf_counter() - t0
        s.stop()
        assert codes.count(201) == args.enrols, codes
        print(f"enrol over HTTP: {args.enrols} faces from real photos, {args.clients} clients, {workers} worker(s): "
              f"{args.enrols / wall:.1f} faces/s ({wall:.2f} s)")
        # 2. identify latency and memory per identity at each size
        rows = []
        for n in [int(x) for x in args.sizes.split(",")]:
            store = tmp / f"gallery-{n}.sqlite"
            g.create(store, binding, "bench", "a sized gallery").close()
            t0 = time.perf_counter()
            fill(store, n - 1, binding.dim, ref)
            filled = time.perf_counter() - t0
            s = Serving(args.kiln_run, args.archive, args.key, store, workers)
            status, _ = call(s.url + "/v1/subjects/the-one/faces", "POST", photos["obama.jpg"], TOKEN)
            assert status == 201
            lat, match, wrong = [], [], 0
            for i in range(args.requests):
                t0 = time.perf_counter()
                status, doc = call(s.url + "/v1/identify", "POST", photos["obama2.jpg" if i % 2 else "obama3.jpg"])
                lat.append((time.perf_counter() - t0) * 1e3)
                match.append(doc["timings_ms"]["match"])
                wrong += [f["identity"] for f in doc["faces"]] != ["the-one"]
            rss = s.workers_rss()
            ready = s.ready_s
            s.stop()
            q, qm = statistics.quantiles(lat, n=100), statistics.quantiles(match, n=100)
            rows.append((n, q[49], q[98], wrong, rss, store.stat().st_size, ready, filled))
            print(f"  {n:>7} identities: identify p50 {q[49]:.1f} ms, p99 {q[98]:.1f} ms over {args.requests} requests "
                  f"({wrong} wrong; the search itself p50 {qm[49]:.2f} ms, p99 {qm[98]:.2f} ms); workers' RSS "
                  f"{rss / 2**20:.0f} MiB; store {store.stat().st_size / 2**20:.1f} MiB; serve ready in {ready:.2f} s; "
                  f"filled in {filled:.1f} s")
        if len(rows) >= 2:
            (n0, *_, rss0, size0, _, _), (n1, *_, rss1, size1, _, _) = rows[0], rows[-1]
            print(f"memory per identity (one face each): workers {(rss1 - rss0) / (n1 - n0) / workers:.0f} B per "
                  f"worker ({binding.dim}-d float32 = {4 * binding.dim} B of vector), store "
                  f"{(size1 - size0) / (n1 - n0):.0f} B (vector, row and its hash-chained event)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
