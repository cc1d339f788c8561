"""Matching speed/recall curve from ONE run: FAISS indexes on galleries of real enrolled + realistic distractors.

Usage:  .venv/bin/python bench/matching.py [SIZE ...] [--target 0.99] [--threads 1]   (default: params.yaml sizes)
Same sweep, queries, measurement, choice and identity gate as the DVC stage match@<size> (pipeline/matching/
sweep.py, params.yaml `matching:`), on galleries built in memory; writes nothing, prints one table per size,
the memory bandwidth and the exact scan's achieved fraction of it. Recall is of each index's top-k against exact
(flat) top-k on enrolled-style queries (noisy copies of gallery rows, the golden identities first); a returned row
at the same true distance as the exact one counts (ties).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import numpy as np

from pipeline import config
from pipeline.errors import KilnError
from pipeline.matching import gallery as g
from pipeline.matching import sweep as st


def real_embeddings() -> tuple[np.ndarray, np.ndarray]:
    from pipeline import paths
    from pipeline.data import load_set
    emb = paths.golden(g.MODEL) / "embeddings.npy"
    if not emb.is_file():
        raise KilnError(f"{emb} is missing", hint="build the golden embeddings first (dvc repro golden@embedder)")
    return np.load(emb), load_set(paths.data_set("golden")).labels.astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=int, help="gallery sizes (default: params.yaml matching.gallery_sizes)")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--target", type=float, help="recall@1 floor (default: params.yaml)")
    ap.add_argument("--threads", type=int, help="FAISS threads (default: params.yaml, 1)")
    a = ap.parse_args(argv)
    cfg = config.load(a.params)
    m = cfg.matching
    sizes = tuple(a.sizes) or m.gallery_sizes
    m = replace(m, gallery_sizes=sizes, threads=a.threads or m.threads,
                targets=replace(m.targets, recall_at_1_min=a.target if a.target is not None
                                else m.targets.recall_at_1_min))
    threshold = cfg.model(g.MODEL).verify_threshold
    emb, labels = real_embeddings()
    dist = g.fit_distribution(emb, labels)
    print(f"fit: {dist['fit']}")
    t = m.targets
    print(f"targets: recall@1 >= {t.recall_at_1_min}, recall@10 >= {t.recall_at_10_min}; identity gate: golden "
          f"top-1 >= {t.golden_top1_agreement_min}, decisions >= {t.decision_agreement_min}; FAISS threads {m.threads}")
    chosen = {}
    for n in sizes:
        t0 = time.perf_counter()
        vectors, glabels, h = g.build_gallery(emb, labels, n, dist, m.seed)
        rep = g.distance_report(vectors[len(emb):len(emb) + 1500], emb, threshold)
        print(f"\n## gallery {n} (xxh3 {h}, built in {time.perf_counter() - t0:.1f} s)")
        for k in ("distractor_pairs", "distractor_to_enrolled"):
            r = rep[k]
            print(f"L2 {k}: p1 {r['p1']:.3f} p5 {r['p5']:.3f} median {r['median']:.3f} p95 {r['p95']:.3f}; "
                  f"{100 * r['frac_above_threshold']:.1f}% > {threshold}")
        t0 = time.perf_counter()
        ms = st.measure(vectors, glabels, dist, m, threshold)
        try:
            c = st.choose(ms.curve, m)
            c["chosen"] = True
            fails = st.gate(c, m)
            chosen[n] = f"{c['index']} (b1 p50 {c['p50_ms_b1']:.3f} ms, recall@1 {c['recall@1']:.4f}, " \
                        f"recall@10 {c['recall@10']:.4f}, {c['bytes'] / 1e6:.1f} MB)" + \
                        (f" FAILS the identity gate: {'; '.join(fails)}" if fails else "")
        except KilnError as e:
            chosen[n] = f"none ({e.message})"
        print(st.table(ms.curve))
        print(st.bandwidth_line(ms.bandwidth))
        print(f"chosen: {chosen[n]}   [sweep measured in {time.perf_counter() - t0:.1f} s]")
    print("\nchosen per size: " + "; ".join(f"{n}: {c}" for n, c in chosen.items()))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KilnError as e:
        print(f"bench/matching.py: error: {e}", file=sys.stderr)
        sys.exit(2)
