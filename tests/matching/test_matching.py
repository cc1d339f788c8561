"""Matching: gallery generation (deterministic, bounded, realistic distances), FAISS index recall, the stage's own
choice and gates, and the stages' verifiable outputs. faiss is a required package: no skipping here."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import GateFailed, KilnError
from pipeline.matching import gallery as g
from pipeline.matching import index as ix
from pipeline.matching.spec import IndexSpec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real():
    """Golden dlib embeddings and labels when built; else a stand-in with the same shape of statistics."""
    emb = REPO / "artifacts" / "golden" / "embedder" / "embeddings.npy"
    if emb.is_file() and (REPO / "artifacts" / "data" / "golden").is_dir():
        from pipeline import paths
        from pipeline.data import load_set
        return np.load(emb), load_set(paths.data_set("golden", REPO)).labels.astype(np.int64)
    rng = np.random.default_rng(0)
    common = rng.standard_normal(128) * 0.12
    centres = common + rng.standard_normal((4, 128)) * 0.055
    labels = np.repeat(np.arange(4), 12)
    return (centres[labels] + rng.standard_normal((48, 128)) * 0.018).astype(np.float32), labels


@pytest.fixture(scope="module")
def dist(real):
    return g.fit_distribution(*real)


@pytest.fixture(scope="module")
def gallery10k(real, dist):
    return g.build_gallery(real[0], real[1], 10_000, dist, seed=7)


# ----------------------------------------------------------------------------------------------- recall, choice

def test_recall_known_answer():
    rng = np.random.default_rng(1)
    exact = np.stack([rng.permutation(1000)[:10] for _ in range(200)])
    approx = exact.copy()
    approx[:7, 0] = 5000 + np.arange(7)            # 7 top-1 misses
    approx[7:20, 9] = 6000 + np.arange(13)         # 13 more misses in the tail
    assert ix.recall_at_k(exact, approx, 1) == pytest.approx(193 / 200)
    assert ix.recall_at_k(exact, approx, 10) == pytest.approx(1 - 20 / 2000)
    # order inside the top-k does not matter for recall@k
    assert ix.recall_at_k(exact, approx[:, ::-1].copy(), 10) == pytest.approx(1 - 20 / 2000)


def _curve():
    return [{"index": "flat", "recall@1": 1.0, "recall@10": 1.0, "p50_ms_b1": 0.5, "bytes": 5_000_000},
            {"index": "hnsw:M=32,ef=64", "recall@1": 0.98, "recall@10": 0.97, "p50_ms_b1": 0.05, "bytes": 7_000_000},
            {"index": "sq8", "recall@1": 0.995, "recall@10": 0.9, "p50_ms_b1": 0.05, "bytes": 1_300_000},
            {"index": "ivf-pq", "recall@1": 0.90, "recall@10": 0.4, "p50_ms_b1": 0.02, "bytes": 400_000}]


def _targets(cfg, r1, r10):
    from dataclasses import replace

    return replace(cfg.matching, targets=replace(cfg.matching.targets, recall_at_1_min=r1, recall_at_10_min=r10))


def test_the_stage_chooses_the_cheapest_meeting_both_floors(cfg):
    from pipeline.matching import sweep

    assert sweep.choose(_curve(), _targets(cfg, 0.99, 0.85))["index"] == "sq8"   # ties on p50: fewer bytes
    assert sweep.choose(_curve(), _targets(cfg, 0.95, 0.95))["index"] == "hnsw:M=32,ef=64"
    assert sweep.choose(_curve(), _targets(cfg, 0.85, 0.3))["index"] == "ivf-pq"
    assert sweep.choose(_curve(), _targets(cfg, 1.0, 0.5))["index"] == "flat"
    assert sweep.choose(_curve(), _targets(cfg, 0.9, 0.99))["index"] == "flat"   # recall@10 decides


def test_too_strict_targets_fail_clearly(cfg):
    from pipeline.matching import sweep

    with pytest.raises(GateFailed, match=r"no index of the sweep reaches recall@1 >= 0.999 and recall@10 >= 0.5; "
                                         r"the best was sq8") as e:
        sweep.choose([r for r in _curve() if r["index"] != "flat"], _targets(cfg, 0.999, 0.5))
    assert "nprobe" in e.value.hint


def test_spec_parse():
    assert IndexSpec.parse("HNSW:m=16").name == "hnsw:M=16,ef=64"
    assert IndexSpec.parse("ivf-pq:nlist=64,nprobe=4").p == {"nlist": 64, "m": 16, "nbits": 8, "nprobe": 4}
    assert IndexSpec.parse("flat").name == "flat"
    assert IndexSpec.parse("ivf-flat:nlist=64,nprobe=4").build_key == IndexSpec.parse("ivf-flat:nlist=64").build_key
    for bad in ("annoy", "hnsw:K=3", "ivf-flat:nlist=x", "ivf-flat:nprobe=0"):
        with pytest.raises(KilnError):
            IndexSpec.parse(bad)


def test_identity_gate_and_scan_fraction():
    labels = np.array([0, 1, -1, -1])
    exact, approx = np.array([[0], [1], [2]]), np.array([[0], [2], [2]])
    gate = ix.identity_gate(exact, approx, labels, np.array([0, 1, 5]),
                            np.array([[0.3], [0.4], [0.7]]), np.array([[0.3], [0.65], [0.7]]), threshold=0.6)
    assert gate["top1_identity_agreement"] == pytest.approx(2 / 3)
    assert gate["top1_accuracy_exact"] == pytest.approx(2 / 3) and gate["top1_accuracy_approx"] == pytest.approx(1 / 3)
    assert gate["decision_agreement"] == pytest.approx(2 / 3)
    assert ix.scan_fraction(1_000_000, 128, 51.2, 10.0) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------- gallery

def test_distractors_deterministic_and_prefix_stable(dist):
    a, b = g.distractors(dist, 20_000, seed=3), g.distractors(dist, 20_000, seed=3)
    assert a.dtype == np.float32 and a.shape == (20_000, 128)
    assert np.array_equal(a, b)
    assert np.array_equal(g.distractors(dist, 5_000, seed=3), a[:5_000])
    assert not np.array_equal(g.distractors(dist, 100, seed=4), a[:100])


def test_gallery_hash_deterministic(real, dist, gallery10k):
    v, labels, h = gallery10k
    v2, labels2, h2 = g.build_gallery(real[0], real[1], 10_000, dist, seed=7)
    assert h == h2 and len(h) == 32
    assert g.build_gallery(real[0], real[1], 10_000, dist, seed=8)[2] != h
    assert (labels[:len(real[1])] == real[1]).all() and (labels[len(real[1]):] == -1).all()
    assert np.array_equal(v[:len(real[0])], real[0].astype(np.float32))
    with pytest.raises(KilnError, match="smaller than"):
        g.build_gallery(real[0], real[1], 10, dist, seed=7)


def test_distractors_memory_bounded(dist):
    def extra(n):
        tracemalloc.start()
        out = g.distractors(dist, n, seed=1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak - out.nbytes
    small, large = extra(2 * g.CHUNK), extra(6 * g.CHUNK)
    assert large < small + 2 * 2 ** 20           # temporaries do not grow with n
    assert large < 4 * g.CHUNK * 256 * 8         # a few chunk-sized float64 buffers at most


def test_distractors_look_like_strangers(real, dist):
    rep = g.distance_report(g.distractors(dist, 1500, seed=2), real[0], threshold=0.6)
    assert rep["distractor_pairs"]["frac_above_threshold"] > 0.95
    assert rep["distractor_to_enrolled"]["frac_above_threshold"] > 0.8
    assert 0.7 < rep["distractor_pairs"]["median"] < 1.1
    norms = np.linalg.norm(real[0], axis=1)
    assert norms.min() - 0.2 < rep["norms"]["median"] < norms.max() + 0.2   # not unit-normalised, like dlib


# ------------------------------------------------------------------------------------------------------ faiss

@pytest.fixture(scope="module")
def queries(gallery10k, dist):
    v, labels, _ = gallery10k
    ids = np.concatenate([np.arange(48), np.random.default_rng(9).choice(np.arange(48, len(v)), 452, replace=False)])
    return g.noisy_copies(v[ids], dist, seed=11), ids


@pytest.fixture(scope="module")
def exact(gallery10k, queries):
    return ix.search(ix.build("flat", gallery10k[0], threads=1).index, queries[0], 10)


def test_flat_is_exact(gallery10k, queries, exact):
    v = gallery10k[0].astype(np.float64)
    q = queries[0].astype(np.float64)
    d2 = (q * q).sum(1)[:, None] + (v * v).sum(1)[None] - 2 * q @ v.T
    brute = np.argsort(d2, 1)[:, :10]
    assert ix.recall_at_k(brute, exact[1], 1) == 1.0
    assert ix.recall_at_k(brute, exact[1], 10) == 1.0
    assert ix.recall_at_k(exact[1], exact[1], 10) == 1.0
    # enrolled-style queries find their source vector
    assert (exact[1][:, 0] == queries[1]).mean() > 0.95


def test_single_queries_take_the_scan_and_batches_blas_with_the_same_answers(gallery10k, queries, exact):
    """FAISS 1.15 compares its BLAS threshold with queries × dim: one query must take the SIMD scan (BLAS was 4x
    slower for it), a batch from BLAS_FROM_QUERIES queries BLAS — and both paths give the exact top-k."""
    import faiss

    built = ix.build("flat", gallery10k[0], threads=1)
    d = gallery10k[0].shape[1]
    assert faiss.cvar.distance_compute_blas_threshold == ix.BLAS_FROM_QUERIES * d
    q = queries[0][:16]
    one_by_one = np.concatenate([ix.search(built.index, q[i:i + 1], 10)[1] for i in range(len(q))])
    batched = ix.search(built.index, q, 10)[1]                     # 16 × d ≥ the threshold: BLAS
    assert ix.recall_at_k(one_by_one, batched, 10) == 1.0 and ix.recall_at_k(exact[1][:16], batched, 10) == 1.0


def test_hnsw_recall_on_10k(gallery10k, queries, exact):
    built = ix.build("hnsw:M=32,ef=128", gallery10k[0], threads=1)
    dist, ids = ix.search(built.index, queries[0], 10)
    assert ix.recall_at_k(exact[1], ids, 1) >= 0.99
    labels = gallery10k[1]
    gate = ix.identity_gate(exact[1], ids, labels, labels[queries[1]], exact[0], dist, threshold=0.6)
    assert gate["top1_identity_agreement"] >= 0.99 and gate["decision_agreement"] >= 0.99


def test_trained_index_deterministic(gallery10k):
    v = gallery10k[0][:5000]
    spec = "ivf-pq:nlist=32,m=16,nbits=6,nprobe=8"
    a, b = ix.build(spec, v, threads=1), ix.build(spec, v, threads=1)
    assert a.train_xxh3_128 == b.train_xxh3_128 and a.train_xxh3_128
    assert ix.serialize(a.index) == ix.serialize(b.index)                   # the bytes the stage ships
    assert ix.index_bytes(a.index) < v.nbytes / 4
    back = ix.deserialize(ix.serialize(a.index))
    assert np.array_equal(ix.search(back, v[:20], 5)[1], ix.search(a.index, v[:20], 5)[1])
    with pytest.raises(KilnError, match="cannot train"):
        ix.build("ivf-flat:nlist=64", v[:10], threads=1)


def test_latency_runs_are_bounded_by_count_and_time(gallery10k, queries):
    index = ix.build("sq8", gallery10k[0], threads=1).index
    assert ix.search_latency(index, queries[0], 4, 7)["runs"] == 7                       # the count asked for
    capped = ix.search_latency(index, queries[0], 4, 10_000, max_s=1e-6)
    assert capped["runs"] == 5                                                          # time cap: minimum 5 runs
    assert capped["batch"] == 4 and capped["p50_ms_per_query"] == pytest.approx(capped["p50_ms"] / 4)


def test_recall_counts_equidistant_results():
    """Duplicates: exact search lists one of two equal rows, the index the other: a hit, not a miss. A farther row
    never replaces a closer one, and the tie rule uses true distances (PQ estimates would flatter it)."""
    exact_ids, approx_ids = np.array([[3, 4], [5, 6]]), np.array([[4, 3], [7, 6]])
    exact_d, true_d = np.array([[0.2, 0.2], [0.1, 0.3]]), np.array([[0.2, 0.2], [0.3, 0.3]])
    assert ix.recall_at_k(exact_ids, approx_ids, 1) == pytest.approx(0.0)                    # by id: both miss
    assert ix.recall_at_k(exact_ids, approx_ids, 1, exact_d, true_d) == pytest.approx(0.5)   # row 0's top-1 ties
    # row 1: 6 is common; 7 (0.3) cannot stand in for the missed 5 (0.1): 3 of 4
    assert ix.recall_at_k(exact_ids, approx_ids, 2, exact_d, true_d) == pytest.approx(3 / 4)
    # 7 tied with the exact 2nd (6 at 0.3) and 6 missing instead of 5: 7 replaces 6
    assert ix.recall_at_k(np.array([[5, 6]]), np.array([[5, 7]]), 2, np.array([[0.1, 0.3]]),
                          np.array([[0.1, 0.3]])) == 1.0


# ------------------------------------------------------------------------------------- stages (gallery@, match@)

from dataclasses import replace  # noqa: E402

from pipeline.manifest import identity_digest, manifest_path, read_manifest, verify_manifest  # noqa: E402


@pytest.fixture(scope="module")
def stage_root(tmp_path_factory, request):
    """A root holding the golden set and golden embeddings (copied from the repository's build, else built)."""
    import shutil

    src = REPO
    if not ((REPO / "artifacts/golden/embedder/embeddings.npy").is_file()
            and (REPO / "artifacts/data/golden").is_dir()):
        src = request.getfixturevalue("built")
    root = tmp_path_factory.mktemp("matching")
    for rel in ("artifacts/golden/embedder", "artifacts/data/golden"):
        shutil.copytree(src / rel, root / rel)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    return root


def _mcfg(cfg, targets=None, **kw):
    m = cfg.matching
    base = dict(gallery_sizes=(5000,), queries=200, latency=replace(m.latency, runs_b1=20, runs_b64=3, max_seconds=0.2),
                sweep=("flat", "sq8", "ivf-flat:nlist={nlist},nprobe=4", "ivf-flat:nlist={nlist},nprobe=32"),
                max_size={})
    base.update(kw)
    if targets:
        base["targets"] = replace(m.targets, **targets)
    return cfg.replace(matching=replace(m, **base))


def test_match_stage_writes_a_verifiable_gated_index(cfg, stage_root):
    import json

    from pipeline import paths
    from pipeline.stages import gallery, match

    c = _mcfg(cfg)
    gal = gallery.run(c, 5000, stage_root)
    assert verify_manifest(manifest_path(gal.directory, "gallery-5000"), stage_root) == []
    r = match.run(c, 5000, stage_root, progress=lambda _: None)
    assert r.passed and r.chosen["recall@1"] >= c.matching.targets.recall_at_1_min
    assert r.chosen["recall@10"] >= c.matching.targets.recall_at_10_min
    mpath = manifest_path(paths.index(5000, stage_root), "gallery-5000")
    assert verify_manifest(mpath, stage_root) == []
    m = read_manifest(mpath)
    assert m["kind"] == "index" and m["build"]["spec"] == r.chosen["index"] and m["build"]["threads"] == 1
    assert m["toolchain"]["faiss-cpu"] != "absent" and m["results"]["chosen"] == r.chosen["index"]
    timed = ("p50_ms_b1", "p99_ms_b1", "p50_ms_b64", "build_s", "bandwidth", "curve")   # timings: not identity
    assert not any(k in json.dumps(m) for k in timed)
    vdir = paths.matching(5000, stage_root)
    gate = json.loads((vdir / "validation.json").read_text())
    assert gate["verdict"] == "pass" and gate["engine_manifest_xxh3_128"] == identity_digest(m)
    assert verify_manifest(manifest_path(vdir, "gallery-5000"), stage_root) == []     # the verdict is verifiable
    curve = json.loads(paths.curve(5000, stage_root).read_text())
    assert [row["index"] for row in curve if row["chosen"]] == [r.chosen["index"]]
    # identity gate, redone from the stored bytes: golden identities' top-1 exactly as through exact search
    index = ix.deserialize((mpath.parent / "index.faiss").read_bytes())
    vectors = np.load(gal.directory / "vectors.npy")
    labels = np.load(gal.directory / "labels.npy")
    q = g.noisy_copies(vectors[labels >= 0], json.loads((gal.directory / "distribution.json").read_text()), 5)
    exact = ix.search(ix.build("flat", vectors, threads=1).index, q, 1)[1][:, 0]
    assert np.array_equal(labels[ix.search(index, q, 1)[1][:, 0]], labels[exact])


def test_a_forced_choice_rebuilds_to_the_same_bytes(cfg, stage_root):
    """With one index in the sweep the choice cannot follow timings: two runs give byte-identical outputs."""
    from pipeline import paths
    from pipeline.stages import gallery, match

    c = _mcfg(cfg, sweep=("ivf-flat:nlist={nlist},nprobe=32",))
    if not (paths.gallery(5000, stage_root) / "vectors.npy").is_file():
        gallery.run(c, 5000, stage_root)
    mpath = manifest_path(paths.index(5000, stage_root), "gallery-5000")
    match.run(c, 5000, stage_root, progress=lambda _: None)
    first = (mpath.read_bytes(), (mpath.parent / "index.faiss").read_bytes())
    match.run(c, 5000, stage_root, progress=lambda _: None)
    assert (mpath.read_bytes(), (mpath.parent / "index.faiss").read_bytes()) == first


def test_too_strict_target_fails_the_stage(cfg, stage_root):
    import json

    from pipeline import paths
    from pipeline.stages import gallery, match

    c = _mcfg(cfg, sweep=("ivf-pq:nlist={nlist},m=8,nbits=4,nprobe=1", "ivf-flat:nlist={nlist},nprobe=1"),
              targets={"recall_at_1_min": 1.0, "recall_at_10_min": 0.999})
    if not (paths.gallery(5000, stage_root) / "vectors.npy").is_file():
        gallery.run(c, 5000, stage_root)
    with pytest.raises(GateFailed,
                       match=r"match@5000: no index of the sweep reaches recall@1 >= 1.0 .*the best was") as e:
        match.run(c, 5000, stage_root, progress=lambda _: None)
    assert "flat" in e.value.hint
    gate = json.loads((paths.matching(5000, stage_root) / "validation.json").read_text())
    assert gate["verdict"] == "fail" and gate["chosen"] is None


def test_identity_gate_rejects_a_disagreeing_index(cfg):
    from pipeline.matching import sweep

    labels = np.array([0, 1, 2, -1, -1])
    exact_ids, ids = np.array([[0], [1], [3], [4]]), np.array([[0], [2], [3], [3]])
    exact_d, d = np.array([[0.2], [0.3], [0.5], [0.7]]), np.array([[0.2], [0.5], [0.55], [0.65]])
    row = {"index": "x", **sweep.face_gate(exact_ids, exact_d, ids, d, labels, np.array([0, 1, 3, 4]), 2, 0.6)}
    assert row["golden_top1_agreement"] == 0.5 and row["decision_agreement"] == 0.75
    failures = sweep.gate(row, cfg.matching)
    assert any("golden_top1_agreement 0.5" in f for f in failures)


def test_matching_config_rejects_impossible_targets(tmp_path):
    import yaml

    from pipeline import config

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["matching"]["targets"]["recall_at_1_min"] = 1.01
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(KilnError, match=r"matching.targets.recall_at_1_min: .*less than or equal to 1") as e:
        config.load(tmp_path / "p.yaml")
    assert e.value.hint
    raw["matching"]["targets"]["recall_at_1_min"] = 0.99
    raw["matching"]["nlist_per_sqrt_n"] = 8.0          # 256 lists at 2000 vectors
    raw["matching"]["gallery_sizes"] = [2000]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(KilnError, match="training vectors"):
        config.load(tmp_path / "p.yaml")
