"""gallery@<size> and match@<size>: FAISS gallery indexes as artifacts, chosen by gallery size and recall target.

gallery@<size>  the golden embeddings enrolled (their identity labels) plus distractors drawn from a distribution
                fitted to them (pipeline/matching/gallery.py): vectors.npy, labels.npy, distribution.json, manifest.
match@<size>    builds every index of the sweep (params.yaml matching.sweep; one build per (kind, build params),
                nprobe / efSearch variants reuse it), measures the curve against exact search in ONE process —
                recall@1/@10, p50/p99 at batch 1 and 64, build time, bytes, and the memory bandwidth with the exact
                scan's achieved fraction of it — chooses the fastest index (batch-1 p50, then bytes) meeting both
                recall floors, gates it on the face task (golden identities' top-1 as under exact search; open-set
                decisions at the verification threshold on the distances it returns) and writes:
                  artifacts/index/gallery-<size>/   index.faiss + manifest (kind "index")       identity, DVC-cached
                  artifacts/matching/gallery-<size>/validation.json   the gate verdict        cache: false
                  artifacts/matching/gallery-<size>.curve.json        the whole curve (plot)  cache: false

Why one match@ stage per size and not index@<kind>-<size> + choose@<size>: the choice compares timings, and
timings from different processes at different moments on a shared machine are not comparable; the memory bandwidth
must be measured in the same run; every index needs the same exact baseline; and DVC would cache every candidate
index (≈ 1.2 GB at 1M) although only the chosen one ships. The cost: editing one sweep entry rebuilds that size.

Identity vs record (pipeline/manifest.py): the index bytes, its build parameters, the training-sample hash, the
thread count and the recall / gate numbers (pure functions of the inputs) are identity; every timing, the bandwidth
and the whole timed curve are `record`. The choice itself follows measured latency, so a forced rebuild on a
differently loaded machine can choose another index among near-equal ones; the manifest says which and why.
"""

from __future__ import annotations

import json
import platform
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline import paths, toolchain
from pipeline.config import Config, MatchingConfig
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import (atomic_dir, atomic_path, build_manifest, identity_digest, input_ref, manifest_path,
                               read_manifest, source_info, verify_manifest, write_json_atomic, write_manifest)
from pipeline.matching import gallery as g
from pipeline.matching import index as ix

MODEL = "embedder"           # the embedder whose golden embeddings are enrolled (its verify_threshold gates)
INDEX_FILE = "index.faiss"
VALIDATION_FILE = "validation.json"
K = 10
PRECISION = {"flat": "fp32", "hnsw": "fp32", "ivf-flat": "fp32", "sq8": "int8", "ivf-pq": "pq"}
_SEARCH_KEYS = {"hnsw": ("ef",), "ivf-flat": ("nprobe",), "ivf-pq": ("nprobe",)}


def index_name(size: int) -> str:
    return f"gallery-{size}"


def curve_path(size: int, root: Path = Path(".")) -> Path:
    return paths.matching(index_name(size), root).with_name(f"{index_name(size)}.curve.json")


def _mcfg(cfg: Config, size: int) -> MatchingConfig:
    m = getattr(cfg, "matching", None)
    if m is None:
        raise KilnError(f"{cfg.source}: no `matching:` section", "copy it from the repository's params.yaml")
    m.check_size(int(size))
    return m


def _save_npy(dest: Path, a: np.ndarray) -> None:
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, a, allow_pickle=False)


def _params_for_identity(cfg: Config, *keys: str) -> dict:
    """Only the matching keys a stage uses (adding a gallery size must not change another size's identity)."""
    section = cfg.section("matching")
    return {k: section.get(k) for k in keys}


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- gallery@<size>
@dataclass(frozen=True)
class GalleryResult:
    directory: Path
    size: int
    enrolled: int
    content_hash: str
    distances: dict


