"""Calibration maths shared by calibrate@, quantize@, `kiln mixed` and the INT8 scripts: ORT's pre-processing of
the graph that gets quantized, the tensors that need an activation range, and the streamed range computation.

Memory is bounded by `calibrate.batch`, never by the set size: an augmented copy of the graph exposes every tensor
that QDQ quantization needs a range for (float inputs and outputs of quantizable nodes, as ORT's own calibrators
select them), and ORT runs it batch by batch on the streamed feeds (pipeline/samples.py: chips `batch` at a time;
the detector nets' inputs captured photo by photo, R-/O-Net crops re-batched to `batch`, P-Net one pyramid level
per feed, since levels differ in size). Pass 1 keeps a running min/max per tensor; pass 2 (percentile and
entropy) adds every batch into a fixed `calibrate.bins`-bin histogram of |x| over [0, max |x|] from pass 1. Counts
add exactly, so the result does not depend on the batch size. ORT's calibrators are not used: their `collect_data`
keeps every batch's outputs until `compute_data`.

Methods — `calibrate.candidates`, every one computed from the same two passes:

* minmax — the observed min and max.
* percentile-<p> — threshold t at the p-th percentile of |x| (upper edge of the bin the percentile falls in);
  range [max(min, -t), min(max, t)], so a non-negative (post-ReLU) tensor gets [0, t], as ORT's percentile does.
* entropy — TensorRT's KL-divergence search (Migacz, GTC 2017): for every candidate i ≥ 128 bins, P = hist[:i] with
  the outliers folded into its last bin, Q = hist[:i] merged into 128 levels and spread back over P's non-zero bins;
  t = upper edge of the i that minimises KL(P‖Q). Same range rule as percentile. Implemented in closed form over all
  candidates at once (cumulative sums), so it costs milliseconds per tensor. Three deliberate details:
  - exact zeros are left out of the search (they quantize exactly; as a spike in bin 0 they force t ≤ amax/8 on every
    post-ReLU tensor);
  - where Q is 0 but P is not (outliers folded into an empty last bin), Q is floored at 1e-4 (the smoothing eps of
    MXNet's and ORT's implementations) instead of making that candidate infinite, which made thresholds jump
    between the bulk and the outliers from one random seed to the next;
  - no candidate may clip more than 0.1 % of a tensor's values (MAX_CLIPPED). KL(P‖Q) does not see clipping error
    when a tensor's mass sits away from zero: the embedder's global-average-pool output (all values in ~[0.4, 2.3])
    was clipped below 99.99 % of its values and the INT8 golden cosine collapsed (tests keep the guard honest).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path

import numpy as np
import onnx

from pipeline.config import CalibrateConfig
from pipeline.data import to_nchw
from pipeline.errors import KilnError
from pipeline.manifest import xxh3_128_hex

QUANTIZED_LEVELS = 128          # int8: 128 levels on each side of zero
SMOOTHING = 1e-4                # probability floor of Q where it is 0 but P is not (MXNet / ORT smoothing eps)
MAX_CLIPPED = 1e-3              # entropy never clips more than this share of a tensor's values (see module doc)
DIFFERS_REL = 0.01              # a range "differs" from min/max when an end moves by > 1 % of max |x|
PREPROCESS = "onnxruntime.quantization.shape_inference.quant_pre_process"
_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


# ---------------------------------------------------------------------------------------------- graph
def quantizable_op_types() -> list[str]:
    """The op types `quantize_static` quantizes by default (QDQ ∪ QLinear registries)."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QDQRegistry) | set(QLinearOpsRegistry))


