"""The role protocol: what a graph is for in the face system, one module per role, everything a stage may ask of it.

    name                the params.yaml key: `models.<m>.samples` (the registry, pipeline/roles/registry.py)
    task                what the graph does in a face system: embed | detect (a single-shot detector) | cascade (an
                        MTCNN net) | align; config.py checks model options and systems by it
    feed_names          the named inputs of every feed
    deps / params / manifest_inputs / stream / feeds   its feeds (pipeline/inputs.py dispatches to these): what they
                        read, the params keys they depend on, their manifest inputs, and the feeds themselves
    random_feed(shape, batch, seed)   a synthetic feed in the inputs' real value range (bench@, cold start)
    golden(cfg, model, outs, root) → (arrays, summary)   what golden@ writes beside the reference outputs
    check_outputs(ranks) → problem or None   the outputs an ONNX original must have (golden@, import@)
    check_graph(mcfg, outs, source)   the outputs by name against what params declare (a declared decode)
    output_axes() → {axis: name}   the dynamic axes of every exported output (export@)
    detect(rgb, run, mcfg) → faces   a single-shot detector's decode (task `detect`; the face system runs it)
    crop_fed            a face system feeds it a batch of crops per call (the leaderboard ranks it at that batch)
    key_metric, direction, accuracy_label   the gate's key metric, +1 when higher is better, its leaderboard label
    measure(cfg, model, runner, root) → (metrics, extra)   a runner of the model against its golden reference
    gate(cfg, metrics) → (failures, limits)   what fails against params.yaml `validate:`, and the limits it used;
                        gate_checks() the (metric, comparison, limit key) it applies; gate_code() its metric modules
    gate_inputs(cfg, model, root)   what the verdict's manifest names beside the engine and golden@ (an embedder:
                        the golden image set its gate reads)

A role module imports only numpy and this module at its top, so reading params or a cold start loads it cheaply.
Its metric maths lives in pipeline/gates/ and is named ("module:function") and called by name: a stage that needs
only a role's feeds (golden@, export@, quantize@ …) then does not depend on the metric code (its code closure,
pipeline/closure.py), while a stage that gates lists those modules too (`registry.modules(name, gate=True)`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pipeline.config import Config, ModelConfig

Feed = dict[str, np.ndarray]
TASKS = ("embed", "detect", "cascade", "align")
CHECK = "pipeline.gates.facemetrics:check"      # (metrics, checks, limits) → failure lines


def by_name(ref: str) -> Any:
    """What `module:name` names (a function, or a table such as the embedder gate), its module imported now."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Outputs:
    """The outputs an ONNX original of the role must have: how many (None: at least one) and their rank (of each,
    or of the first when the count is open), and what to say when they do not."""

    count: int | None
    rank: int
    what: str


class Role:
    """Defaults: one graph input `input`, fed whole photos (deps, params and manifest inputs: the photos), a batch
    axis on every output, no output check, values in [-1, 1], nothing beside golden@'s reference outputs, and a
    gate that is `checks` over the params.yaml section `validate.<limits_section>`."""

    name: str = ""
    task: str = ""
    feed_names: tuple[str, ...] = ("input",)
    feed_range: tuple[float, float] = (-1.0, 1.0)
    outputs: Outputs | None = None
    crop_fed: bool = False
    onnx_only: bool = False       # its golden reference and gate run the original ONNX file: no PyTorch factory
    key_metric: str = ""
    direction: int = 1
    accuracy_label: str = ""
    metrics: str = ""             # "module:function" (cfg, model, runner, root, role) → metrics dict
    limits_section: str = ""      # params.yaml validate.<section>
    checks: tuple[tuple[str, str, str], ...] = ()
    fixed_limits: tuple[tuple[str, float], ...] = ()   # limits that are not params (detectors: none = 0)

    def __repr__(self) -> str:
        return f"<role {self.name}>"

    # ------------------------------------------------------------------ feeds
    def deps(self, cfg: Config, model: str, set_name: str) -> list[str]:
        from pipeline.roles import inputs

        return inputs.photo_deps(cfg)

    def params(self, cfg: Config, model: str) -> list[str]:
        from pipeline.roles import inputs

        return list(inputs.PHOTO_PARAMS)

    def manifest_inputs(self, cfg: Config, model: str, set_name: str, root: Path) -> list[dict]:
        from pipeline.roles import inputs

        return inputs.photo_inputs(cfg, root)

    def stream(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Iterator[Feed]:
        raise NotImplementedError(f"role {self.name}: no feed builder")

    def feeds(self, cfg: Config, model: str, set_name: str, root: Path, batch: int) -> Sequence[Feed]:
        from pipeline.roles import inputs

        return inputs.held(model, set_name, self.stream(cfg, model, set_name, root, batch))

    def random_feed(self, input_shape: tuple[int, ...], batch: int, seed: int = 0) -> Feed:
        low, high = self.feed_range
        rng = np.random.default_rng(seed)
        return {"input": rng.uniform(low, high, (batch, *input_shape)).astype(np.float32)}

    # ------------------------------------------------------------------ golden reference, export, import, decode
    def golden(self, cfg: Config, model: str, outs: list[list[np.ndarray]],
               root: Path) -> tuple[dict[str, np.ndarray], dict]:
        return {}, {}

    def check_outputs(self, ranks: list[int]) -> str | None:
        o = self.outputs
        if o is None:
            return None
        if not ranks or (o.count is not None and len(ranks) != o.count) or \
                any(r != o.rank for r in (ranks if o.count else ranks[:1])):
            return o.what
        return None

    def check_graph(self, mcfg: ModelConfig, outs: dict[str, list], source: str) -> None:
        """Raise one KilnError if the graph's outputs (name → dims) do not fit what params declare of it."""

    def output_axes(self) -> dict[int, str]:
        return {0: "batch"}

    def detect(self, rgb: np.ndarray, run: Callable, mcfg: ModelConfig) -> list:
        raise NotImplementedError(f"role {self.name} is not a single-shot detector")

    # ------------------------------------------------------------------ gate
    def measure(self, cfg: Config, model: str, runner, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        return by_name(self.metrics)(cfg, model, runner, root, self), {}

    def gate_checks(self) -> tuple[tuple[str, str, str], ...]:
        """(metric, comparison, limit key) for every metric the gate reads."""
        return self.checks

    def gate(self, cfg: Config, metrics: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        typed = {**asdict(getattr(cfg.validate, self.limits_section)), **dict(self.fixed_limits)}
        return by_name(CHECK)(metrics, self.gate_checks(), typed), cfg.section("validate", self.limits_section)

    def gate_inputs(self, cfg: Config, model: str, root: Path) -> list[dict]:
        return []

    def gate_code(self) -> list[str]:
        """The modules of the metric code this role calls by name (a gating stage's `dynamic`)."""
        return sorted({ref.partition(":")[0] for ref in (self.metrics, CHECK) if ref})


class DetectorRole(Role):
    """A face detector (MTCNN's cascade or a whole-photo detector): the detector gate every face detector passes —
    params.yaml `validate.detector` over these (metric, comparison, limit key), and no face where the reference
    found none."""

    key_metric, direction, accuracy_label = "box_iou_min", 1, "box IoU min"
    limits_section = "detector"
    checks = (("box_iou_min", ">=", "box_iou_min"), ("landmark_err_max", "<=", "landmark_err_max"),
              ("face_agreement", ">=", "face_agreement_min"), ("photos_with_other_face_count", "<=", "none"))
    fixed_limits = (("none", 0),)
