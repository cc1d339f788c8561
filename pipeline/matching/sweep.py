"""The index sweep of one gallery, measured in one process, and the choice made on it.

The queries (noisy copies of every enrolled row, then of seeded distractor rows); every index of params.yaml
`matching.sweep` built and searched against exact search: recall@1/@10 (ties by true distance), p50/p99 at batch 1
and 64, build time, bytes, the memory bandwidth and the exact scan's achieved fraction of it; the choice (the
fastest index meeting both recall floors) and the identity gate on the face task (golden identities' top-1 as under
exact search, open-set decisions at the verification threshold). match@<size> (pipeline/stages/match.py) writes
the chosen index and its verdict; bench/matching.py prints the same curve for any size.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline import tables
from pipeline.config import MatchingConfig
from pipeline.errors import GateFailed, KilnError
from pipeline.matching import gallery as g
from pipeline.matching import index as ix
from pipeline.matching.spec import IndexSpec

K = 10
# The chosen row's numbers that are pure functions of the inputs (identity); every timing is the run's record.
DETERMINISTIC = ("recall@1", "recall@10", "recall@1_by_id", "golden_top1_agreement", "golden_decision_agreement",
                 "top1_identity_agreement", "decision_agreement", "accept_rate_exact", "accept_rate", "queries",
                 "golden_queries", "threshold")


def to_stderr(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def _queries(vectors: np.ndarray, labels: np.ndarray, dist: dict, m: MatchingConfig, size: int):
    """Noisy copies (same-person noise) of every enrolled row first, then of seeded distractor rows."""
    enrolled = np.flatnonzero(labels >= 0)
    n_q = max(m.queries, len(enrolled))
    rng = np.random.default_rng(np.random.SeedSequence([m.seed, size, 0x51]))
    others = np.flatnonzero(labels < 0)
    picked = np.sort(rng.choice(others, min(len(others), n_q - len(enrolled)), replace=False))
    qids = np.concatenate([enrolled, picked]).astype(np.int64)
    return qids, g.noisy_copies(vectors[qids], dist, m.seed + 2), len(enrolled)


def _true_distances(vectors: np.ndarray, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Exact L2 of each returned row (inf for -1): recall's tie rule must not trust PQ / SQ distance estimates."""
    rows = vectors[np.maximum(ids, 0)].astype(np.float64)
    d = np.sqrt(((rows - queries[:, None, :].astype(np.float64)) ** 2).sum(-1))
    return np.where(ids >= 0, d, np.inf)


def face_gate(exact_ids, exact_d, ids, d, labels, qids, n_golden, threshold) -> dict:
    """Identity gate of one index against exact search: golden queries' top-1 identity, all queries' decisions."""
    gold = ix.identity_gate(exact_ids[:n_golden], ids[:n_golden], labels, labels[qids[:n_golden]],
                            exact_d[:n_golden], d[:n_golden], threshold)
    everyone = ix.identity_gate(exact_ids, ids, labels, labels[qids], exact_d, d, threshold)
    return {"golden_top1_agreement": gold["top1_identity_agreement"],
            "golden_decision_agreement": gold["decision_agreement"],
            "top1_identity_agreement": everyone["top1_identity_agreement"],
            "decision_agreement": everyone["decision_agreement"],
            "accept_rate_exact": everyone["accept_rate_exact"], "accept_rate": everyone["accept_rate_approx"],
            "golden_queries": int(n_golden), "queries": int(len(qids)), "threshold": float(threshold)}


def choose(curve: list[dict], m: MatchingConfig) -> dict:
    """The fastest row (batch-1 p50, then bytes) with recall@1 and recall@10 at or above the floors."""
    t = m.targets
    ok = [r for r in curve if r["recall@1"] >= t.recall_at_1_min and r["recall@10"] >= t.recall_at_10_min]
    if not ok:
        best = max(curve, key=lambda r: (r["recall@1"], r["recall@10"]), default=None)
        got = (f"; the best was {best['index']} at recall@1 {best['recall@1']:.4f}, recall@10 {best['recall@10']:.4f}"
               if best else "")
        raise GateFailed(f"no index of the sweep reaches recall@1 >= {t.recall_at_1_min} and recall@10 >= "
                         f"{t.recall_at_10_min}{got}",
                         "add a more exhaustive index (flat, or a higher nprobe / ef) to matching.sweep, or lower "
                         "matching.targets")
    return min(ok, key=lambda r: (r["p50_ms_b1"], r["bytes"]))


