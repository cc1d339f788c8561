"""A user's ONNX model → the FP32 graph every target compiles: verified, made runnable, weights folded, checked.

Pure functions on `onnx.ModelProto` (the import@<model> stage, pipeline/stages/import_.py, is the thin shell):

* `verify_source`  the file is a regular file with the sha256 pinned in params.yaml, every external-data file it
                   reads is pinned too (models.<m>.onnx.external), and it passes `onnx.checker`;
* `runnable`       structural fixes that change no value: drop graph inputs no node reads and that have no
                   initializer (ONNX Runtime refuses a graph whose declared inputs are not fed), unlist initializers
                   from the graph inputs (IR ≥ 4: they are constants, not overridable inputs — ORT will not fold
                   them otherwise), drop initializers nothing reads;
* `fold_weights`   evaluate, with ONNX's own reference implementation, every weight-only node whose inputs are
                   all constants (DequantizeLinear of int8 weights — block-quantized too —, Reshape, Transpose, Cast,
                   …): the FP32 weights the runtime would compute anyway, stored. Lossless by construction; a
                   quantized node that reads an activation is kept and reported;
* `fold_batchnorm` inference BatchNormalization folded into the Conv / Gemm beside it, inference Dropout removed
                   (float rounding only; the parity gate checks it);
* `dynamic_batch`  a batch fixed at 1 becomes a `batch` dim_param (value shapes re-inferred); a graph that hard-codes
                   its batch inside is caught by the parity run at the golden set's batch;
* `check_io`       the declared preprocessing (models.<m>.input_shape, in models.<m>.layout) and the role's outputs
                   match the graph, and it has no Loop; golden@ runs it (`check_source`) before the reference does;
* `channels_first` an NHWC model (layout: nhwc) gets a Transpose in front: every engine is fed NCHW;
* `rename_input`   the graph input is called `input`, as every feed of a chips model is.

The golden reference of an ONNX model (golden@<model>) is ONNX Runtime, graph optimizations off, on `runnable` of
the original file: the original's arithmetic, with nothing folded (an NHWC model is fed its feeds transposed).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from pipeline.errors import KilnError
from pipeline.userfiles import open_regular

if TYPE_CHECKING:
    from pipeline.config import ModelConfig
    from pipeline.roles.base import Role

# ops evaluated once at import when every input is a constant (weights): shape/format ops and weight dequantization
FOLDABLE = ("DequantizeLinear", "Reshape", "Transpose", "Cast", "Unsqueeze", "Squeeze", "Identity", "Flatten",
            "Concat")
QUANT_OPS = ("QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger",
             "DynamicQuantizeLinear")
MIN_OPSET = 13          # below this, per-channel QDQ (quantize@) is not expressible; older graphs are converted up


def hint_for(model: str) -> str:
    return f"fix models.{model}.onnx in params.yaml (path from the project root and the file's sha256)"


def _read_regular(path: Path, model: str, whole: bool, what: str = "ONNX file") -> tuple[bytes | None, str]:
    """(the bytes if `whole`, sha256) of a regular file. Opened without blocking and checked on the open file: a FIFO
    or device named like a model would otherwise hang the read (or never end)."""
    f = open_regular(path, hint_for(model), (f"{path}: {what} of model {model!r} not found",
                                             "run `kiln assets` if it is a pinned asset, or " + hint_for(model)))
    with f:
        h, chunks = hashlib.sha256(), []
        while chunk := f.read(1 << 24):
            h.update(chunk)
            if whole:
                chunks.append(chunk)
    return (b"".join(chunks) if whole else None), h.hexdigest()


def external_files(proto: onnx.ModelProto) -> list[str]:
    """The external-data locations the model's tensors name (the tensors onnx.load fills from other files)."""
    return sorted({Path(external_data_helper.ExternalDataInfo(t).location).as_posix()
                   for t in external_data_helper._get_all_tensors(proto)      # the loader's own walk
                   if external_data_helper.uses_external_data(t)})