def gallery_run(cfg: Config, size: int, root: Path = Path(".")) -> GalleryResult:
    m = _mcfg(cfg, size)
    root = Path(root)
    from pipeline.data import load_set

    gdir, sdir = paths.golden(MODEL, root), paths.data_set("golden", root)
    emb_path = gdir / "embeddings.npy"
    if not emb_path.is_file():
        raise KilnError(f"{emb_path} is missing", f"build the golden embeddings first (dvc repro golden@{MODEL})")
    emb = np.load(emb_path, allow_pickle=False)
    labels = load_set(sdir).labels.astype(np.int64)
    if len(emb) != len(labels):
        raise KilnError(f"{emb_path}: {len(emb)} embeddings but the golden set has {len(labels)} labels",
                        f"rebuild them together (dvc repro golden@{MODEL})")
    dist = g.fit_distribution(emb, labels)
    vectors, glabels, digest = g.build_gallery(emb, labels, size, dist, m.seed)
    threshold = cfg.model(MODEL).verify_threshold or 0.6
    report = g.distance_report(vectors[len(emb):len(emb) + 1500], emb, threshold)
    out = paths.gallery(size, root)
    name = index_name(size)
    with atomic_dir(out) as d:
        _save_npy(d / "vectors.npy", vectors)
        _save_npy(d / "labels.npy", glabels)
        write_json_atomic(d / "distribution.json", dist)
        inputs = [input_ref("golden_embeddings", manifest_path(gdir, MODEL), root),
                  input_ref("golden_set", manifest_path(sdir, "golden"), root)]
        write_manifest(d, build_manifest(
            kind="gallery", name=name, model=MODEL, directory=d,
            files=[d / "vectors.npy", d / "labels.npy", d / "distribution.json"], inputs=inputs,
            toolchain=toolchain.describe("numpy"),
            build={"size": size, "enrolled": int(len(emb)), "seed": m.seed, "chunk": g.CHUNK, "rank": dist["rank"],
                   "shrink": dist["shrink"], "distractor_label": g.DISTRACTOR, "dtype": "float32"},
            source=source_info(root, _params_for_identity(cfg, "seed")),
            results={"gallery_xxh3_128": digest, "fit": dist["fit"], "distances": report}))
    return GalleryResult(out, size, int(len(emb)), digest, report)


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


def _build_key(sp: ix.IndexSpec) -> tuple:
    skip = _SEARCH_KEYS.get(sp.kind, ())
    return (sp.kind, tuple((k, v) for k, v in sp.params if k not in skip))


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
    ok = [r for r in curve if r["recall@1"] >= m.recall_at_1_min and r["recall@10"] >= m.recall_at_10_min]
    if not ok:
        best = max(curve, key=lambda r: (r["recall@1"], r["recall@10"]), default=None)
        got = (f"; the best was {best['index']} at recall@1 {best['recall@1']:.4f}, recall@10 {best['recall@10']:.4f}"
               if best else "")
        raise GateFailed(f"no index of the sweep reaches recall@1 >= {m.recall_at_1_min} and recall@10 >= "
                         f"{m.recall_at_10_min}{got}",
                         "add a more exhaustive index (flat, or a higher nprobe / ef) to matching.sweep, or lower "
                         "matching.targets")
    return min(ok, key=lambda r: (r["p50_ms_b1"], r["bytes"]))


