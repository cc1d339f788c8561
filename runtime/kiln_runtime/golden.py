"""A release's golden samples: a few real inputs of each engine and the outputs the gated runtime gave for them.

`kiln release --system` picks, per part, up to `MAX_SAMPLES` samples of the model's golden feed (the smallest feeds
first: a detector's feeds are whole photos or pyramid levels), runs the shipped engine on them on the releasing
host — whose runtime must satisfy the engine's requirement (kiln_runtime/requirements.py) — and writes

    golden/<engine>/feeds.json       [{"inputs": {"<input name>": "0.in.0.npy"}, "outputs": ["0.out.0.npy", …]}, …]
    golden/<engine>/*.npy            the arrays (np.save: the same inputs give the same bytes)

with release.json's `golden` entry naming the files and the limits. On a host whose runtime differs from an
engine's requirement, `kiln-run … --allow-runtime-drift` runs that engine on the inputs first (`check`): every output
of every sample must keep a cosine ≥ `cosine_min` with the recorded one and a max |Δ| ≤ `max_abs_rel` × the
recorded output's largest |value|; else the command stops (exit 1) with the worst numbers.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from kiln_runtime import runners
from kiln_runtime.digests import canonical_json
from kiln_runtime.errors import GateFailed

DIR, FEEDS = "golden", "feeds.json"
MAX_SAMPLES, MAX_FEEDS = 4, 2
LIMITS = {"cosine_min": 0.999, "max_abs_rel": 0.02}
MAX_ARRAY = 16 << 20                 # bytes of one array read back from a release


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def pick(feeds, max_samples: int = MAX_SAMPLES, max_feeds: int = MAX_FEEDS, look: int = 16) -> list[dict]:
    """Up to `max_feeds` of the first `look` feeds, smallest first, each cut to `max_samples` along its batch axis."""
    first = []
    for i, f in enumerate(feeds):
        if i >= look:
            break
        first.append(f)
    first.sort(key=lambda f: sum(v.nbytes for v in f.values()))
    return [{k: np.ascontiguousarray(v[:max_samples]) for k, v in f.items()} for f in first[:max_feeds]]


def record(runner, feeds: list[dict]) -> tuple[dict[str, bytes], int]:
    """The files of one engine's golden folder ({name: bytes}) and how many samples they hold."""
    files, rows, samples = {}, [], 0
    for i, feed in enumerate(feeds):
        outs = runner.run_all(feed)
        row = {"inputs": {}, "outputs": []}
        for k, (name, arr) in enumerate(sorted(feed.items())):
            files[f"{i}.in.{k}.npy"] = npy_bytes(arr)
            row["inputs"][name] = f"{i}.in.{k}.npy"
        for k, arr in enumerate(outs):
            files[f"{i}.out.{k}.npy"] = npy_bytes(np.asarray(arr))
            row["outputs"].append(f"{i}.out.{k}.npy")
        rows.append(row)
        samples += int(next(iter(feed.values())).shape[0])
    files[FEEDS] = canonical_json(rows)
    return files, samples


def file_name(name: Any) -> str:
    """A golden sample's file name as a release lists it: a plain name in its engine's folder, nothing else."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise GateFailed(f"golden sample file {str(name)[:100]!r} is not a plain file name", "do not use this release")
    return name


def _array(path: Path) -> np.ndarray:
    if path.stat().st_size > MAX_ARRAY:
        raise GateFailed(f"{path.name}: over {MAX_ARRAY >> 20} MiB; a golden sample is small",
                         "do not use this release")
    return np.load(path, allow_pickle=False)


def compare(expected: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    """(the lowest cosine of any sample's output, the largest |Δ| relative to that output's largest |value|)."""
    cos_min, rel_max = 1.0, 0.0
    if len(expected) != len(got):
        return -1.0, float("inf")
    for e, g in zip(expected, got):
        e, g = np.asarray(e, np.float64), np.asarray(g, np.float64)
        if e.shape != g.shape:
            return -1.0, float("inf")
        scale = float(np.max(np.abs(e))) or 1.0
        rel_max = max(rel_max, float(np.max(np.abs(e - g))) / scale if e.size else 0.0)
        for a, b in zip(e.reshape(len(e), -1) if e.ndim > 1 else [e], g.reshape(len(g), -1) if g.ndim > 1 else [g]):
            na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
            cos = 1.0 if na == nb == 0 else float(a @ b) / (na * nb) if na and nb else 0.0
            cos_min = min(cos_min, cos)
    return cos_min, rel_max


def check(tree: Path, part: dict[str, Any], target: str, limits: dict[str, float]) -> str:
    """Run a part's engine on its golden inputs on this host; one line of what it found, GateFailed beyond limits."""
    engine = str(part["engine"])
    gdir = tree / DIR / engine
    rows = json.loads((gdir / FEEDS).read_bytes()) if (gdir / FEEDS).is_file() else None
    if not rows:
        raise GateFailed(f"{engine}: this release carries no golden samples for it, so its gate cannot be re-run "
                         "on this host's runtime", "install the release's runtime lock instead of allowing drift")
    runner = runners.load(target, tree / part["dir"], engine)
    cos_min, rel_max, samples = 1.0, 0.0, 0
    for row in rows:
        feed = {str(name): _array(gdir / file_name(f)) for name, f in row["inputs"].items()}
        try:
            got = runner.run_all(feed)
        except Exception as e:           # the runtime's own error type: this runtime cannot run this engine
            raise GateFailed(f"{engine}: this host's runtime could not run its golden inputs "
                             f"({type(e).__name__}: {str(e).strip()[:200]})", "install the release's runtime lock "
                             "and run it again") from None
        c, r = compare([_array(gdir / file_name(f)) for f in row["outputs"]], got)
        cos_min, rel_max = min(cos_min, c), max(rel_max, r)
        samples += int(next(iter(feed.values())).shape[0])
    said = (f"{engine}: golden check on this host's runtime, {samples} sample(s): cosine min {cos_min:.6f} "
            f"(limit {limits['cosine_min']}), max |Δ| {rel_max:.2e} of the output's range (limit "
            f"{limits['max_abs_rel']})")
    if cos_min < limits["cosine_min"] or rel_max > limits["max_abs_rel"]:
        raise GateFailed(f"{said}: FAILED", "do not run this release on this runtime: install the release's runtime "
                         "lock (pip install -r the lockfile kiln-runtime ships) and run it again")
    return said