def verify_source(path: Path, sha256: str, model: str, external: dict[str, str] | None = None) -> onnx.ModelProto:
    """The pinned file and every external-data file it reads (`external`: location → sha256), loaded and checked;
    every failure names the file and what to change. An external file the model reads but params.yaml does not pin
    is refused: its bytes are the model's weights, and a sha256 of model.onnx alone would not cover them."""
    data, actual = _read_regular(path, model, whole=True)
    if actual != sha256:
        raise KilnError(f"{path}: sha256 {actual} differs from models.{model}.onnx.sha256 {sha256}",
                        "the file is not the one pinned: restore it, or pin the new file's sha256 deliberately")
    external = {Path(k).as_posix(): v for k, v in (external or {}).items()}
    try:
        proto = onnx.load_model_from_string(data)
        reads = external_files(proto)
        for name in reads:
            if name.startswith("/") or ".." in Path(name).parts:
                raise KilnError(f"{path}: reads external data outside its folder ({name[:200]!r})",
                                "save the model with its external data beside it")
            if name not in external:
                raise KilnError(f"{path}: reads external data {name[:200]!r}, which models.{model}.onnx.external "
                                "does not pin", f"pin every file the model reads: models.{model}.onnx.external: "
                                                f"{{{name[:200]}: <its sha256>}}")
        for name in sorted(set(external) - set(reads)):
            raise KilnError(f"models.{model}.onnx.external pins {name!r}, which {path} does not read",
                            f"remove it from models.{model}.onnx.external")
        for name in reads:
            got = _read_regular(path.parent / name, model, whole=False, what="external-data file")[1]
            if got != external[name]:
                raise KilnError(f"{path.parent / name}: sha256 {got} differs from models.{model}.onnx.external"
                                f"[{name!r}] {external[name]}", "the model's external data is not the one pinned: "
                                "restore it, or pin the new file's sha256 deliberately")
        external_data_helper.load_external_data_for_model(proto, str(path.parent))
        onnx.checker.check_model(proto, full_check=True)
    except KilnError:
        raise
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise KilnError(f"{path}: not a valid ONNX model: {str(e).strip().splitlines()[0][:200]}",
                        "export the model again (onnx.checker must pass), or " + hint_for(model)) from None
    except Exception as e:   # a file that is not an ONNX protobuf at all
        first = (str(e).splitlines() or [""])[0][:200]
        raise KilnError(f"{path}: cannot be read as ONNX ({type(e).__name__}: {first})",
                        "point models.<name>.onnx.path at an .onnx file") from None
    return proto


def load_source(mcfg: ModelConfig, root: Path) -> onnx.ModelProto:
    """A model's ONNX source as params.yaml pins it (models.<m>.onnx: path, sha256, external)."""
    return verify_source(root / mcfg.onnx.path, mcfg.onnx.sha256, mcfg.name, mcfg.onnx.external)


def _read_names(g: onnx.GraphProto) -> set[str]:
    names = {o.name for o in g.output}
    for n in g.node:
        names.update(i for i in n.input if i)
        for a in n.attribute:        # subgraphs (If / Loop bodies) read outer names too
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names |= _read_names(sub)
    return names


def runnable(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """A copy that ONNX Runtime runs, with every value unchanged (see the module doc)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    read, inits = _read_names(g), {t.name for t in g.initializer}
    unfed = [i.name for i in g.input if i.name not in inits and i.name not in read]
    listed = [i.name for i in g.input if i.name in inits] if m.ir_version >= 4 else []
    keep = [i for i in g.input if i.name not in unfed and i.name not in listed]
    del g.input[:]
    g.input.extend(keep)
    unused = [t.name for t in g.initializer if t.name not in read]
    kept_inits = [t for t in g.initializer if t.name in read]
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    return m, {"dropped_unfed_inputs": len(unfed), "unlisted_initializer_inputs": len(listed),
               "dropped_unused_initializers": len(unused)}


def fold_weights(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Constant nodes of FOLDABLE ops evaluated by onnx.reference and stored as FP32 (or their own type) weights."""
    from onnx.reference import ReferenceEvaluator

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    nodes, folded = [], Counter()
    for n in g.node:
        ins = [i for i in n.input if i]
        if n.op_type in FOLDABLE and n.domain in ("", "ai.onnx") and ins and all(i in consts for i in ins):
            outs = ReferenceEvaluator(n).run(None, {i: consts[i] for i in ins})
            consts.update(zip(n.output, (np.asarray(o) for o in outs)))
            folded[n.op_type] += 1
        else:
            nodes.append(n)
    if not folded:
        return m, {"folded": {}, "kept_quantized": _quant_ops(g.node)}
    del g.node[:]
    g.node.extend(nodes)
    read = _read_names(g)
    del g.initializer[:]
    g.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in consts.items() if k in read)
    return m, {"folded": dict(sorted(folded.items())), "kept_quantized": _quant_ops(nodes)}


