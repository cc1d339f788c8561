"""match@<size>: the FAISS gallery index of one gallery size (pipeline/stages/gallery.py), chosen by recall target.

match@<size>    builds every index of the sweep (params.yaml matching.sweep; one build per (kind, build params),
                nprobe / efSearch variants reuse it), measures the curve against exact search in ONE process —
                recall@1/@10, p50/p99 at batch 1 and 64, build time, bytes, and the memory bandwidth with the exact
                scan's achieved fraction of it — chooses the fastest index (batch-1 p50, then bytes) meeting both
                recall floors, gates it on the face task (golden identities' top-1 as under exact search; open-set
                decisions at the verification threshold on the distances it returns) and writes:
                  artifacts/index/gallery-<size>/   index.faiss + manifest (kind "index")         DVC-cached
                  artifacts/matching/gallery-<size>/  validation.json + manifest: the verdict  cache: false
                  artifacts/matching/gallery-<size>.curve.json        the whole curve (plot)  cache: false

Why one match@ stage per size and not index@<kind>-<size> + choose@<size>: the choice compares timings, and
timings from different processes at different moments on a shared machine are not comparable; the memory bandwidth
must be measured in the same run; every index needs the same exact baseline; and DVC would cache every candidate
index (≈ 1.2 GB at 1M) although only the chosen one ships. The cost: editing one sweep entry rebuilds that size.

Identity vs record (pipeline/manifest.py): the index bytes, its build parameters, the training-sample hash, the
thread count and the recall / gate numbers (pure functions of the inputs) are identity; every timing, the bandwidth
and the whole timed curve are the run's record (artifacts/records/, and the verdict and curve files, which are not
cached). The choice itself follows measured latency, so a rebuild on a differently loaded machine can choose
another index among near-equal ones; the manifest says which and why (README: what is not bit-reproducible).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline import paths, stage, tables
from pipeline.config import MatchingConfig
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import (atomic_dir, atomic_path, build_manifest, identity_digest, input_ref, manifest_path,
                               read_verified, write_json_atomic, write_manifest)
from pipeline.matching import gallery as g
from pipeline.matching import index as ix
from pipeline.matching.spec import IndexSpec
from pipeline.stages.gallery import MODEL

INDEX_FILE = "index.faiss"
K = 10
PRECISION = {"flat": "fp32", "hnsw": "fp32", "ivf-flat": "fp32", "sq8": "int8", "ivf-pq": "pq"}
# Only the matching keys match@ reads: adding a gallery size must not change another size's identity.
PARAMS = ("seed", "queries", "threads", "targets", "nlist_per_sqrt_n", "max_size", "sweep", "latency")

STAGE = stage.Stage(
    "match", "pipeline.stages.matching",
    "build the index sweep, measure recall/latency/bandwidth in one run, choose, gate on identities (exit 1)",
    keys=lambda cfg: [str(s) for s in cfg.matching.gallery_sizes],
    deps=lambda cfg, key: [paths.gallery(int(key)).as_posix()],
    params=lambda cfg, key: [*(f"matching.{k}" for k in PARAMS), f"models.{MODEL}.verify_threshold"],
    # all cached: register-index@ and `kiln registry sync` read the verdict on whichever host pulled it
    outs=lambda cfg, key: [stage.Out(paths.index(int(key)).as_posix()),
                           stage.Out(paths.matching(int(key)).as_posix()),
                           stage.Out(paths.curve(int(key)).as_posix(), kind="plots",
                                     plot={"x": "p50_ms_b1", "y": "recall@1",
                                           "title": f"gallery {key} — recall@1 vs batch-1 p50 (ms)"})])


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- match@<size>
@dataclass(frozen=True)
class MatchResult:
    name: str
    size: int
    passed: bool
    chosen: dict | None
    curve: list[dict]
    bandwidth: dict
    failures: list[str]
    directory: Path | None


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
            progress: Callable[[str], None] = _progress) -> Measured:
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


def match_run(cfg, size: int, root: Path = Path("."), progress: Callable[[str], None] = _progress) -> MatchResult:
    m = cfg.matching
    m.check_size(int(size))
    root = Path(root)
    name = paths.gallery_name(size)
    threshold = cfg.model(MODEL).verify_threshold
    gdir = paths.gallery(size, root)
    gman = manifest_path(gdir, name)
    read_verified(gman, hint=f"rebuild it (dvc repro -f {stage.address(f'gallery@{size}')})")
    vectors = np.load(gdir / "vectors.npy", allow_pickle=False)
    labels = np.load(gdir / "labels.npy", allow_pickle=False)
    dist = json.loads((gdir / "distribution.json").read_text())
    if len(vectors) != size:
        raise KilnError(f"{gdir}: {len(vectors)} vectors, expected {size}",
                        f"rebuild it (dvc repro -f {stage.address(f'gallery@{size}')})")
    ms = measure(vectors, labels, dist, m, threshold, progress)
    curve, bandwidth, queries, built_by_key = ms.curve, ms.bandwidth, ms.queries, ms.built
    targets = cfg.section("matching", "targets")
    index_dir = paths.index(size, root)

    def verdict(chosen: dict | None, failures: list[str], manifest_file: Path | None) -> None:
        """The verdict (validation.json + manifest, binding it to the index) and the curve: written either way."""
        metrics = {k: v for k, v in (chosen or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        metrics.update({k: v for k, v in bandwidth.items() if isinstance(v, float)})
        report = {"engine": name, "kind": "index", "verdict": "fail" if failures else "pass", "failures": failures,
                  "chosen": chosen["index"] if chosen else None, "metrics": metrics, "limits": targets,
                  "engine_manifest_xxh3_128": identity_digest(read_verified(manifest_file)) if manifest_file else None}
        with atomic_dir(paths.matching(size, root)) as out:
            write_json_atomic(out / paths.VALIDATION_FILE, report)
            write_manifest(out, build_manifest(
                kind="validation", name=name, model=MODEL, target="faiss-cpu", directory=out,
                files=[out / paths.VALIDATION_FILE],
                inputs=[input_ref("index", manifest_file, root)] if manifest_file else [input_ref("gallery", gman, root)],
                build={"gate": "recall floors + identity gate", "timings": "this run's record, not reproducible"},
                results={"verdict": report["verdict"], "failures": failures}, **STAGE.identity(cfg, str(size), root)))
        write_json_atomic(paths.curve(size, root), curve)

    try:
        chosen = choose(curve, m)
    except GateFailed as e:
        verdict(None, [e.message], None)
        raise GateFailed(f"match@{size}: {e.message}", e.hint) from None
    chosen["chosen"] = True
    if failures := gate(chosen, m):
        verdict(chosen, failures, None)
        raise GateFailed(f"match@{size}: identity gate: " + "; ".join(failures),
                         "the chosen index does not find the golden identities as exact search does; raise its "
                         "nprobe / ef in matching.sweep or raise the recall floors")

    sp = IndexSpec.parse(chosen["index"])
    built = built_by_key[sp.build_key]
    ix.set_search_params(built.index, sp)
    data = ix.serialize(built.index)
    # the bytes must load back and answer exactly as the measured index did
    back = ix.deserialize(data)
    ix.set_search_params(back, sp)
    if not np.array_equal(ix.search(back, queries[:64], K)[1], ix.search(built.index, queries[:64], K)[1]):
        raise KilnError(f"match@{size}: the serialized {sp.name} answers differently after loading",
                        "report this FAISS behaviour; nothing was written")
    deterministic = {k: chosen[k] for k in ("recall@1", "recall@10", "recall@1_by_id", "golden_top1_agreement",
                                            "golden_decision_agreement", "top1_identity_agreement",
                                            "decision_agreement", "accept_rate_exact", "accept_rate", "queries",
                                            "golden_queries", "threshold")}
    with atomic_dir(index_dir) as dd:
        with atomic_path(dd / INDEX_FILE) as tmp:
            tmp.write_bytes(data)
        write_manifest(dd, build_manifest(
            kind="index", name=name, model=MODEL, target="faiss-cpu", precision=PRECISION[sp.kind], directory=dd,
            files=[dd / INDEX_FILE], inputs=[input_ref("gallery", gman, root)],
            build={"spec": sp.name, "kind": sp.kind, "params": sp.p, "metric": "L2", "threads": built.info["threads"],
                   "seed": built.info["seed"], "train_n": built.info["train_n"],
                   "train_ids_xxh3_128": built.train_ids_xxh3_128, "train_xxh3_128": built.train_xxh3_128},
            results={"chosen": sp.name, **deterministic, "targets": targets,
                     "rule": "fastest batch-1 p50 (then fewest bytes) among indexes meeting both recall floors; "
                             "then the identity gate",
                     "recall": [{k: r[k] for k in ("index", "recall@1", "recall@10", "golden_top1_agreement",
                                                   "decision_agreement")} for r in curve]},
            **STAGE.identity(cfg, str(size), root)))
    verdict(chosen, [], manifest_path(index_dir, name))
    return MatchResult(name, size, True, chosen, curve, bandwidth, [], index_dir)


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


def main(argv: list[str] | None = None) -> int:
    import time

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        r = match_run(args.cfg, int(args.key))
        c = r.chosen
        run_.record.update(bandwidth=r.bandwidth, chosen_timing={k: c[k] for k in (
            "p50_ms_b1", "p99_ms_b1", "p50_ms_b64", "p99_ms_b64", "build_s")})
        print(table(r.curve))
        print(bandwidth_line(r.bandwidth))
        print(f"match@{args.key}: chose {c['index']} (recall@1 {c['recall@1']:.4f}, recall@10 {c['recall@10']:.4f}, "
              f"batch-1 p50 {c['p50_ms_b1']:.3f} ms, {c['bytes'] / 1e6:.1f} MB); identity gate PASS in "
              f"{time.perf_counter() - t0:.1f} s → {r.directory}")
        return 0

    return stage.main(STAGE, body, argv, key_help="gallery size from matching.gallery_sizes")


if __name__ == "__main__":
    sys.exit(main())
