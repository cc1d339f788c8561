"""Galleries for the matching stage: real enrolled embeddings plus distractors that look like other people.

Distractors are drawn from a Gaussian fitted to real dlib embeddings: the real mean (dlib vectors share a large
common component, |mean| ≈ 1.35, and are not unit-normalised) and a covariance that is a shrinkage blend of the
low-rank empirical part (top principal directions) and the per-dimension diagonal. The few identities in the
golden set would otherwise squeeze every distractor into a 3-4 dimensional subspace, which flatters IVF/HNSW.
The total variance is scaled so two independent draws sit at the median distance of real different-person pairs
(E|x - y|² = 2 tr Σ), so distractors are mostly beyond the 0.6 verification threshold like real strangers.

Draws are made in fixed-size chunks, each from its own seed (seed, chunk index), so memory stays bounded, the
bytes do not depend on the machine, and a larger gallery extends a smaller one (same prefix).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from pipeline.errors import KilnError

MODEL = "embedder"           # the embedder whose golden embeddings are enrolled (its verify_threshold gates)
DIM = 128
CHUNK = 16384          # rows per draw; part of the output's identity (changing it changes the bytes)
DISTRACTOR = -1        # label of a distractor row
RANK = 16              # low-rank principal directions kept
SHRINK = 0.5           # weight of the diagonal in the covariance blend


def _pairwise(e: np.ndarray) -> np.ndarray:
    e = e.astype(np.float64)
    sq = np.sum(e * e, 1)
    return np.sqrt(np.maximum(sq[:, None] + sq[None] - 2 * e @ e.T, 0))


def fit_distribution(embeddings: np.ndarray, labels: np.ndarray | None = None, rank: int = RANK,
                     shrink: float = SHRINK) -> dict:
    """Mean + low-rank-plus-diagonal covariance of real embeddings (N, d), as plain lists (JSON-able).

    With `labels`, the scale is set from real different-person pair distances (between) and same-person ones
    (within, used by `noisy_copies`); without labels, from the data's own spread.
    """
    e = np.asarray(embeddings, dtype=np.float64)
    if e.ndim != 2 or len(e) < 3:
        raise KilnError(f"need at least 3 embeddings of shape (N, d) to fit a distribution, got {e.shape}",
                        hint="build the golden embeddings first (kiln golden embedder)")
    mu = e.mean(0)
    x = e - mu
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    r = int(min(rank, len(e) - 1, e.shape[1]))
    var_r = s[:r] ** 2 / (len(e) - 1)
    basis = vt[:r]
    diag_emp = x.var(0, ddof=1)
    resid = np.maximum(diag_emp - (basis ** 2 * var_r[:, None]).sum(0), 1e-3 * diag_emp.mean())
    # blend: (1 - shrink) * low-rank + shrink * diagonal(empirical)  (+ the residual keeps the low-rank part full rank)
    lowrank_var = (1 - shrink) * var_r
    diag = (1 - shrink) * resid + shrink * diag_emp
    d = _pairwise(e)
    iu = np.triu_indices(len(e), 1)
    stats = {"n": int(len(e)), "norm_mean": float(np.linalg.norm(e, axis=1).mean())}
    if labels is not None:
        labels = np.asarray(labels)
        same = (labels[:, None] == labels[None])[iu]
        target = float(np.median(d[iu][~same])) if (~same).any() else float(np.median(d[iu]))
        within = float(np.median(d[iu][same])) if same.any() else 0.5 * target
        stats.update(identities=int(len(np.unique(labels))), diff_pair_median=target, same_pair_median=within)
    else:
        target = float(np.median(d[iu]))
        within = 0.3 * target
        stats.update(pair_median=target)
    trace = lowrank_var.sum() + diag.sum()
    scale = target ** 2 / (2 * trace)
    return {"dim": int(e.shape[1]), "mean": mu.tolist(), "basis": basis.tolist(),
            "lowrank_var": (lowrank_var * scale).tolist(), "diag_var": (diag * scale).tolist(),
            "within_l2": within, "between_l2": target, "rank": r, "shrink": shrink, "fit": stats}


def iter_distractors(dist: dict, n: int, seed: int) -> Iterator[np.ndarray]:
    """float32 chunks of at most CHUNK rows; chunk i is drawn from seed (seed, i) alone."""
    mu = np.asarray(dist["mean"])
    a = np.asarray(dist["basis"]) * np.sqrt(np.asarray(dist["lowrank_var"]))[:, None]     # (r, d)
    sd = np.sqrt(np.asarray(dist["diag_var"]))
    for i, start in enumerate(range(0, n, CHUNK)):
        m = min(CHUNK, n - start)
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), i]))
        z = rng.standard_normal((CHUNK, len(a) + len(mu)))[:m]     # always draw a full chunk: prefix-stable
        yield (mu + z[:, :len(a)] @ a + z[:, len(a):] * sd).astype(np.float32)


def distractors(dist: dict, n: int, seed: int) -> np.ndarray:
    """(n, d) float32 distractor embeddings; deterministic in (dist, n, seed); temporaries bounded by CHUNK."""
    if n < 0:
        raise KilnError(f"distractor count must be >= 0, got {n}")
    out = np.empty((n, int(dist["dim"])), np.float32)
    for i, chunk in enumerate(iter_distractors(dist, n, seed)):
        out[i * CHUNK:i * CHUNK + len(chunk)] = chunk
    return out


def noisy_copies(vectors: np.ndarray, dist: dict, seed: int, scale: float = 1.0) -> np.ndarray:
    """Enrolled-style queries: each vector plus same-person noise whose typical L2 size is the real within-identity
    pair distance (times `scale`)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x9e3779b9]))
    v = np.asarray(vectors, dtype=np.float32)
    noise = rng.standard_normal(v.shape)
    noise *= scale * float(dist["within_l2"]) / np.sqrt(v.shape[1])
    return (v + noise).astype(np.float32)