def _attr(node, name: str, default):
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else onnx.helper.get_attribute_value(a)


def fold_batchnorm(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Inference-time BatchNormalization folded into the Conv / Gemm next to it, and inference Dropout removed:
    what PyTorch's exporter does for its own models (the dlib embedder's graph has no BN), so that quantize@ sees
    Conv → activation, not Conv → BN → activation with a quantization point between. Values change only by float
    rounding (parity-gated by import@). Folded: Conv → BN, Gemm → BN, and BN → Flatten → Gemm (the BN of the
    last feature map, per input feature of the Gemm). A BN in any other place is kept (and still runs)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    shapes = {v.name: _dims(v) for v in [*g.value_info, *g.input, *g.output]}
    nodes = list(g.node)
    # Names an If / Loop body reads from this graph are kept like graph outputs: never renamed, folded away or swept
    # (consumers() and the sweep below look at this graph's own nodes only).
    outputs = {o.name for o in g.output} | {name for n in nodes for a in n.attribute
                                             for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)
                                             for name in _read_names(sub)}

    def consumers(name: str) -> list:
        return [n for n in nodes if name in n.input]

    def rename(old: str, new: str) -> None:
        for n in nodes:
            n.input[:] = [new if i == old else i for i in n.input]

    done = Counter()
    for n in list(nodes):       # inference Dropout: its output is its input (mask output unused)
        if n.op_type == "Dropout" and not _attr(n, "training_mode", 0) and \
                (len(n.input) < 3 or not n.input[2]) and (len(n.output) < 2 or not consumers(n.output[1])) and \
                n.output[0] not in outputs:
            nodes.remove(n)
            rename(n.output[0], n.input[0])
            done["Dropout removed"] += 1

    def bn_params(bn):
        if not all(i in consts for i in bn.input[1:5]):
            return None
        gamma, beta, mean, var = (consts[i].astype(np.float64) for i in bn.input[1:5])
        scale = gamma / np.sqrt(var + _attr(bn, "epsilon", 1e-5))
        return scale, beta - mean * scale

    def put(name: str, value: np.ndarray, like: str) -> str:
        new = f"{name}_bnfolded"
        consts[new] = value.astype(consts[like].dtype if like in consts else np.float32)
        return new

    for bn in [n for n in nodes if n.op_type == "BatchNormalization"]:
        p = bn_params(bn)
        src = next((n for n in nodes if bn.input[0] in n.output), None)
        if p is None or src is None or bn.input[0] in outputs or len(consumers(bn.input[0])) != 1:
            continue
        scale, shift = p
        if src.op_type == "Conv" and src.input[1] in consts:
            w = consts[src.input[1]].astype(np.float64)
            b = consts[src.input[2]].astype(np.float64) if len(src.input) > 2 and src.input[2] else 0.0
            wname = put(src.input[1], w * scale.reshape(-1, *([1] * (w.ndim - 1))), src.input[1])
            bname = put(src.input[1] + "_bias", (b - 0.0) * scale + shift, src.input[1])
            src.input[:] = [src.input[0], wname, bname]
        elif src.op_type == "Gemm" and src.input[1] in consts and not _attr(src, "transA", 0) and \
                (len(src.input) < 3 or not src.input[2] or src.input[2] in consts):
            w = consts[src.input[1]].astype(np.float64)               # (K, N), or (N, K) with transB
            trans = bool(_attr(src, "transB", 0))
            alpha, beta = _attr(src, "alpha", 1.0), _attr(src, "beta", 1.0)
            c = consts[src.input[2]].astype(np.float64) * beta if len(src.input) > 2 and src.input[2] else 0.0
            w2 = (w * scale[:, None] if trans else w * scale[None, :]) * alpha
            c2 = np.broadcast_to(c, scale.shape) * scale + shift
            src.input[:] = [src.input[0], put(src.input[1], w2, src.input[1]), put(src.input[1] + "_bias", c2,
                                                                                    src.input[1])]
            for a in list(src.attribute):
                if a.name in ("alpha", "beta"):
                    src.attribute.remove(a)
        else:
            continue
        src.output[:] = [bn.output[0]]
        nodes.remove(bn)
        done[f"BatchNormalization→{src.op_type}"] += 1

    for bn in [n for n in nodes if n.op_type == "BatchNormalization"]:   # BN → Flatten → Gemm: forward
        p = bn_params(bn)
        flat = consumers(bn.output[0])
        if p is None or len(flat) != 1 or flat[0].op_type != "Flatten" or _attr(flat[0], "axis", 1) != 1 or \
                bn.output[0] in outputs:
            continue
        gemms = consumers(flat[0].output[0])
        dims = shapes.get(bn.input[0], [])
        if len(gemms) != 1 or gemms[0].op_type != "Gemm" or gemms[0].input[0] != flat[0].output[0] or \
                _attr(gemms[0], "transA", 0) or gemms[0].input[1] not in consts or \
                not all(isinstance(d, int) and d > 0 for d in dims[1:]) or flat[0].output[0] in outputs:
            continue
        gm, (scale, shift) = gemms[0], p
        spatial = int(np.prod(dims[2:])) if len(dims) > 2 else 1
        s_in, t_in = np.repeat(scale, spatial), np.repeat(shift, spatial)     # per flattened input feature
        w = consts[gm.input[1]].astype(np.float64)
        trans = bool(_attr(gm, "transB", 0))
        wk = w.T if trans else w                                              # (K, N)
        if wk.shape[0] != s_in.size:
            continue
        beta = _attr(gm, "beta", 1.0)
        c = consts[gm.input[2]].astype(np.float64) * beta if len(gm.input) > 2 and gm.input[2] else 0.0
        alpha = _attr(gm, "alpha", 1.0)
        w2 = wk * s_in[:, None]
        c2 = np.broadcast_to(c, (wk.shape[1],)) + alpha * (t_in @ wk)
        gm.input[:] = [gm.input[0], put(gm.input[1], (w2.T if trans else w2), gm.input[1]),
                       put(gm.input[1] + "_bias", c2, gm.input[1])]
        for a in list(gm.attribute):
            if a.name == "beta":
                gm.attribute.remove(a)
        flat[0].input[0] = bn.input[0]
        nodes.remove(bn)
        done["BatchNormalization→next Gemm"] += 1
    if not done:
        return m, {"batchnorm_folded": {}}
    while True:                 # nodes whose outputs nothing reads any more (a removed Dropout's ratio Constant)
        read = {i for n in nodes for i in n.input} | outputs
        dead = [n for n in nodes if not any(o in read for o in n.output if o)]
        if not dead:
            break
        for n in dead:
            nodes.remove(n)
    del g.node[:]
    g.node.extend(nodes)
    read = _read_names(g)
    del g.initializer[:]
    g.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in consts.items() if k in read)
    del g.value_info[:]
    return m, {"batchnorm_folded": dict(sorted(done.items()))}


