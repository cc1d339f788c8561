"""FAISS indexes for the matching stage: build by spec, search, recall against exact search, latency, bytes.

Specs are parsed by pipeline/matching/spec.py (no FAISS needed to read params). Determinism: training vectors are a
seeded, sorted sample of the gallery (its ids' and bytes' hash is recorded); FAISS k-means seeds are fixed; the
thread count is fixed with omp_set_num_threads (params `matching.threads`); HNSW is built single-threaded because
its parallel insertion order is not deterministic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pipeline.errors import KilnError
from pipeline.matching.spec import IndexSpec, spec

SEED = 1234


def _faiss():
    import faiss  # lazy: `import pipeline` must not need faiss
    return faiss


# Exact search from this many queries per call through BLAS (sgemm), below it through FAISS's SIMD scan. FAISS 1.15
# compares `distance_compute_blas_threshold` with queries × dimension (not queries, as older releases did): the
# earlier setting 20 sent even one 128-d query through a one-column sgemm, 4x slower than the scan (1M × 128 at
# batch 1: 200 vs 50 ms, Zen 3); its default 128000 kept a 64-query batch off BLAS (49 vs 7 ms per query). Measured
# crossover on 1M × 128, one thread: the scan wins at 1-2 queries, BLAS from 4 (188 vs 209 ms).
BLAS_FROM_QUERIES = 4


def configure(threads: int, dim: int) -> None:
    """Fixed thread count, and exact search through BLAS from BLAS_FROM_QUERIES queries of `dim` floats."""
    faiss = _faiss()
    faiss.omp_set_num_threads(int(threads))
    faiss.cvar.distance_compute_blas_threshold = BLAS_FROM_QUERIES * int(dim)


def training_sample(n: int, size: int, seed: int = SEED) -> np.ndarray:
    """Sorted ids of a seeded sample (all ids when size >= n)."""
    if size >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(n, size, replace=False)).astype(np.int64)


@dataclass
class Built:
    spec: IndexSpec
    index: object
    build_s: float
    train_ids_xxh3_128: str | None = None
    train_xxh3_128: str | None = None
    info: dict = field(default_factory=dict)


def build(s: "str | IndexSpec", vectors: np.ndarray, threads: int, seed: int = SEED,
          train_size: int | None = None) -> Built:
    """Build (train if needed, add all vectors) one index. Search-time knobs (efSearch, nprobe) are set too."""
    faiss = _faiss()
    sp = spec(s)
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    n, d = x.shape
    p = sp.p
    configure(1 if sp.kind == "hnsw" else threads, d)
    t0 = time.perf_counter()
    train_ids = None
    if sp.kind == "flat":
        index = faiss.IndexFlatL2(d)
    elif sp.kind == "sq8":
        index = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_L2)
        train_ids = training_sample(n, train_size or 65536, seed)
    elif sp.kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, p["M"])
        index.hnsw.efConstruction = max(40, 2 * p["M"])
    elif sp.kind in ("ivf-flat", "ivf-pq"):
        nlist = p["nlist"]
        if n < nlist:
            raise KilnError(f"{sp.name}: {n} vectors cannot train {nlist} lists", hint="lower nlist")
        quantizer = faiss.IndexFlatL2(d)
        if sp.kind == "ivf-flat":
            index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_L2)
        else:
            if d % p["m"]:
                raise KilnError(f"{sp.name}: m={p['m']} does not divide the dimension {d}")
            index = faiss.IndexIVFPQ(quantizer, d, nlist, p["m"], p["nbits"])
            index.pq.cp.seed = seed
        index.cp.seed = seed
        train_ids = training_sample(n, train_size or min(n, max(64 * nlist, 2 ** p.get("nbits", 0) * 64)), seed)
    else:  # pragma: no cover - parse() rejects it
        raise KilnError(f"unknown index kind {sp.kind}")
    hashes = (None, None)
    if train_ids is not None:
        xt = x[train_ids]
        hashes = (xxhash.xxh3_128(train_ids.tobytes()).hexdigest(), xxhash.xxh3_128(xt.tobytes()).hexdigest())
        index.train(xt)
    index.add(x)
    set_search_params(index, sp)
    build_s = time.perf_counter() - t0
    configure(threads, d)
    return Built(sp, index, build_s, *hashes,
                 info={"n": n, "d": d, "train_n": 0 if train_ids is None else int(len(train_ids)),
                       "seed": seed, "threads": 1 if sp.kind == "hnsw" else threads})


def set_search_params(index, sp: IndexSpec) -> None:
    p = sp.p
    if sp.kind == "hnsw":
        index.hnsw.efSearch = p["ef"]
    elif sp.kind in ("ivf-flat", "ivf-pq"):
        index.nprobe = p["nprobe"]


def index_bytes(index) -> int:
    return int(_faiss().serialize_index(index).nbytes)


def serialize(index) -> bytes:
    return _faiss().serialize_index(index).tobytes()


def deserialize(data: bytes):
    return _faiss().deserialize_index(np.frombuffer(data, np.uint8))


def search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(L2 distances (not squared), ids), both (nq, k)."""
    d, i = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return np.sqrt(np.maximum(d, 0)), i


