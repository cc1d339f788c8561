"""Matching speed/recall curve from ONE run: FAISS indexes on galleries of real enrolled + realistic distractors.

Usage:  .venv/bin/python bench/matching.py [SIZE ...] [--target 0.99] [--threads 2]   (default sizes 10000 100000)
1000000 works but takes minutes (HNSW build is single-threaded for determinism). Writes nothing; prints tables.
Recall is of each index's top-k against exact (flat) top-k on enrolled-style queries (noisy copies of gallery rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from pipeline.errors import KilnError
from pipeline.matching import gallery as g
from pipeline.matching import index as ix

N_QUERIES = 500


def sweep(n: int) -> list[tuple[str, list[dict]]]:
    """(build spec, search-time variants) per size; nlist ~ 4·sqrt(n) rounded to a power of two."""
    nlist = int(2 ** round(np.log2(4 * np.sqrt(n))))
    return [("flat", [{}]), ("sq8", [{}]),
            ("hnsw:M=32,ef=64", [{"ef": 64}, {"ef": 128}]),
            (f"ivf-flat:nlist={nlist},nprobe=8", [{"nprobe": 8}, {"nprobe": 32}]),
            (f"ivf-pq:nlist={nlist},m=16,nbits=8,nprobe=16", [{"nprobe": 16}, {"nprobe": 64}])]


def real_embeddings() -> tuple[np.ndarray, np.ndarray]:
    from pipeline import paths
    from pipeline.data import load_set
    emb = paths.golden("embedder") / "embeddings.npy"
    if not emb.is_file():
        raise KilnError(f"{emb} is missing", hint="build the golden embeddings first (dvc repro golden@embedder)")
    return np.load(emb), load_set(paths.data_set("golden")).labels.astype(np.int64)


def fmt_table(rows: list[dict]) -> str:
    head = ["index", "build s", "MB", "recall@1", "recall@10", "b1 p50 ms", "b1 p99 ms", "b64 p50 ms",
            "b64 p99 ms", "b64 ms/q"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['index']} | {r['build_s']:.2f} | {r['bytes'] / 1e6:.1f} | {r['recall@1']:.4f} | "
                     f"{r['recall@10']:.4f} | {r['p50_ms_b1']:.3f} | {r['p99_ms_b1']:.3f} | {r['p50_ms_b64']:.2f} | "
                     f"{r['p99_ms_b64']:.2f} | {r['p50_ms_b64'] / 64:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=int, default=[10_000, 100_000])
    ap.add_argument("--target", type=float, default=0.99, help="recall@1 target for the choice")
    ap.add_argument("--threads", type=int, default=ix.THREADS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if max(a.sizes) >= 1_000_000:
        print("warning: a 1M gallery takes minutes (single-threaded HNSW build) and ~1 GB per index",
              file=sys.stderr)
    ix.configure(a.threads)
    emb, labels = real_embeddings()
    dist = g.fit_distribution(emb, labels)
    bw = ix.memory_bandwidth_gbps()
    print(f"fit: {dist['fit']}")
    print(f"memory bandwidth (numpy float32 sum, 1 thread, best of 3, 256 MiB): {bw:.1f} GB/s")
    chosen = {}
    for n in a.sizes:
        t0 = time.perf_counter()
        vectors, glabels, h = g.build_gallery(emb, labels, n, dist, a.seed)
        rep = g.distance_report(vectors[len(emb):len(emb) + 1500], emb)
        rng = np.random.default_rng(a.seed + 1)
        qids = np.concatenate([np.arange(len(emb)), rng.choice(np.arange(len(emb), n), N_QUERIES - len(emb),
                                                               replace=False)])
        queries = g.noisy_copies(vectors[qids], dist, a.seed + 2)
        print(f"\n## gallery {n} (xxh3 {h}, built in {time.perf_counter() - t0:.1f} s)")
        for k in ("distractor_pairs", "distractor_to_enrolled"):
            r = rep[k]
            print(f"L2 {k}: p1 {r['p1']:.3f} p5 {r['p5']:.3f} median {r['median']:.3f} p95 {r['p95']:.3f}; "
                  f"{100 * r['frac_above_threshold']:.1f}% > 0.6")
        rows, exact = [], None
        for build_spec, variants in sweep(n):
            print(f"  building {build_spec} …", file=sys.stderr, flush=True)
            built = ix.build(build_spec, vectors, threads=a.threads)
            if exact is None:
                exact_d, exact = ix.search(built.index, queries, 10)
            for v in variants:
                sp = dataclasses.replace(built.spec, params=tuple((k, v.get(k, val)) for k, val in built.spec.params))
                ix.set_search_params(built.index, sp)
                row = ix.evaluate(dataclasses.replace(built, spec=sp), queries, exact)
                d, ids = ix.search(built.index, queries, 10)
                row["identity"] = ix.identity_gate(exact, ids, glabels, glabels[qids], exact_d, d)
                rows.append(row)
        print(fmt_table(rows))
        flat = rows[0]
        print(f"flat scan at batch 1: {n * 128 * 4 / flat['p50_ms_b1'] / 1e6:.1f} GB/s = "
              f"{100 * ix.scan_fraction(n, 128, flat['p50_ms_b1'], bw):.0f}% of measured bandwidth")
        worst = min(rows, key=lambda r: r["identity"]["top1_identity_agreement"])
        print(f"lowest identity top-1 agreement: {worst['index']} {worst['identity']['top1_identity_agreement']:.4f}")
        try:
            c = ix.choose(rows, a.target)
            chosen[n] = c["index"]
            print(f"chosen for recall@1 >= {a.target}: {c['index']} "
                  f"(b1 p50 {c['p50_ms_b1']:.3f} ms, {c['bytes'] / 1e6:.1f} MB, recall@1 {c['recall@1']:.4f})")
        except KilnError as e:
            chosen[n] = f"none ({e.message})"
            print(f"chosen: none — {e}")
    print("\nchosen per size: " + ", ".join(f"{n}: {c}" for n, c in chosen.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