def gate(row: dict, m: MatchingConfig) -> list[str]:
    checks = [("golden_top1_agreement", m.golden_top1_agreement_min), ("decision_agreement", m.decision_agreement_min)]
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

    ix.configure(m.threads)

    bw = ix.memory_bandwidth_gbps()
    progress(f"memory bandwidth {bw:.1f} GB/s (1 thread); exact baseline over {n} × {d}")
    exact = ix.build("flat", vectors, seed=m.seed, threads=m.threads)
    exact_d, exact_ids = ix.search(exact.index, queries, K)

    groups: dict[tuple, list[ix.IndexSpec]] = defaultdict(list)
    for sp in m.specs(size):
        groups[_build_key(sp)].append(sp)
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
            b1 = ix.search_latency(built.index, queries, 1, m.runs_b1, K, max_s=m.max_seconds)
            b64 = ix.search_latency(built.index, queries, 64, m.runs_b64, K, max_s=m.max_seconds)
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
        flat_ms = ix.search_latency(exact.index, queries, 1, m.runs_b1, K, max_s=m.max_seconds)["p50_ms"]
    gemv_ms = ix.gemv_scan_ms(vectors, queries, runs=m.runs_b64, max_s=m.max_seconds)
    scanned = n * d * 4
    bandwidth = {"read_gbps_1thread": round(bw, 3), "bytes_scanned_per_query": scanned,
                 "flat_p50_ms_b1": flat_ms, "flat_scan_gbps": scanned / flat_ms / 1e6,
                 "flat_scan_fraction": ix.scan_fraction(n, d, flat_ms, bw),
                 "gemv_p50_ms_b1": gemv_ms, "gemv_scan_gbps": scanned / gemv_ms / 1e6,
                 "gemv_scan_fraction": ix.scan_fraction(n, d, gemv_ms, bw)}
    for r in curve:
        r["chosen"] = False
    return Measured(curve, bandwidth, queries, qids, n_golden, built_by_key)


