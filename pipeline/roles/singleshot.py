"""The declared single-shot detector role (`samples: singleshot`): any family whose graph maps a whole photo to
per-stride score, box and landmark outputs (YuNet, SCRFD, RetinaFace …), decoded as params.yaml
`models.<m>.decode` declares it — no code of the family in Kiln (kiln_runtime/singleshot.py).

Feeds: one per photo (the calibration set's variants too), at the photo's own size, made as the declaration says
(channels, mean, std, padding). It comes as an ONNX file; golden@ checks that every output the declaration names is
one the graph has and decodes the reference's outputs on every golden photo, so a declaration that does not fit the
graph fails there, in one line. The gate (pipeline/gates/detection.py `singleshot_metrics`) is the detector gate of
every detector: decoded faces against the reference's on the photos, face / non-face decisions on lfw_subset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.roles.base import DetectorRole, Feed

if TYPE_CHECKING:
    from pipeline.config import Config, ModelConfig


def declaration_error(model: str, source: str, why: str):
    from pipeline.errors import KilnError

    return KilnError(f"{source}: models.{model}.decode does not fit the graph: {why}",
                     f"fix models.{model}.decode in params.yaml (kiln_runtime/singleshot.py says what each key means)")


class SingleShot(DetectorRole):
    name = "singleshot"
    task = "detect"
    feed_range = (-128.0, 255.0)
    onnx_only = True
    metrics = "pipeline.gates.detection:singleshot_metrics"

    def stream(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Iterator[Feed]:
        from pipeline.roles import inputs
        from kiln_runtime import singleshot

        d = cfg.model(model).decode.runtime()
        for rgb in inputs.photo_variants(cfg, set_name, root):
            yield {"input": singleshot.preprocess(rgb, d)[0]}

    def check_graph(self, mcfg: ModelConfig, outs: dict[str, list], source: str) -> None:
        """Every output the declaration names is one the graph has, of rank 2 or 3."""
        for head, names in mcfg.decode.outputs.items():
            for n in names:
                if n not in outs:
                    raise declaration_error(mcfg.name, source, f"outputs.{head} names {n!r}; the graph's outputs "
                                            f"are {', '.join(outs)}")
                if len(outs[n]) not in (2, 3):
                    raise declaration_error(mcfg.name, source, f"output {n!r} is {outs[n]}; a head output is "
                                            "(batch, rows, values) or (batch, rows)")

    def golden(self, cfg: Config, model: str, outs: list[list[np.ndarray]],
               root: Path) -> tuple[dict[str, np.ndarray], dict]:
        """Decode the reference on every golden photo: a declaration that does not fit fails here, in one line."""
        import onnx

        from pipeline.roles import inputs
        from kiln_runtime import singleshot

        mcfg = cfg.model(model)
        names = [o.name for o in onnx.load(str(root / mcfg.onnx.path), load_external_data=False).graph.output]
        d = mcfg.decode.runtime()
        faces = []
        for feed, per_feed in zip(self.feeds(cfg, model, "golden", root, inputs.CHIP_BATCH), outs):
            h, w = feed["input"].shape[2:]
            try:
                faces.append(len(singleshot.decode(dict(zip(names, per_feed)), h, w, d)))
            except singleshot.DecodeError as e:
                raise declaration_error(model, mcfg.onnx.path, str(e)) from None
        return {}, {"reference_faces_per_photo": faces}

    def detect(self, rgb: np.ndarray, run: Callable, mcfg: ModelConfig) -> list:
        """Faces in one RGB photo; `run` maps the preprocessed input to the outputs by name."""
        from kiln_runtime import singleshot

        return singleshot.detect(rgb, run, mcfg.decode.runtime())


SINGLESHOT = SingleShot()