def preprocess(src: Path, dest: Path) -> str:
    """`quant_pre_process` src → dest; returns dest's xxh3-128. Deterministic for one ONNX Runtime version.

    `quant_pre_process` logs and carries on when ORT's optimizer fails, so a failure is caught from its log here.
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    errors: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    log = logging.getLogger("onnxruntime.quantization.shape_inference")
    handler = _Catch()
    log.addHandler(handler)
    src, dest = Path(src).absolute(), Path(dest).absolute()
    here = os.getcwd()
    try:
        # in a scratch working directory: when ORT's symbolic shape inference gives up it saves its partial model
        # (sym_shape_infer_temp.onnx and external-data files) into the current directory
        with tempfile.TemporaryDirectory(prefix="kiln-preprocess-") as scratch:
            os.chdir(scratch)
            try:
                quant_pre_process(str(src), str(dest))
            except Exception as e:  # noqa: BLE001
                # it gives up on some graphs with symbolic spatial dims (YuNet's FPN Resize); ONNX's own shape
                # inference is then the one used, as quant_pre_process allows
                if "Incomplete symbolic shape inference" not in str(e):
                    raise
                quant_pre_process(str(src), str(dest), skip_symbolic_shape=True)
            finally:
                os.chdir(here)
    except Exception as e:  # noqa: BLE001 — any failure of the third-party pre-processor is a user-facing error
        raise KilnError(f"{src}: quantization pre-processing failed: {e.__class__.__name__}: {e}".splitlines()[0],
                        "check the export (kiln verify) and the ONNX Runtime install") from None
    finally:
        log.removeHandler(handler)
    if errors:
        raise KilnError(f"{src}: quantization pre-processing failed: {errors[0].splitlines()[0]}",
                        "ORT's optimizer rejected the graph; see the log above")
    return xxh3_128_hex(Path(dest).read_bytes())


def calibration_tensors(model: onnx.ModelProto, op_types: list[str] | None = None) -> list[str]:
    """Float, non-initializer inputs and outputs of quantizable nodes (ORT's `select_tensors_to_calibrate`)."""
    ops = set(op_types or quantizable_op_types())
    infos = {v.name: v for v in chain(model.graph.value_info, model.graph.output, model.graph.input)}
    inits = {i.name for i in model.graph.initializer}
    names = set()
    for node in model.graph.node:
        if node.op_type in ops:
            for t in chain(node.input, node.output):
                vi = infos.get(t)
                if (vi is not None and t not in inits and vi.type.HasField("tensor_type")
                        and vi.type.tensor_type.elem_type in _FLOAT_TYPES):
                    names.add(t)
    return sorted(names)


def augment(model: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    """A copy of `model` whose graph outputs are exactly `tensors` (in that order)."""
    aug = onnx.ModelProto()
    aug.CopyFrom(model)
    infos = {v.name: v for v in chain(model.graph.value_info, model.graph.output, model.graph.input)}
    del aug.graph.output[:]
    aug.graph.output.extend(infos[t] for t in tensors)
    return aug


def _batches(source, batch: int) -> Iterator[dict[str, np.ndarray]]:
    """Feeds to stream: uint8 chips (N, S, S, 3) converted `batch` at a time, or pre-batched model feeds
    (`pipeline.samples`, e.g. the inputs the detector's nets see), passed through one at a time."""
    if isinstance(source, np.ndarray):
        for i in range(0, len(source), batch):
            yield {"input": to_nchw(source[i:i + batch])}
    else:
        yield from source


# ---------------------------------------------------------------------------------------------- statistics
def collect_minmax(run_batch: Callable[[dict], list[np.ndarray]], chips, batch: int,
                   n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Running min and max per tensor, and the number of samples seen."""
    lo, hi, count = np.full(n, np.inf, np.float64), np.full(n, -np.inf, np.float64), 0
    for x in _batches(chips, batch):
        count += next(iter(x.values())).shape[0]
        for k, out in enumerate(run_batch(x)):
            if out.size:
                lo[k] = min(lo[k], float(out.min()))
                hi[k] = max(hi[k], float(out.max()))
    if not np.all(np.isfinite(lo) & np.isfinite(hi)):
        raise KilnError("calibration produced empty, NaN or infinite activations",
                        "check the calibration set and the exported model (kiln export)")
    return lo, hi, count


def collect_histograms(run_batch: Callable[[dict], list[np.ndarray]], chips, batch: int,
                       amax: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(tensors, bins) int64 counts of |x| over [0, amax] per tensor (bin b covers [b, b+1) · amax / bins), and the
    (tensors,) count of exact zeros among them (all in bin 0)."""
    hist, zeros = np.zeros((len(amax), bins), np.int64), np.zeros(len(amax), np.int64)
    scale = np.where(amax > 0, bins / np.where(amax > 0, amax, 1.0), 0.0).astype(np.float32)
    for x in _batches(chips, batch):
        for k, out in enumerate(run_batch(x)):
            a = np.abs(out.ravel())
            zeros[k] += a.size - np.count_nonzero(a)
            idx = (a * scale[k]).astype(np.int64)
            np.minimum(idx, bins - 1, out=idx)
            hist[k] += np.bincount(idx, minlength=bins)
    return hist, zeros


def percentile_threshold(hist: np.ndarray, amax: float, percentile: float) -> float:
    """|x| below which `percentile` % of the values lie (upper edge of that bin), from a [0, amax] histogram."""
    total = hist.sum()
    if total == 0 or amax <= 0:
        return float(amax)
    cdf = np.cumsum(hist) / total
    b = int(np.searchsorted(cdf, percentile / 100.0 - 1e-12))
    return float(min(amax, (min(b, len(hist) - 1) + 1) * amax / len(hist)))


def _xlogx(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return np.where(v > 0, v * np.log(np.where(v > 0, v, 1.0)), 0.0)


def entropy_divergences(hist: np.ndarray, levels: int = QUANTIZED_LEVELS, eps: float | None = SMOOTHING,
                        max_clipped: float | None = MAX_CLIPPED) -> np.ndarray:
    """KL(P‖Q) for every candidate i in [levels, bins] (index i − levels), TensorRT's construction.

    P_i = hist[:i] with the outliers sum(hist[i:]) added to its last bin; Q_i = hist[:i] merged into `levels` chunks
    of i // levels bins (the remainder joins the last chunk), each chunk's count spread evenly over the bins where
    P_i is non-zero. With Pj = Σ_chunk P, Qj = Σ_chunk hist, nj = non-zero bins of P in the chunk:
    KL = (Σ p log p − Σ_j Pj log(Qj / nj)) / ΣP − log ΣP + log Σ_{j: nj>0} Qj  over chunks with Qj > 0; a chunk with
    Qj = 0 < Pj (only the outlier bin) adds Pj/ΣP · log(Pj/ΣP / eps) (infinite when eps is None). Candidates that
    clip more than `max_clipped` of the values are infinite.
    """
    h = np.asarray(hist, np.float64)
    nbins = h.size
    cands = np.arange(levels, nbins + 1)                        # i: number of bins kept
    c_h = np.concatenate([[0.0], np.cumsum(h)])                 # Σ h[:k]
    c_nz = np.concatenate([[0], np.cumsum(h > 0)])              # non-zero bins in h[:k]
    c_hl = np.concatenate([[0.0], np.cumsum(_xlogx(h))])        # Σ h log h over h[:k]
    total = c_h[-1]
    outliers = total - c_h[cands]
    last = h[cands - 1]
    last_p = last + outliers
    s_plogp = c_hl[cands] - _xlogx(last) + _xlogx(last_p)       # Σ p log p (unnormalised)

    width = cands // levels                                     # (C,)
    j = np.arange(levels)
    start = j[None, :] * width[:, None]                         # (C, L)
    end = np.where(j[None, :] == levels - 1, cands[:, None], start + width[:, None])
    q = c_h[end] - c_h[start]                                   # Qj: chunk sums of hist[:i]
    nz = (c_nz[end] - c_nz[start]).astype(np.float64)           # non-zero bins of hist[:i] per chunk
    # P differs from hist[:i] only in its last bin (in the last chunk): outliers may make it non-zero.
    nz[:, -1] += (last == 0) & (last_p > 0)
    p = q.copy()
    p[:, -1] += outliers
    degenerate = (q == 0) & (p > 0)        # only the outlier bin is non-zero in P's last chunk: Q has no mass there
    normal = (p > 0) & ~degenerate
    with np.errstate(divide="ignore", invalid="ignore"):
        term = np.where(normal, p * np.log(np.where(q > 0, q, 1.0) / np.where(nz > 0, nz, 1.0)), 0.0).sum(1)
        zq = np.where(nz > 0, q, 0.0).sum(1)
        p_normal = np.where(normal, p, 0.0).sum(1)
        p_degen = np.where(degenerate, p, 0.0).sum(1)
        kl = (s_plogp - term + p_normal * np.log(zq) - p_degen * np.log(eps or 1.0)) / total - np.log(total)
    if not eps:
        kl[degenerate.any(1)] = np.inf
    kl[zq <= 0] = np.inf
    if max_clipped is not None:
        kl[outliers > max_clipped * total] = np.inf
    return kl


def entropy_threshold(hist: np.ndarray, amax: float, levels: int = QUANTIZED_LEVELS,
                      eps: float | None = SMOOTHING, max_clipped: float | None = MAX_CLIPPED) -> float:
    """|x| threshold minimising KL(P‖Q) over a [0, amax] histogram of |x| (upper edge of the kept bins)."""
    hist = np.asarray(hist)
    if hist.sum() == 0 or amax <= 0 or hist.size <= levels:
        return float(amax)
    kl = entropy_divergences(hist, levels, eps, max_clipped)
    if not np.isfinite(kl).any():
        return float(amax)
    i = levels + int(np.argmin(kl))
    return float(min(amax, i * amax / hist.size))


def threshold(method: str, hist: np.ndarray, zeros: int, amax: float) -> float:
    """The |x| threshold of candidate `method` (minmax | entropy | percentile-<p>) from a tensor's |x| histogram and
    its count of exact zeros."""
    if method.startswith("percentile-"):
        return percentile_threshold(hist, amax, float(method.partition("-")[2]))
    if method == "entropy":
        # Exact zeros (half of every post-ReLU tensor) are exact at any threshold, but as a spike in bin 0 they
        # would make every candidate wider than 128 bins look lossy (the spike smeared over a merged level).
        nonzero = np.array(hist, np.int64)
        nonzero[0] -= zeros
        return entropy_threshold(nonzero, amax)
    return amax


def clip_range(lo: float, hi: float, threshold: float) -> tuple[float, float]:
    return max(lo, -threshold), min(hi, threshold)


def differs(chosen: dict[str, dict[str, float]], minmax: dict[str, dict[str, float]], rel: float = DIFFERS_REL) -> int:
    """How many tensors' chosen range moves an end by more than `rel` of the tensor's max |x|."""
    count = 0
    for name, mm in minmax.items():
        scale = max(abs(mm["min"]), abs(mm["max"]))
        c = chosen[name]
        if scale > 0 and max(abs(c["min"] - mm["min"]), abs(c["max"] - mm["max"])) > rel * scale:
            count += 1
    return count

# ---------------------------------------------------------------------------------------------- core
def compute_ranges(model_path: Path, chips, ccfg: CalibrateConfig,
                   progress: Callable[[str], None] = print, label: str = "calibrate") -> tuple[dict, dict]:
    """Stream `chips` (uint8 chips or a sequence of feeds) through `model_path` (pre-processed)
    → ({"candidates": {method: ranges}, "minmax": ranges, "samples": n}, timings)."""
    from pipeline.portable import ort_session

    model = onnx.load(str(model_path))
    tensors = calibration_tensors(model)
    if not tensors:
        raise KilnError(f"{model_path}: no quantizable float tensors found", "is this a float ONNX model?")
    sess = ort_session(augment(model, tensors).SerializeToString())     # the same ranges on every x86-64 CPU
    del model

    def run_batch(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return sess.run(tensors, feed)

    histogram_methods = [m for m in ccfg.candidates if m != "minmax"]
    seconds = {}
    t0 = time.perf_counter()
    lo, hi, count = collect_minmax(run_batch, chips, ccfg.batch, len(tensors))
    seconds["minmax"] = round(time.perf_counter() - t0, 3)
    progress(f"{label}: pass 1/{2 if histogram_methods else 1} min/max: {len(tensors)} tensors × "
             f"{count} samples in {seconds['minmax']:.1f} s")
    minmax = {t: {"min": float(lo[k]), "max": float(hi[k])} for k, t in enumerate(tensors)}
    candidates = {"minmax": minmax} if "minmax" in ccfg.candidates else {}
    if histogram_methods:
        t0 = time.perf_counter()
        amax = np.maximum(np.abs(lo), np.abs(hi))
        hist, zeros = collect_histograms(run_batch, chips, ccfg.batch, amax, ccfg.bins)
        for method in histogram_methods:
            ranges = {}
            for k, t in enumerate(tensors):
                a, b = clip_range(float(lo[k]), float(hi[k]), threshold(method, hist[k], int(zeros[k]),
                                                                        float(amax[k])))
                ranges[t] = {"min": a, "max": b}
            candidates[method] = ranges
        seconds["histograms"] = round(time.perf_counter() - t0, 3)
        progress(f"{label}: pass 2/2 histograms ({ccfg.bins} bins) → {', '.join(histogram_methods)}: "
                 f"{len(tensors)} tensors × {count} samples in {seconds['histograms']:.1f} s")
    return {"candidates": {m: candidates[m] for m in ccfg.candidates}, "minmax": minmax, "samples": count}, seconds