def gate(row: dict, m: MatchingConfig) -> list[str]:
    checks = [("golden_top1_agreement", m.targets.golden_top1_agreement_min),
              ("decision_agreement", m.targets.decision_agreement_min)]
    return [f"{row['index']}: {k} {row[k]:.6g} (limit >= {lim:g})" for k, lim in checks if not row[k] >= lim]


@dataclass
class Measured:
    curve: list[dict]
    bandwidth: dict
    queries: np.ndarray
    qids: np.ndarray
    n_golden: int
    built: dict          # build key → ix.Built (kept in memory: the chosen one is serialized)


def measure(vectors: np.ndarray, labels: np.ndarray, dist: dict, m: MatchingConfig, threshold: float,
            progress: Callable[[str], None] = to_stderr) -> Measured:
    """The whole curve in one process: memory bandwidth, exact baseline, every index of the sweep at this size."""
    n, d = vectors.shape
    size = n
    qids, queries, n_golden = _queries(vectors, labels, dist, m, size)

    ix.configure(m.threads, d)

    bw = ix.memory_bandwidth_gbps()
    progress(f"memory bandwidth {bw:.1f} GB/s (1 thread); exact baseline over {n} × {d}")
    exact = ix.build("flat", vectors, seed=m.seed, threads=m.threads)
    exact_d, exact_ids = ix.search(exact.index, queries, K)

    groups: dict[tuple, list[IndexSpec]] = defaultdict(list)
    for sp in m.specs(size):
        groups[sp.build_key].append(sp)
    curve: list[dict] = []
    built_by_key: dict[tuple, ix.Built] = {}
    for key, variants in groups.items():
        if key == ("flat", ()):
            built = exact
        else:
            progress(f"building {variants[0].name} …")
            built = ix.build(variants[0], vectors, seed=m.seed, threads=m.threads)
        built_by_key[key] = built
        nbytes = ix.index_bytes(built.index)
        for sp in variants:
            ix.set_search_params(built.index, sp)
            dd, ids = ix.search(built.index, queries, K)
            true_d = _true_distances(vectors, queries, ids)
            b1 = ix.search_latency(built.index, queries, 1, m.latency.runs_b1, K, max_s=m.latency.max_seconds)
            b64 = ix.search_latency(built.index, queries, 64, m.latency.runs_b64, K, max_s=m.latency.max_seconds)
            row = {"index": sp.name, "kind": sp.kind, "build_s": round(built.build_s, 4), "bytes": nbytes,
                   "recall@1": ix.recall_at_k(exact_ids, ids, 1, exact_d, true_d),
                   "recall@10": ix.recall_at_k(exact_ids, ids, K, exact_d, true_d),
                   "recall@1_by_id": ix.recall_at_k(exact_ids, ids, 1),
                   "p50_ms_b1": b1["p50_ms"], "p99_ms_b1": b1["p99_ms"], "runs_b1": b1["runs"],
                   "p50_ms_b64": b64["p50_ms"], "p99_ms_b64": b64["p99_ms"], "runs_b64": b64["runs"],
                   "p50_ms_per_query_b64": b64["p50_ms_per_query"],
                   "train_xxh3_128": built.train_xxh3_128,
                   **face_gate(exact_ids, exact_d, ids, dd, labels, qids, n_golden, threshold)}
            curve.append(row)
            progress(f"{sp.name}: recall@1 {row['recall@1']:.4f} @10 {row['recall@10']:.4f}  b1 p50 "
                     f"{row['p50_ms_b1']:.3f} ms  b64 p50 {row['p50_ms_b64']:.2f} ms  {nbytes / 1e6:.1f} MB")

    flat_ms = next((r["p50_ms_b1"] for r in curve if r["index"] == "flat"), None)
    if flat_ms is None:
        flat_ms = ix.search_latency(exact.index, queries, 1, m.latency.runs_b1, K,
                                    max_s=m.latency.max_seconds)["p50_ms"]
    gemv_ms = ix.gemv_scan_ms(vectors, queries, runs=m.latency.runs_b64, max_s=m.latency.max_seconds)
    scanned = n * d * 4
    bandwidth = {"read_gbps_1thread": round(bw, 3), "bytes_scanned_per_query": scanned,
                 "flat_p50_ms_b1": flat_ms, "flat_scan_gbps": scanned / flat_ms / 1e6,
                 "flat_scan_fraction": ix.scan_fraction(n, d, flat_ms, bw),
                 "gemv_p50_ms_b1": gemv_ms, "gemv_scan_gbps": scanned / gemv_ms / 1e6,
                 "gemv_scan_fraction": ix.scan_fraction(n, d, gemv_ms, bw)}
    for r in curve:
        r["chosen"] = False
    return Measured(curve, bandwidth, queries, qids, n_golden, built_by_key)