def gallery_hash(vectors: np.ndarray, labels: np.ndarray) -> str:
    h = xxhash.xxh3_128()
    h.update(f"kiln-gallery:{vectors.shape[0]}x{vectors.shape[1]}:float32:int64\n".encode())
    h.update(np.ascontiguousarray(vectors, dtype=np.float32).tobytes())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    return h.hexdigest()


def build_gallery(enrolled: np.ndarray, enrolled_labels: np.ndarray, n_total: int, dist: dict,
                  seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Enrolled rows first (their labels), then n_total - len(enrolled) distractors (label -1); returns
    (vectors float32 (n_total, d), labels int64, xxh3-128 content hash of both)."""
    enrolled = np.asarray(enrolled, dtype=np.float32)
    enrolled_labels = np.asarray(enrolled_labels, dtype=np.int64)
    if len(enrolled) != len(enrolled_labels):
        raise KilnError(f"{len(enrolled)} enrolled embeddings but {len(enrolled_labels)} labels")
    if (enrolled_labels < 0).any():
        raise KilnError("enrolled labels must be >= 0 (-1 marks distractors)")
    if enrolled.ndim != 2 or enrolled.shape[1] != int(dist["dim"]):
        raise KilnError(f"enrolled embeddings have shape {enrolled.shape}, the distribution is {dist['dim']}-d")
    if n_total < len(enrolled):
        raise KilnError(f"gallery size {n_total} is smaller than the {len(enrolled)} enrolled embeddings",
                        hint="raise the gallery size")
    vectors = np.empty((n_total, enrolled.shape[1]), np.float32)
    vectors[:len(enrolled)] = enrolled
    k = len(enrolled)
    for i, chunk in enumerate(iter_distractors(dist, n_total - k, seed)):
        vectors[k + i * CHUNK:k + i * CHUNK + len(chunk)] = chunk
    labels = np.full(n_total, DISTRACTOR, np.int64)
    labels[:k] = enrolled_labels
    return vectors, labels, gallery_hash(vectors, labels)


def distance_report(sample: np.ndarray, enrolled: np.ndarray, threshold: float = 0.6) -> dict:
    """Distribution of pairwise L2 among distractors and from distractors to enrolled embeddings."""
    def summ(d: np.ndarray) -> dict:
        p = np.percentile(d, [1, 5, 50, 95])
        return {"p1": float(p[0]), "p5": float(p[1]), "median": float(p[2]), "p95": float(p[3]),
                "frac_above_threshold": float((d > threshold).mean())}
    s = np.asarray(sample, np.float64)
    iu = np.triu_indices(len(s), 1)
    e = np.asarray(enrolled, np.float64)
    cross = np.sqrt(np.maximum((s * s).sum(1)[:, None] + (e * e).sum(1)[None] - 2 * s @ e.T, 0)).ravel()
    return {"distractor_pairs": summ(_pairwise(s)[iu]), "distractor_to_enrolled": summ(cross),
            "norms": summ(np.linalg.norm(s, axis=1))}


def load(directory: Path, size: int, hint: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """A gallery@<size> output, verified against its manifest by the caller: vectors, labels, fitted distribution."""
    vectors = np.load(directory / "vectors.npy", allow_pickle=False)
    labels = np.load(directory / "labels.npy", allow_pickle=False)
    dist = json.loads((directory / "distribution.json").read_text(encoding="utf-8"))
    if len(vectors) != size:
        raise KilnError(f"{directory}: {len(vectors)} vectors, expected {size}", hint)
    return vectors, labels, dist
