"""`kiln compare A B`: where two ONNX graphs of one model part ways, layer by layer, on the model's own golden feed.

A and B are ONNX files or artifact directories holding `model.onnx` (an export, a quantized QDQ model, an ort-cpu
engine); a directory's manifest is verified before its graph is run. Every float tensor produced in both graphs
under the same name is exposed as an output — an INT8 QDQ model keeps the names of the float tensors it quantizes,
so FP32 and INT8 line up through the Q/DQ pairs (what Polygraphy's layer-wise comparison and ONNX Runtime's
`qdq_loss_debug` do; neither streams, so this is written here). The exposed graphs run with ONNX Runtime's graph
optimizations off — a fusion may fold a node whose output is now exposed (a Relu into the QuantizeLinear after it
left the Conv's output under the Relu's name: cosine 0.84 at the first layer) — so those rows show the QDQ model's
*semantics*; the final outputs are compared a second time from the unmodified graphs, as the real kernels run them.

Per tensor, accumulated batch by batch (memory bounded by one batch, never the set):

* a tensor is read through its Q/DQ pair where its graph has one (`_through_qdq`): the value consumers see;
* cosine of the flattened tensors, max |Δ|, SNR = 10·log10(Σa² / Σ(a−b)²) in dB (∞ when equal);
* own SNR: the error this layer adds by itself. Relative error powers add, so with e = 10^(−SNR/10) the layer's
  own share is e(tensor) − max e(its inputs), the inputs being the nearest compared tensors it is computed from
  (walking A's graph back through tensors that are not compared; a graph input is exact); own SNR = −10·log10 of
  that share (300 dB when the layer adds nothing, e.g. a Relu that zeroes part of the error);
* depth: the position of its producer in A's node order (ONNX keeps nodes topologically sorted).

The first layer past the threshold (`min_snr_db`) in depth order is the first bad layer; the worst layers are those
with the lowest own SNR.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx

from pipeline.errors import KilnError
from pipeline.manifest import manifest_path, read_manifest, read_verified

EXACT_DB = 300.0          # SNR reported for identical tensors (JSON has no infinity)
_FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}


@dataclass(frozen=True)
class Layer:
    name: str
    op: str
    depth: int
    cosine: float
    max_abs: float
    snr_db: float
    own_snr_db: float      # the SNR of only the error this layer adds to its inputs' (lower = worse)


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    model: str | None
    samples: int
    min_snr_db: float
    layers: list[Layer]               # depth order
    outputs: list[Layer]              # the graphs' own outputs, from the unmodified graphs
    first_bad: Layer | None

    def worst(self, n: int = 10) -> list[Layer]:
        return sorted(self.layers, key=lambda r: (r.own_snr_db, r.depth))[:n]

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "model": self.model, "samples": self.samples,
                "min_snr_db": self.min_snr_db, "first_bad": asdict(self.first_bad) if self.first_bad else None,
                "worst": [asdict(r) for r in self.worst()], "outputs": [asdict(r) for r in self.outputs],
                "layers": [asdict(r) for r in self.layers]}


def resolve(spec: str | Path) -> tuple[Path, str | None]:
    """An ONNX file, or a directory holding model.onnx (its manifest verified first); with the model it belongs to
    when a manifest says so."""
    p = Path(spec)
    if p.is_dir():
        onnx_path = p / "model.onnx"
        if not onnx_path.is_file():
            raise KilnError(f"{p}: no model.onnx in this directory",
                            "pass an ONNX file, or an export / quantized / ort-cpu engine directory")
        m = manifest_path(p, p.name)
        if m.is_file():
            read_verified(m)
            return onnx_path, read_manifest(m).get("model")
        return onnx_path, None
    if not p.is_file():
        raise KilnError(f"{p}: no such file", "pass an ONNX file or an artifact directory")
    return p, None


class _Acc:
    """Streaming sums for one tensor pair."""

    def __init__(self) -> None:
        self.aa = self.bb = self.ab = self.ee = 0.0
        self.max_abs = 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        if a.shape != b.shape:
            raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        d = a - b
        self.aa += float(a @ a)
        self.bb += float(b @ b)
        self.ab += float(a @ b)
        self.ee += float(d @ d)
        if d.size:
            self.max_abs = max(self.max_abs, float(np.abs(d).max()))

    def cosine(self) -> float:
        if self.aa == 0.0 and self.bb == 0.0:
            return 1.0
        return self.ab / math.sqrt(self.aa * self.bb) if self.aa and self.bb else 0.0

    def snr_db(self) -> float:
        if self.ee == 0.0:
            return EXACT_DB
        if self.aa == 0.0:
            return -EXACT_DB
        return min(EXACT_DB, 10.0 * math.log10(self.aa / self.ee))


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 — shape inference is best effort here; types come from value_info if present
        return model


def _float_tensors(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Float tensors computed from the graph's inputs (a weight's DequantizeLinear output is a constant: left out)."""
    infos = {v.name: v for v in [*model.graph.value_info, *model.graph.output]}
    inits = {i.name for i in model.graph.initializer}
    live = {i.name for i in model.graph.input} - inits
    out = {}
    for node in model.graph.node:
        if not any(t in live for t in node.input):
            continue
        live.update(node.output)
        for t in node.output:
            vi = infos.get(t)
            if vi is not None and vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in _FLOAT:
                out[t] = vi
    return out