def match_run(cfg: Config, size: int, root: Path = Path("."), progress: Callable[[str], None] = _progress
              ) -> MatchResult:
    m = _mcfg(cfg, size)
    root = Path(root)
    name = index_name(size)
    threshold = cfg.model(MODEL).verify_threshold or 0.6
    gdir = paths.gallery(size, root)
    gman = manifest_path(gdir, name)
    if problems := verify_manifest(gman):
        raise KilnError(f"{gman}: gallery files do not match their manifest: " + "; ".join(problems),
                        f"rebuild it (dvc repro -f gallery@{size})")
    vectors = np.load(gdir / "vectors.npy", allow_pickle=False)
    labels = np.load(gdir / "labels.npy", allow_pickle=False)
    dist = json.loads((gdir / "distribution.json").read_text())
    if len(vectors) != size:
        raise KilnError(f"{gdir}: {len(vectors)} vectors, expected {size}", f"rebuild it (dvc repro -f gallery@{size})")
    ms = measure(vectors, labels, dist, m, threshold, progress)
    curve, bandwidth, queries, built_by_key = ms.curve, ms.bandwidth, ms.queries, ms.built
    targets = {"recall_at_1_min": m.recall_at_1_min, "recall_at_10_min": m.recall_at_10_min,
               "golden_top1_agreement_min": m.golden_top1_agreement_min,
               "decision_agreement_min": m.decision_agreement_min}

    def verdict(chosen: dict | None, failures: list[str], digest: str | None) -> None:
        metrics = {k: v for k, v in (chosen or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        metrics.update({k: v for k, v in bandwidth.items() if isinstance(v, float)})
        report = {"engine": name, "kind": "index", "verdict": "fail" if failures else "pass", "failures": failures,
                  "chosen": chosen["index"] if chosen else None, "metrics": metrics, "limits": targets,
                  "engine_manifest_xxh3_128": digest}
        with atomic_dir(paths.matching(name, root)) as out:
            write_json_atomic(out / VALIDATION_FILE, report)
        write_json_atomic(curve_path(size, root), curve)

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

    sp = ix.IndexSpec.parse(chosen["index"])
    built = built_by_key[_build_key(sp)]
    ix.set_search_params(built.index, sp)
    data = ix._faiss().serialize_index(built.index).tobytes()
    # the bytes must load back and answer exactly as the measured index did
    back = ix._faiss().deserialize_index(np.frombuffer(data, np.uint8))
    ix.set_search_params(back, sp)
    if not np.array_equal(ix.search(back, queries[:64], K)[1], ix.search(built.index, queries[:64], K)[1]):
        raise KilnError(f"match@{size}: the serialized {sp.name} answers differently after loading",
                        "report this FAISS behaviour; nothing was written")
    out = paths.index(name, root)
    deterministic = {k: chosen[k] for k in ("recall@1", "recall@10", "recall@1_by_id", "golden_top1_agreement",
                                            "golden_decision_agreement", "top1_identity_agreement",
                                            "decision_agreement", "accept_rate_exact", "accept_rate", "queries",
                                            "golden_queries", "threshold")}
    with atomic_dir(out) as dd:
        with atomic_path(dd / INDEX_FILE) as tmp:
            tmp.write_bytes(data)
        manifest = build_manifest(
            kind="index", name=name, model=MODEL, target="faiss-cpu", precision=PRECISION[sp.kind], directory=dd,
            files=[dd / INDEX_FILE], inputs=[input_ref("gallery", gman, root)],
            toolchain=toolchain.describe("faiss-cpu", "numpy"),
            build={"spec": sp.name, "kind": sp.kind, "params": sp.p, "metric": "L2", "threads": built.info["threads"],
                   "seed": built.info["seed"], "train_n": built.info["train_n"],
                   "train_ids_xxh3_128": built.train_ids_xxh3_128, "train_xxh3_128": built.train_xxh3_128,
                   "deterministic": True},
            source=source_info(root, _params_for_identity(cfg, "seed", "queries", "threads", "targets",
                                                          "nlist_per_sqrt_n", "max_size", "sweep", "latency")),
            results={"chosen": sp.name, **deterministic, "targets": targets,
                     "rule": "fastest batch-1 p50 (then fewest bytes) among indexes meeting both recall floors; "
                             "then the identity gate",
                     "recall": [{k: r[k] for k in ("index", "recall@1", "recall@10", "golden_top1_agreement",
                                                   "decision_agreement")} for r in curve]},
            record={"curve": curve, "bandwidth": bandwidth, "host": platform.node(),
                    "chosen_timing": {k: chosen[k] for k in ("p50_ms_b1", "p99_ms_b1", "p50_ms_b64", "p99_ms_b64",
                                                              "build_s")}})
        write_manifest(dd, manifest)
    verdict(chosen, [], identity_digest(manifest))
    return MatchResult(name, size, True, chosen, curve, bandwidth, [], out)


def table(curve: list[dict]) -> str:
    head = ["index", "build s", "MB", "recall@1", "recall@10", "b1 p50 ms", "b1 p99 ms", "b64 p50 ms", "b64 p99 ms",
            "b64 ms/q", "golden top-1", "decisions", ""]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in curve:
        lines.append(f"| {r['index']} | {r['build_s']:.2f} | {r['bytes'] / 1e6:.1f} | {r['recall@1']:.4f} | "
                     f"{r['recall@10']:.4f} | {r['p50_ms_b1']:.3f} | {r['p99_ms_b1']:.3f} | {r['p50_ms_b64']:.2f} | "
                     f"{r['p99_ms_b64']:.2f} | {r['p50_ms_per_query_b64']:.4f} | {r['golden_top1_agreement']:.3f} | "
                     f"{r['decision_agreement']:.4f} | {'**chosen**' if r.get('chosen') else ''} |")
    return "\n".join(lines)


def bandwidth_line(b: dict) -> str:
    return (f"memory bandwidth {b['read_gbps_1thread']:.1f} GB/s (numpy sum, 1 thread); exact scan of "
            f"{b['bytes_scanned_per_query'] / 1e6:.1f} MB per query: faiss Flat {b['flat_p50_ms_b1']:.3f} ms = "
            f"{b['flat_scan_gbps']:.1f} GB/s ({100 * b['flat_scan_fraction']:.0f}%), BLAS gemv "
            f"{b['gemv_p50_ms_b1']:.3f} ms = {b['gemv_scan_gbps']:.1f} GB/s ({100 * b['gemv_scan_fraction']:.0f}%)")
