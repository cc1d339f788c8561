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

import numpy as np

from pipeline.roles.base import DETECTOR_CHECKS, Feed, Role


def runtime_decode(mcfg, input_size=None):
    """models.<m>.decode (validated by config.py) as kiln_runtime's Decode; `input_size` a system's detect_size."""
    from kiln_runtime.singleshot import Decode

    d = mcfg.decode
    return Decode(strides=tuple(d.strides), outputs=tuple((h, tuple(d.outputs[h])) for h in
                                                          ("class", "objectness", "box", "landmarks")
                                                          if h in d.outputs),
                  anchor_sizes=tuple(tuple(r) for r in d.anchor_sizes), anchor_offset=d.anchor_offset, box=d.box,
                  variances=tuple(d.variances), score=d.score, score_column=d.score_column, channels=d.channels,
                  mean=tuple(d.mean), std=tuple(d.std), pad_to=d.pad_to,
                  input_size=tuple(input_size) if input_size else (), score_threshold=d.score_threshold,
                  nms_threshold=d.nms_threshold, top_k=d.top_k)


def declaration_error(model: str, source: str, why: str):
    from pipeline.errors import KilnError

    return KilnError(f"{source}: models.{model}.decode does not fit the graph: {why}",
                     f"fix models.{model}.decode in params.yaml (kiln_runtime/singleshot.py says what each key means)")


class SingleShot(Role):
    name = "singleshot"
    task = "detect"
    feed_range = (-128.0, 255.0)
    onnx_only = True
    key_metric, direction, accuracy_label = "box_iou_min", 1, "box IoU min"
    metrics = "pipeline.gates.detection:singleshot_metrics"
    limits_section = "detector"
    checks = DETECTOR_CHECKS
    fixed_limits = (("none", 0),)

    def stream(self, cfg, model: str, set_name: str, root: Path, batch: int) -> Iterator[Feed]:
        from pipeline import samples
        from kiln_runtime import singleshot

        d = runtime_decode(cfg.model(model))
        for rgb in samples.photo_variants(cfg, set_name, root):
            yield {"input": singleshot.preprocess(rgb, d)[0]}

    def check_graph(self, mcfg, outs: dict[str, list], source: str) -> None:
        """Every output the declaration names is one the graph has, of rank 2 or 3."""
        for head, names in mcfg.decode.outputs.items():
            for n in names:
                if n not in outs:
                    raise declaration_error(mcfg.name, source, f"outputs.{head} names {n!r}; the graph's outputs "
                                            f"are {', '.join(outs)}")
                if len(outs[n]) not in (2, 3):
                    raise declaration_error(mcfg.name, source, f"output {n!r} is {outs[n]}; a head output is "
                                            "(batch, rows, values) or (batch, rows)")

    def golden(self, cfg, model: str, outs: list[list[np.ndarray]], root: Path) -> tuple[dict[str, np.ndarray], dict]:
        """Decode the reference on every golden photo: a declaration that does not fit fails here, in one line."""
        from pipeline import onnx_import, samples
        from kiln_runtime import singleshot

        mcfg = cfg.model(model)
        names = [o.name for o in onnx_import.load_source(mcfg, root).graph.output]
        d = runtime_decode(mcfg)
        faces = []
        for feed, per_feed in zip(samples.feeds(cfg, model, "golden", root), outs):
            h, w = feed["input"].shape[2:]
            try:
                faces.append(len(singleshot.decode(dict(zip(names, per_feed)), h, w, d)))
            except singleshot.DecodeError as e:
                raise declaration_error(model, mcfg.onnx.path, str(e)) from None
        return {}, {"reference_faces_per_photo": faces}

    def detect(self, rgb: np.ndarray, run: Callable, mcfg) -> list:
        """Faces in one RGB photo; `run` maps the preprocessed input to the outputs by name."""
        from kiln_runtime import singleshot

        return singleshot.detect(rgb, run, runtime_decode(mcfg))


SINGLESHOT = SingleShot()