def _through_qdq(model: onnx.ModelProto) -> dict[str, str]:
    """tensor → the output of the DequantizeLinear fed by its QuantizeLinear: the value the next layers consume.

    ONNX Runtime's QDQ quantizer drops a Relu after a Conv (the u8 QuantizeLinear clamps at zero) and gives the Conv
    output the Relu's name, so the bare name holds the pre-Relu values; through the Q/DQ pair it holds what the FP32
    graph's tensor of that name holds, quantized."""
    q_of = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    dq_of = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return {t: dq_of[q] for t, q in q_of.items() if q in dq_of}


def _exposed(model: onnx.ModelProto, names: list[str], infos: dict[str, onnx.ValueInfoProto]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    for n in names:
        vi = onnx.ValueInfoProto()
        vi.name = n
        vi.type.tensor_type.elem_type = infos[n].type.tensor_type.elem_type   # shape left open: any batch
        m.graph.output.append(vi)
    return m


def _session(model: onnx.ModelProto, workdir: Path, name: str, threads: int, optimize: bool):
    import onnxruntime as ort

    path = workdir / f"{name}.onnx"
    onnx.save(model, str(path), save_as_external_data=model.ByteSize() > 1_800_000_000)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if not optimize:       # fusions (e.g. a Relu folded into its QuantizeLinear) would change what a name holds
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _ancestors(model: onnx.ModelProto, compared: set[str]) -> tuple[dict[str, list[str]], dict[str, tuple[int, str]]]:
    """For each compared tensor: the nearest compared tensors (or graph inputs) it is computed from, in A; and its
    producer's (depth, op type)."""
    producer = {}
    for i, node in enumerate(model.graph.node):
        for t in node.output:
            producer[t] = (i, node)
    inits = {i.name for i in model.graph.initializer}
    parents: dict[str, list[str]] = {}
    for t in compared:
        found, stack, seen = [], list(producer[t][1].input), set()
        while stack:
            x = stack.pop()
            if not x or x in seen or x in inits:
                continue
            seen.add(x)
            if x in compared or x not in producer:           # a compared tensor, or a graph input
                found.append(x)
            else:
                stack.extend(producer[x][1].input)
        parents[t] = sorted(found)
    return parents, {t: (producer[t][0], producer[t][1].op_type) for t in compared}


def compare(a_path: Path, b_path: Path, feeds: Iterable[dict[str, np.ndarray]], min_snr_db: float = 20.0,
            threads: int = 0, model: str | None = None) -> Comparison:
    """Run both graphs on every feed with their common float tensors exposed; see the module docstring."""
    a, b = _inferred(onnx.load(str(a_path))), _inferred(onnx.load(str(b_path)))
    fa, fb = _float_tensors(a), _float_tensors(b)
    outputs = [o.name for o in a.graph.output]
    if [o.name for o in b.graph.output] != outputs:
        raise KilnError(f"{b_path}: outputs {[o.name for o in b.graph.output]} differ from {a_path}'s {outputs}",
                        "compare two graphs of the same model")
    common = sorted(set(fa) & set(fb) - set(outputs))
    if not common:
        raise KilnError(f"{a_path} and {b_path} share no intermediate float tensor names",
                        "compare graphs of one model (an export and a QDQ model or engine made from it)")
    parents, where = _ancestors(a, set(common) | set(outputs))
    side = []                                            # per graph: the tensor read for each name, through Q/DQ
    for m, f in ((a, fa), (b, fb)):
        via = _through_qdq(m)
        f.update({via[t]: f[t] for t in common if t in via})
        side.append([via.get(t, t) for t in common])
    a_names, b_names = side
    accs = {t: _Acc() for t in common}
    finals = {t: _Acc() for t in outputs}
    samples = 0
    with tempfile.TemporaryDirectory(prefix="kiln-compare-") as tmp:
        work = Path(tmp)
        sa = _session(_exposed(a, a_names, fa), work, "a", threads, False)
        sb = _session(_exposed(b, b_names, fb), work, "b", threads, False)
        ra, rb = (_session(m, work, n, threads, True) for m, n in ((a, "a-real"), (b, "b-real")))
        for feed in feeds:
            samples += int(next(iter(feed.values())).shape[0])
            for t, x, y in zip(common, sa.run(a_names, feed), sb.run(b_names, feed)):
                accs[t].add(x, y)
            for t, x, y in zip(outputs, ra.run(outputs, feed), rb.run(outputs, feed)):
                finals[t].add(x, y)
    if samples == 0:
        raise KilnError("compare: the feed is empty", "check the golden set (kiln dataset golden)")
    snr = {t: acc.snr_db() for t, acc in {**accs, **finals}.items()}

    def rel(db: float) -> float:
        return 10.0 ** (-db / 10.0)

    def layer(t: str, acc: _Acc) -> Layer:
        inherited = max((rel(snr.get(p, EXACT_DB)) for p in parents[t]), default=rel(EXACT_DB))
        own = rel(snr[t]) - inherited
        own_db = EXACT_DB if own <= rel(EXACT_DB) else min(EXACT_DB, -10.0 * math.log10(own))
        depth, op = where[t]
        return Layer(t, op, depth, round(acc.cosine(), 7), float(f"{acc.max_abs:.6g}"), round(snr[t], 3),
                     round(own_db, 3))

    layers = sorted((layer(t, accs[t]) for t in common), key=lambda r: (r.depth, r.name))
    first_bad = next((r for r in layers if r.snr_db < min_snr_db), None)
    return Comparison(str(a_path), str(b_path), model, samples, min_snr_db, layers,
                      [layer(t, finals[t]) for t in outputs], first_bad)


def report(c: Comparison, top: int = 10) -> str:
    from pipeline import tables

    head = ["depth", "tensor", "op", "cosine", "max |Δ|", "SNR dB", "own SNR dB"]
    rows = lambda rs: [[r.depth, r.name, r.op, f"{r.cosine:.6f}", f"{r.max_abs:.4g}", f"{r.snr_db:.1f}",  # noqa: E731
                        f"{r.own_snr_db:.1f}"] for r in rs]
    lines = [f"compare: {c.a} vs {c.b} on {c.samples} samples; {len(c.layers)} intermediate tensors matched by name",
             "", "outputs (the unmodified graphs):", tables.markdown(head, rows(c.outputs)), "",
             f"worst {top} layers by the error they add themselves (own SNR):",
             tables.markdown(head, rows(c.worst(top))), ""]
    if c.first_bad:
        r = c.first_bad
        lines.append(f"first layer below {c.min_snr_db:g} dB SNR: {r.name} ({r.op}, depth {r.depth}): "
                     f"SNR {r.snr_db:.1f} dB, cosine {r.cosine:.6f}, own SNR {r.own_snr_db:.1f} dB")
    else:
        lines.append(f"no layer below {c.min_snr_db:g} dB SNR")
    return "\n".join(lines)
