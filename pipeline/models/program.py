"""PyTorch → torch.export program: `export_program` (non-strict, the declared dynamic dims symbolic), the saved
bytes without per-node stack traces (they hold absolute source paths), a runner of it on golden feeds, and its ATen
op inventory."""

from __future__ import annotations

import io
import warnings
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.errors import KilnError

if TYPE_CHECKING:
    from pipeline.config import ModelConfig


def _widen(example: dict[str, np.ndarray], dynamic: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """torch.export specializes sizes 0 and 1: repeat each declared-dynamic axis of size 1 (P-Net's batch of one
    pyramid level, the aligner's one face) to 2 in the example."""
    out = {}
    for name, v in example.items():
        for axis in dynamic.get(name, ()):
            if v.shape[axis] == 1:
                v = np.repeat(v, 2, axis=axis)
        out[name] = v
    return out


def export_program(model: torch.nn.Module, mcfg: ModelConfig,
                   example: dict[str, np.ndarray]) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with params `models.<name>.dynamic` as symbolic dims; everything else static.

    `example` (the first golden feed, as export.py uses) gives the input names, order and shapes; a dynamic size
    must not be 0 or 1 in it (torch.export specializes those). `Dim.DYNAMIC` makes export fail, rather than
    silently specialize, if the model fixes a declared-dynamic size.
    """
    dynamic = tuple({a: torch.export.Dim.DYNAMIC for a in mcfg.dynamic.get(name, ())} or None for name in example)
    example = _widen(example, mcfg.dynamic)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            return torch.export.export(model, tuple(torch.from_numpy(v) for v in example.values()),
                                       dynamic_shapes=dynamic, strict=False)
        except Exception as e:  # torch raises several unrelated types (UserError, GuardOnDataDependent…)
            raise KilnError(f"models.{mcfg.name}: torch.export failed: {str(e).strip().splitlines()[0][:300]}",
                            "the model has Python control flow on tensor values or fixes a size declared dynamic "
                            "in models.<name>.dynamic; see torch.export's message") from None


def program_bytes(ep: torch.export.ExportedProgram) -> bytes:
    """The saved program without per-node Python stack traces (they hold absolute paths of the source files)."""
    for module in ep.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                node.meta.pop("stack_trace", None)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


def feed_runner(ep: torch.export.ExportedProgram):
    """`run_feed(feed) -> outputs` (numpy) of the exported program, for a parity comparison with golden."""
    module = ep.module()

    def run_feed(feed):
        with torch.no_grad():
            y = module(*(torch.from_numpy(v) for v in feed.values()))
        return [t.numpy() for t in (y if isinstance(y, (tuple, list)) else (y,))]

    return run_feed


def aten_ops(ep: torch.export.ExportedProgram) -> dict[str, int]:
    ops = Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    return dict(sorted(ops.items()))