def recall_at_k(exact_ids: np.ndarray, approx_ids: np.ndarray, k: int, exact_dist: np.ndarray | None = None,
                approx_dist: np.ndarray | None = None, rtol: float = 1e-5) -> float:
    """Mean over queries of |approx top-k ∩ exact top-k| / k (k = 1: top-1 agreement).

    With distances, ties count: a returned row outside the exact top-k replaces a missing exact row that is no
    closer (within `rtol`) — with equidistant rows (duplicates) which one exact search lists is arbitrary.
    `approx_dist` must be the TRUE distances of the returned rows, not the index's estimates (IVF-PQ and SQ return
    approximate distances, which would flatter them).
    """
    exact_ids, approx_ids = np.asarray(exact_ids), np.asarray(approx_ids)
    if exact_dist is not None and approx_dist is not None and exact_ids.shape[0] == approx_ids.shape[0] \
            and min(exact_ids.shape[1], approx_ids.shape[1]) >= k:
        hits = 0
        for er, ar, ed, ad in zip(exact_ids[:, :k], approx_ids[:, :k], np.asarray(exact_dist)[:, :k],
                                  np.asarray(approx_dist)[:, :k]):
            common = np.intersect1d(er, ar[ar >= 0])
            missing = sorted(float(x) for e, x in zip(er, ed) if e not in common)
            extra = sorted(float(x) for a, x in zip(ar, ad) if a >= 0 and a not in common)
            subs = 0
            for x in extra:                      # each extra row takes the closest missing row it is no farther than
                j = next((i for i, m in enumerate(missing) if x <= m * (1 + rtol) + 1e-7), None)
                if j is not None:
                    missing.pop(j)
                    subs += 1
            hits += len(common) + subs
        return hits / (len(exact_ids) * k)
    if exact_ids.shape[0] != approx_ids.shape[0]:
        raise KilnError(f"recall: {exact_ids.shape[0]} exact rows but {approx_ids.shape[0]} approximate rows")
    if min(exact_ids.shape[1], approx_ids.shape[1]) < k:
        raise KilnError(f"recall@{k} needs at least {k} results per query")
    e, a = exact_ids[:, :k], approx_ids[:, :k]
    if k == 1:
        return int((e[:, 0] == a[:, 0]).sum()) / len(e)
    hits = sum(len(np.intersect1d(er, ar[ar >= 0])) for er, ar in zip(e, a))
    return hits / (len(e) * k)


