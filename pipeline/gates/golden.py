"""Making the golden reference: a model's FP32 outputs on its golden feeds — PyTorch eager for a model with a
factory, ONNX Runtime with graph optimizations off on the original file for a model delivered as ONNX — refused if
any value is NaN or infinite; the `.npy` bytes they are stored as.

(What later stages read back is pipeline/gates/reference.py.)
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from pipeline import samples
from pipeline.errors import KilnError

if TYPE_CHECKING:
    from pipeline.config import ModelConfig


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def reference_outputs(model: torch.nn.Module, feeds: Sequence[samples.Feed]) -> list[list[np.ndarray]]:
    """Run the PyTorch model on every feed; inputs are passed in the feed's order (the forward's argument order).
    A reference with a NaN or infinite value is refused: every later gate would compare against garbage."""
    outs = []
    with torch.inference_mode():
        for i, feed in enumerate(feeds):
            y = model(*(torch.from_numpy(v) for v in feed.values()))
            outs.append([t.numpy() for t in (y if isinstance(y, (tuple, list)) else (y,))])
            if not all(np.isfinite(o).all() for o in outs[-1]):
                raise KilnError(f"the reference model produced NaN or infinite outputs on golden feed {i}",
                                "check the model's weights (a corrupt or NaN-filled file?) and its input scaling")
    return outs


def output_names(model: torch.nn.Module) -> list[str]:
    return list(getattr(model, "output_names", ["output"]))


def onnx_reference(mcfg: ModelConfig, feeds: Sequence[samples.Feed],
                   root: Path) -> tuple[list[list[np.ndarray]], list[str], str | None]:
    """ONNX Runtime on the original (pinned, checked) file: outputs per feed, the output names, and what the
    reference had to do to run it (None: the file as it is). The file's I/O is checked first, as import@ checks it:
    a wrong input shape or layout, or a Loop, is one clear error."""
    from pipeline import onnx_import
    from pipeline.roles import registry as roles

    proto = onnx_import.load_source(mcfg, root)
    onnx_import.check_source(proto, mcfg, mcfg.onnx.path, roles.get(mcfg.samples))
    run_feed, names = onnx_import.reference_session(proto, mcfg.layout, mcfg.dynamic.get("input", ()))
    outs = []
    for i, feed in enumerate(feeds):
        outs.append(run_feed(feed))
        if not all(np.isfinite(o).all() for o in outs[-1]):
            raise KilnError(f"{mcfg.onnx.path}: the model produced NaN or infinite outputs on golden feed {i}",
                            f"check the file and models.{mcfg.name}.preprocess (input scaling)")
    return outs, names, run_feed.note