def _quant_ops(nodes) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in nodes if n.op_type in QUANT_OPS).items()))


def opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def normalize_opset(proto: onnx.ModelProto, model: str) -> tuple[onnx.ModelProto, dict]:
    """Graphs below MIN_OPSET are converted up (ONNX's version converter); newer ones are kept as they are."""
    before = opset(proto)
    if before >= MIN_OPSET:
        return proto, {"opset": before}
    from onnx import version_converter

    try:
        out = version_converter.convert_version(proto, MIN_OPSET)
    except Exception as e:
        raise KilnError(f"models.{model}: opset {before} cannot be converted to {MIN_OPSET} "
                        f"({str(e).splitlines()[0][:200]})", "export the model at opset ≥ 13") from None
    return out, {"opset": MIN_OPSET, "converted_from_opset": before}


def dynamic_batch(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Axis 0 of every graph input and output becomes `batch` (it was fixed at 1 or already symbolic)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    changed = []
    for v in [*m.graph.input, *m.graph.output]:
        dims = v.type.tensor_type.shape.dim
        if not dims:
            continue
        d0 = dims[0]
        if d0.dim_param:
            continue
        if d0.dim_value not in (0, 1):
            raise KilnError(f"graph {v.name!r} has a fixed batch of {d0.dim_value}",
                            "export the model with a batch of 1 or a symbolic batch")
        d0.ClearField("dim_value")
        d0.dim_param = "batch"
        changed.append(v.name)
    del m.graph.value_info[:]           # recorded with the old batch: re-inferred
    return m, {"batch_made_dynamic": changed}


def open_axes(proto: onnx.ModelProto, axes) -> tuple[onnx.ModelProto, dict]:
    """The input axes models.<m>.dynamic declares beyond the batch (a whole-photo detector's height and width)
    become symbolic where the file fixes them; every output's shape beyond the batch is then re-inferred. Changes no
    value: a graph that hard-codes the size inside fails shape inference or the parity run, one clear error."""
    axes = sorted(a for a in axes if a > 0)
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    if not axes or len(m.graph.input) != 1:
        return m, {}
    dims = m.graph.input[0].type.tensor_type.shape.dim
    opened = []
    for a in axes:
        if a < len(dims) and not dims[a].dim_param:
            dims[a].ClearField("dim_value")
            dims[a].dim_param = f"input_{a}"
            opened.append(a)
    if not opened:
        return m, {}
    for o in m.graph.output:
        for d in list(o.type.tensor_type.shape.dim)[1:]:
            d.ClearField("dim_value")
            d.ClearField("dim_param")
    del m.graph.value_info[:]
    return m, {"input_axes_made_dynamic": opened}


def rename_input(proto: onnx.ModelProto, name: str = "input") -> tuple[onnx.ModelProto, dict]:
    """The one graph input renamed to `name`, the name every feed of a chips model uses (pipeline/samples.py)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    if len(g.input) != 1 or g.input[0].name == name:
        return m, {}
    old = g.input[0].name
    if name in _read_names(g) or any(t.name == name for t in g.initializer):
        raise KilnError(f"graph already has a tensor named {name!r}", "rename it in the model")
    g.input[0].name = name

    def sub(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            n.input[:] = [name if i == old else i for i in n.input]
            for a in n.attribute:
                for s in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    sub(s)
        for o in graph.output:
            if o.name == old:
                raise KilnError(f"graph input {old!r} is also an output", "import a graph that computes something")

    sub(g)
    return m, {"input_renamed_from": old}


def infer(proto: onnx.ModelProto, model: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    except onnx.shape_inference.InferenceError as e:
        raise KilnError(f"models.{model}: shape inference fails on the imported graph: {str(e).splitlines()[0]}",
                        "the graph's shapes are inconsistent; check the file with onnx.shape_inference") from None


def _dims(v) -> list:
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]


def _fmt(dims: list) -> str:
    return "×".join(["N", *(str(d) if isinstance(d, int) and d else str(d or "?") for d in dims[1:])])


def _fits(dims: list, want: list) -> bool:
    return len(dims) == len(want) and all(not (isinstance(d, int) and d) or d == w for d, w in zip(dims, want))


def _loops(g: onnx.GraphProto) -> list[str]:
    out = []
    for n in g.node:
        if n.op_type == "Loop" and n.domain in ("", "ai.onnx"):
            out.append(n.name or n.output[0])
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                out += _loops(sub)
    return out


def check_io(proto: onnx.ModelProto, mcfg: ModelConfig, source: str, role: Role, layout: str | None = None) -> dict:
    """The graph's one input matches models.<m>.input_shape (channels first; channels last when `layout` — by default
    models.<m>.layout — is nhwc), its outputs `role` (the model's, pipeline/roles/: the caller's, so this module
    never loads roles), and it has no Loop; else one clear error."""
    g, name = proto.graph, mcfg.name
    layout = layout or mcfg.layout
    loops = _loops(g)
    if loops:   # If runs one branch and Scan as many steps as its input is long; a Loop runs as long as it says
        raise KilnError(f"{source}: model {name!r} has a Loop ({loops[0][:100]}): its trip count and condition are "
                        "values in the graph (2^62 runs for ever), so no run of it has a bound Kiln can check",
                        "export the model with the loop unrolled (Kiln's embedders and detectors are feed-forward)")
    if len(g.input) != 1:
        raise KilnError(f"{source}: model {name!r} has {len(g.input)} inputs ({', '.join(i.name for i in g.input)}); "
                        "an imported model takes one (the chip or photo batch)", "import a single-input graph")
    dims = _dims(g.input[0])
    chw = list(mcfg.input_shape)
    hwc = [*chw[1:], chw[0]] if len(chw) == 3 else chw
    want = hwc if layout == "nhwc" else chw
    if not _fits(dims[1:], want):
        if layout == "nchw" and len(chw) == 3 and _fits(dims[1:], hwc):
            raise KilnError(f"{source}: input {g.input[0].name!r} is {_fmt(dims)} (NHWC); set models.{name}.layout: "
                            "nhwc", f"add `layout: nhwc` to models.{name} in params.yaml (input_shape stays "
                                    f"{chw}): Kiln then feeds it channels last and imports it channels first")
        raise KilnError(f"{source}: input {g.input[0].name!r} is {dims}, but models.{name}.input_shape declares "
                        f"[batch, {', '.join(map(str, chw))}]" + (" (layout nhwc: [batch, "
                                                                   f"{', '.join(map(str, want))}])"
                                                                   if layout == "nhwc" else ""),
                        f"set models.{name}.input_shape (and preprocess.chip_size) to the model's input size")
    outs = {o.name: _dims(o) for o in g.output}
    if what := role.check_outputs([len(d) for d in outs.values()]):   # the outputs its role needs
        raise KilnError(f"{source}: model {name!r} outputs {outs}: {what}",
                        f"import the right outputs, or check models.{name}.samples")
    role.check_graph(mcfg, outs, source)                # by name: a declared decode's outputs exist
    return {"inputs": {g.input[0].name: dims}, "outputs": outs}


def check_source(proto: onnx.ModelProto, mcfg: ModelConfig, source: str, role: Role) -> tuple[onnx.ModelProto, dict]:
    """The first half of the import, up to the I/O check of the file's own graph: golden@ runs it before its
    reference runs the model, import@ (`prepare`) goes on from it."""
    m, structural = runnable(proto)
    m, ops = normalize_opset(m, mcfg.name)
    m, folded = fold_weights(m)
    m = infer(m, mcfg.name)
    check_io(m, mcfg, source, role)                     # against the file's own shapes, before any change to them
    return m, {**structural, **ops, **folded}


def channels_first(proto: onnx.ModelProto, layout: str) -> tuple[onnx.ModelProto, dict]:
    """NHWC: a new NCHW graph input and a Transpose to the old one in front, so every engine is fed NCHW."""
    if layout != "nhwc":
        return proto, {}
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    old = g.input[0]
    new = f"{old.name}_nchw"
    if new in _read_names(g) or any(t.name == new for t in g.initializer) or any(new in n.output for n in g.node):
        raise KilnError(f"graph already has a tensor named {new!r}", "rename it in the model")
    d = list(old.type.tensor_type.shape.dim)
    x = onnx.helper.make_tensor_value_info(new, old.type.tensor_type.elem_type, [0] * 4)
    for dst, src in zip(x.type.tensor_type.shape.dim, (d[0], d[3], d[1], d[2])):
        dst.CopyFrom(src)
    g.node.insert(0, onnx.helper.make_node("Transpose", [new], [old.name], perm=[0, 2, 3, 1], name="kiln_nchw"))
    del g.input[:]
    g.input.append(x)
    return m, {"layout": "nhwc, a Transpose inserted at the input"}


_ORT_OP = re.compile(r"(?:implementation for |Fatal error: )([\w.:]+?)(?:\(|\s|$)")


def ort_ops(message: str) -> list[str]:
    """The ops an ONNX Runtime session-build error names (its whole first line when it names none). It lives here,
    not in pipeline/opsupport.py, so that golden@ and export@ of an ONNX model do not depend on OpenVINO."""
    found = _ORT_OP.findall(message)
    return sorted(set(found)) or [f"(session build failed: {message.strip().splitlines()[0][:200]})"]


def _refused_dequantize(sess_run, m: onnx.ModelProto) -> bool:
    """Does ONNX Runtime refuse to run the file's weight DequantizeLinear nodes? (Build succeeds; the first run
    fails: e.g. a per-tensor scale with a block_size attribute, which the ONNX spec ignores and ORT rejects.)"""
    shape = [d.dim_value or 1 for d in m.graph.input[0].type.tensor_type.shape.dim] if len(m.graph.input) == 1 else []
    if not shape or m.graph.input[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        return False
    import onnxruntime as ort

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4                # the refusal is expected here, not an error to print
    try:
        sess_run(None, {m.graph.input[0].name: np.zeros(shape, np.float32)}, quiet)
        return False
    except Exception as e:  # noqa: BLE001 — ORT's own exception types
        return "DequantizeLinear" in str(e)


def reference_session(proto: onnx.ModelProto, layout: str = "nchw", axes=()):
    """ONNX Runtime on `runnable(proto)` with graph optimizations off: the reference of an ONNX-sourced model.
    Feeds are NCHW; an NHWC model (`layout`) gets them transposed; `axes`: the input axes models.<m>.dynamic
    declares, opened where the file fixes them (`open_axes`). Where ORT refuses the file's own weight
    DequantizeLinear nodes, the reference runs the weights as ONNX's reference implementation dequantizes them
    (`fold_weights`: the values the spec defines, stored), and the returned run's `note` says so."""
    import onnxruntime as ort

    m, _ = runnable(proto)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    note = None
    try:
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        if _refused_dequantize(sess.run, m):
            m, _ = fold_weights(m)
            note = ("ONNX Runtime refuses the file's weight DequantizeLinear nodes: the weights as ONNX's reference "
                    "implementation dequantizes them (the spec's values)")
        m, opened = open_axes(m, axes)
        if opened or note:
            sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 — ORT's own Fail / NotImplemented / InvalidGraph types
        raise KilnError(f"ONNX Runtime, the reference of an imported model, cannot run it: "
                        f"{', '.join(ort_ops(str(e)))}",
                        "replace those ops in the model (or export it at an opset ONNX Runtime implements)") from None
    fixed = sess.get_inputs()[0].shape[0]
    step = fixed if isinstance(fixed, int) and fixed > 0 else None
    inputs = [i.name for i in sess.get_inputs()]
    names = [o.name for o in sess.get_outputs()]

    def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Feeds bind by position (the file's own input names may differ from the feeds'); a batch fixed in the
        file is run `step` samples at a time."""
        values = list(feed.values())
        if layout == "nhwc":
            values = [np.ascontiguousarray(v.transpose(0, 2, 3, 1)) if v.ndim == 4 else v for v in values]
        n = len(values[0])
        try:
            if step is None or step == n:
                return sess.run(None, dict(zip(inputs, values)))
            parts = [sess.run(None, dict(zip(inputs, (v[i:i + step] for v in values)))) for i in range(0, n, step)]
        except Exception as e:  # noqa: BLE001 — ORT's own Fail / InvalidArgument / RuntimeException types
            raise KilnError(f"ONNX Runtime, the reference of an imported model, fails on it: "
                            f"{(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}",
                            "check the model's input (models.<m>.input_shape, layout) against the file") from None
        return [np.concatenate([p[k] for p in parts]) for k in range(len(names))]

    run.note = note
    return run, names


def prepare(proto: onnx.ModelProto, mcfg: ModelConfig, source: str, role: Role) -> tuple[onnx.ModelProto, dict]:
    """The whole import: runnable → opset floor → weights folded → I/O checks → NCHW input → dynamic batch →
    shapes → I/O checks."""
    m, checked = check_source(proto, mcfg, source, role)
    m, layout = channels_first(m, mcfg.layout)
    m, bn = fold_batchnorm(m)
    m, batch = dynamic_batch(m)
    m, spatial = open_axes(m, mcfg.dynamic.get("input", ()))
    m = infer(m, mcfg.name)
    io = check_io(m, mcfg, source, role, layout="nchw")
    m, renamed = rename_input(m)
    report = {**checked, **layout, **bn, **batch, **spatial, **io, **renamed, "source_opset": opset(proto),
              "source_ir_version": int(proto.ir_version), "source_producer": proto.producer_name or None}
    return m, report


def op_inventory(proto: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in proto.graph.node).items()))