def search_latency(index, queries: np.ndarray, batch: int, runs: int, k: int = 10,
                   max_s: float | None = None) -> dict[str, float]:
    """Wall time per search call of `batch` queries, cycling through `queries`; p50/p99 in ms (and per query).
    `max_s` stops early (after at least 5 runs) once that much time has been spent: `runs` is the count made."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if len(q) < batch:
        q = np.resize(q, (batch, q.shape[1]))
    index.search(q[:batch], k)   # warm-up
    times = []
    for r in range(runs):
        s = (r * batch) % (len(q) - batch + 1)
        t0 = time.perf_counter()
        index.search(q[s:s + batch], k)
        times.append((time.perf_counter() - t0) * 1e3)
        if max_s is not None and r >= 4 and sum(times) > max_s * 1e3:
            break
    p50, p99 = np.percentile(times, [50, 99])
    return {"batch": batch, "runs": len(times), "p50_ms": float(p50), "p99_ms": float(p99),
            "p50_ms_per_query": float(p50) / batch}


def memory_bandwidth_gbps(mib: int = 256, repeats: int = 3) -> float:
    """Single-thread read bandwidth, GB/s: best of `repeats` sums over a float32 array far larger than L3."""
    a = np.ones(mib * 2 ** 20 // 4, np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def gemv_scan_ms(vectors: np.ndarray, queries: np.ndarray, runs: int = 20, max_s: float = 2.0) -> float:
    """p50 ms of a plain BLAS exact scan at batch 1 (‖x‖² − 2 x·q, argmin), one BLAS thread: the bandwidth
    bound's reference point beside faiss's IndexFlatL2 (which runs at about single-thread copy speed)."""
    from threadpoolctl import threadpool_limits

    x = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.einsum("ij,ij->i", x, x)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    times = []
    with threadpool_limits(1):
        for r in range(runs + 1):
            t0 = time.perf_counter()
            d = norms - 2 * (x @ q[r % len(q)])
            int(np.argmin(d))
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
            if r >= 5 and sum(times) > max_s * 1e3:
                break
    return float(np.median(times))


def scan_fraction(n: int, d: int, p50_ms: float, bw_gbps: float) -> float:
    """Achieved bandwidth of one exact scan of n×d float32 per query (at p50), as a fraction of `bw_gbps`."""
    return (n * d * 4 / (p50_ms / 1e3)) / (bw_gbps * 1e9)


def identity_gate(exact_ids: np.ndarray, approx_ids: np.ndarray, labels: np.ndarray, query_labels: np.ndarray,
                  exact_dist: np.ndarray | None = None, approx_dist: np.ndarray | None = None,
                  threshold: float | None = None) -> dict[str, float]:
    """Face-task agreement of an approximate index with exact search.

    top1_identity_agreement: the top-1's label (−1 for a distractor) is the same under both searches.
    top1_accuracy_exact / _approx: the top-1's label equals the query's true label.
    With distances (L2, not squared): decision_agreement compares open-set decisions (label if the top-1 is under
    `threshold`, else "unknown"), and accept_rate_* is the fraction of queries under the threshold.
    """
    labels, query_labels = np.asarray(labels), np.asarray(query_labels)
    le, la = labels[np.asarray(exact_ids)[:, 0]], labels[np.asarray(approx_ids)[:, 0]]
    out = {"top1_identity_agreement": float((le == la).mean()),
           "top1_accuracy_exact": float((le == query_labels).mean()),
           "top1_accuracy_approx": float((la == query_labels).mean()), "queries": int(len(le))}
    if exact_dist is not None and approx_dist is not None and threshold is not None:
        ae, aa = np.asarray(exact_dist)[:, 0] < threshold, np.asarray(approx_dist)[:, 0] < threshold
        de, da = np.where(ae, le, -2), np.where(aa, la, -2)
        out.update(decision_agreement=float((de == da).mean()), accept_rate_exact=float(ae.mean()),
                   accept_rate_approx=float(aa.mean()), threshold=float(threshold))
    return out