def verdict(name: str, chosen: dict | None, failures: list[str], bandwidth: dict, limits: dict,
            index_digest: str | None) -> dict:
    """validation.json of match@<size>: pass / fail, the chosen row's numbers and the bandwidth, the limits."""
    metrics = {k: v for k, v in (chosen or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({k: v for k, v in bandwidth.items() if isinstance(v, float)})
    return {"engine": name, "kind": "index", "verdict": "fail" if failures else "pass", "failures": failures,
            "chosen": chosen["index"] if chosen else None, "metrics": metrics, "limits": limits,
            "engine_manifest_xxh3_128": index_digest}


def serialized(index, sp: IndexSpec, queries: np.ndarray, label: str) -> bytes:
    """The chosen index's bytes: they must load back and answer exactly as the measured index did."""
    ix.set_search_params(index, sp)
    data = ix.serialize(index)
    back = ix.deserialize(data)
    ix.set_search_params(back, sp)
    if not np.array_equal(ix.search(back, queries[:64], K)[1], ix.search(index, queries[:64], K)[1]):
        raise KilnError(f"{label}: the serialized {sp.name} answers differently after loading",
                        "report this FAISS behaviour; nothing was written")
    return data


def table(curve: list[dict]) -> str:
    head = ["index", "build s", "MB", "recall@1", "recall@10", "b1 p50 ms", "b1 p99 ms", "b64 p50 ms", "b64 p99 ms",
            "b64 ms/q", "golden top-1", "decisions", ""]
    rows = [[r["index"], f"{r['build_s']:.2f}", f"{r['bytes'] / 1e6:.1f}", f"{r['recall@1']:.4f}",
             f"{r['recall@10']:.4f}", f"{r['p50_ms_b1']:.3f}", f"{r['p99_ms_b1']:.3f}", f"{r['p50_ms_b64']:.2f}",
             f"{r['p99_ms_b64']:.2f}", f"{r['p50_ms_per_query_b64']:.4f}", f"{r['golden_top1_agreement']:.3f}",
             f"{r['decision_agreement']:.4f}", "**chosen**" if r.get("chosen") else ""] for r in curve]
    return tables.markdown(head, rows)


def bandwidth_line(b: dict) -> str:
    return (f"memory bandwidth {b['read_gbps_1thread']:.1f} GB/s (numpy sum, 1 thread); exact scan of "
            f"{b['bytes_scanned_per_query'] / 1e6:.1f} MB per query: faiss Flat {b['flat_p50_ms_b1']:.3f} ms = "
            f"{b['flat_scan_gbps']:.1f} GB/s ({100 * b['flat_scan_fraction']:.0f}%), BLAS gemv "
            f"{b['gemv_p50_ms_b1']:.3f} ms = {b['gemv_scan_gbps']:.1f} GB/s ({100 * b['gemv_scan_fraction']:.0f}%)")
