"""params.yaml → frozen, typed configuration, validated once against one schema (pydantic).

The typed config mirrors params.yaml one to one (`cfg.export.parity.max_abs` is `export.parity.max_abs`). Every
section rejects unknown keys (a typo'd `graph_optimisation` is an error, not a silently ignored setting), numbers
must be finite and in range, and every error names the file and the dotted key. Names that become paths (models,
engines, recipes, targets) must be slugs (pipeline/paths.py). A target's own options are validated by that target
(`pipeline.targets.options`), which `kiln dag` does for every configured target before DVC runs anything.

Stages receive this typed config; nothing downstream re-reads params.yaml or checks a value again. `raw` keeps the
file's values as DVC reads them: manifests record the exact slice each stage tracks (pipeline/stage.py `Stage.params`).
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (AfterValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter,
                      ValidationError, model_validator)
from pydantic.dataclasses import dataclass

from pipeline.errors import KilnError
from pipeline.paths import SLUG
from pipeline.roles import registry as roles
from pipeline.userfiles import open_regular

DEFAULT_PARAMS = Path("params.yaml")
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
Float = Annotated[Union[StrictInt, Annotated[float, Field(strict=True)]], AfterValidator(float)]
Fraction = Annotated[Float, Field(ge=0, le=1)]
NonNeg = Annotated[Float, Field(ge=0)]
Count = Annotated[StrictInt, Field(ge=1)]
Slug = Annotated[StrictStr, Field(pattern="^" + SLUG.pattern + "$")]
SAMPLE_KINDS = roles.names()                    # a model's role: pipeline/roles/registry.py
PRECISIONS = ("fp32", "fp16", "bf16", "int8")   # which a target builds: pipeline/targets/__init__.py


def _kinds(task: str) -> str:
    """The `samples` values of the roles whose graphs do `task` in a face system, for messages."""
    return ", ".join(roles.with_task(task))


def frozen(cls):
    return dataclass(frozen=True, config=_STRICT)(cls)


# ---------------------------------------------------------------------------------------------- data
Point = tuple[Float, Float]
Template = tuple[Point, Point, Point, Point, Point]


@frozen
class Assets:
    dir: StrictStr


@frozen
class Augment:
    max_rotation_deg: Annotated[Float, Field(ge=0, le=45)]
    max_scale: Annotated[Float, Field(ge=0, le=0.5)]
    max_shift: Annotated[Float, Field(ge=0, le=0.5)]
    flip: StrictBool
    brightness: tuple[Annotated[Float, Field(gt=0)], Annotated[Float, Field(gt=0)]]

    @model_validator(mode="after")
    def _order(self):
        if self.brightness[0] > self.brightness[1]:
            raise ValueError("brightness must be [low, high] with low ≤ high")
        return self


@frozen
class SetSpec:
    per_photo: Count
    seed: Annotated[StrictInt, Field(ge=0)]
    name: StrictStr = ""


@frozen
class Sets:
    golden: SetSpec
    calibration: SetSpec

    def __getitem__(self, name: str) -> SetSpec:
        if name not in ("golden", "calibration"):
            raise KilnError(f"no image set named {name!r}", "use golden or calibration")
        return getattr(self, name)


@frozen
class DataConfig:
    photos: StrictStr
    chip_size: Annotated[StrictInt, Field(ge=16)]
    template: Template
    min_face_size: Annotated[StrictInt, Field(ge=12)]
    augment: Augment
    sets: Sets


# ---------------------------------------------------------------------------------------------- models
Rgb = tuple[Float, Float, Float]


@frozen
class OnnxSource:
    """A model delivered as an ONNX file: a path from the project root (an asset or a local file) and its sha256.
    A model whose weights sit in external-data files beside it pins each of them too (`external`: location as the
    model names it, relative to its folder → sha256): onnx.load reads them, so they are part of the model."""
    path: StrictStr
    sha256: Annotated[StrictStr, Field(pattern="^[0-9a-f]{64}$")]
    external: dict[StrictStr, Annotated[StrictStr, Field(pattern="^[0-9a-f]{64}$")]] = field(default_factory=dict)

    @model_validator(mode="after")
    def _inside(self):
        bad = [n for n in self.external if not n or n.startswith("/") or ".." in Path(n).parts]
        if bad:
            raise ValueError(f"external: {bad[0][:100]!r} must be a path inside the model's folder")
        return self

    @property
    def files(self) -> list[str]:
        """Every file the model reads: the .onnx file, then its external-data files."""
        folder = Path(self.path).parent
        return [Path(self.path).as_posix(), *((folder / name).as_posix() for name in sorted(self.external))]


@frozen
class Preprocess:
    """How an embedder's input is made from a photo: the aligned chip's geometry (its own image sets are built
    with it), then per channel (chip[channels] - mean) / std. Without it: data.chip_size / data.template, RGB 0..255."""
    chip_size: Annotated[StrictInt, Field(ge=16)]
    template: Template                   # 5 points in chip pixels, as data.template
    channels: Literal["rgb", "bgr"] = "rgb"
    mean: Rgb = (0.0, 0.0, 0.0)          # in the channel order of the input
    std: tuple[Annotated[Float, Field(gt=0)], Annotated[Float, Field(gt=0)], Annotated[Float, Field(gt=0)]] = \
        (1.0, 1.0, 1.0)


HeadName = Annotated[StrictStr, Field(min_length=1, max_length=200)]


@frozen
class Decode:
    """A single-shot detector's decode. samples: retinaface — the thresholds (kiln_runtime/retinaface.py); samples:
    singleshot — the whole head declared (kiln_runtime/singleshot.py says what each key means): any family whose
    outputs are per-stride score, box and landmark maps, with no code."""
    score_threshold: Annotated[Float, Field(gt=0, lt=1)] = 0.9
    nms_threshold: Annotated[Float, Field(gt=0, lt=1)] = 0.4
    strides: Optional[Annotated[tuple[Annotated[StrictInt, Field(ge=1, le=1024)], ...], Field(min_length=1)]] = None
    outputs: Optional[dict[Literal["class", "objectness", "box", "landmarks"],
                           Annotated[tuple[HeadName, ...], Field(min_length=1)]]] = None
    anchor_sizes: tuple[tuple[Annotated[Float, Field(gt=0)], ...], ...] = ()   # per stride; () anchor-free
    anchor_offset: Annotated[Float, Field(ge=0, le=1)] = 0.0
    box: Literal["centre-size", "distance"] = "centre-size"
    variances: tuple[Annotated[Float, Field(gt=0)], Annotated[Float, Field(gt=0)]] = (1.0, 1.0)
    score: Literal["class", "class-x-objectness", "sqrt-class-x-objectness"] = "class"
    score_column: StrictInt = -1
    channels: Literal["rgb", "bgr"] = "bgr"
    mean: Rgb = (0.0, 0.0, 0.0)
    std: tuple[Annotated[Float, Field(gt=0)], Annotated[Float, Field(gt=0)], Annotated[Float, Field(gt=0)]] = \
        (1.0, 1.0, 1.0)
    pad_to: Annotated[StrictInt, Field(ge=1, le=256)] = 1
    top_k: Annotated[StrictInt, Field(ge=1, le=100000)] = 5000

    @property
    def declared(self) -> bool:
        """A whole head is declared (samples: singleshot), not only thresholds."""
        return self.strides is not None or self.outputs is not None

    def runtime(self, input_size=None):
        """This declaration as kiln_runtime's singleshot.Decode; `input_size` a system's detect_size."""
        from kiln_runtime.singleshot import Decode as RuntimeDecode

        return RuntimeDecode(strides=tuple(self.strides),
                             outputs=tuple((h, tuple(self.outputs[h])) for h in ("class", "objectness", "box",
                                                                                 "landmarks") if h in self.outputs),
                             anchor_sizes=tuple(tuple(r) for r in self.anchor_sizes), anchor_offset=self.anchor_offset,
                             box=self.box, variances=tuple(self.variances), score=self.score,
                             score_column=self.score_column, channels=self.channels, mean=tuple(self.mean),
                             std=tuple(self.std), pad_to=self.pad_to,
                             input_size=tuple(input_size) if input_size else (), score_threshold=self.score_threshold,
                             nms_threshold=self.nms_threshold, top_k=self.top_k)

    @model_validator(mode="after")
    def _head(self):
        if not self.declared:
            return self
        if self.strides is None or self.outputs is None:
            raise ValueError("a declared decode names both `strides` and `outputs`")
        need = {"class", "box", "landmarks", *(("objectness",) if "objectness" in self.score else ())}
        if missing := sorted(need - set(self.outputs)):
            raise ValueError(f"outputs: no {', '.join(missing)} (score {self.score} reads class"
                             f"{' and objectness' if 'objectness' in self.score else ''}; box and landmarks always)")
        for head, names in self.outputs.items():
            if len(names) not in (1, len(self.strides)):
                raise ValueError(f"outputs.{head}: one name (all strides concatenated) or one per stride "
                                 f"({len(self.strides)})")
        if self.anchor_sizes and len(self.anchor_sizes) != len(self.strides):
            raise ValueError(f"anchor_sizes: one list per stride ({len(self.strides)}), or none (anchor-free)")
        return self


@frozen
class ModelConfig:
    input_shape: tuple[Annotated[StrictInt, Field(gt=0)], ...]          # one sample (P-Net: a typical level)
    # the source: a PyTorch factory "module:callable" (called with `weights`), or an ONNX file (`onnx`)
    factory: Optional[Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]] = None
    onnx: Optional[OnnxSource] = None
    weights: Optional[StrictStr] = None             # called with this path (None: a graph with no weights)
    # embedders: same person when L2 < this (metric l2) or when cosine similarity ≥ this (metric cosine)
    verify_threshold: Optional[Annotated[Float, Field(gt=0)]] = None
    metric: Literal["l2", "cosine"] = "l2"
    preprocess: Optional[Preprocess] = None
    decode: Optional[Decode] = None                  # samples: retinaface (default Decode() when absent)
    samples: Literal[SAMPLE_KINDS] = "chips"         # its role: which inputs it sees, its gate (pipeline/roles/)
    dynamic: dict[StrictStr, tuple[Annotated[StrictInt, Field(ge=0)], ...]] = field(
        default_factory=lambda: {"input": (0,)})    # input name → dynamic axes of the exported graph
    parity_max_abs: Optional[NonNeg] = None         # overrides export.parity.max_abs for this graph's scale
    # an ONNX model's input layout: nhwc (channels last, TensorFlow's export) is fed transposed by golden@ and gets a
    # Transpose in front at import@, so every engine sees NCHW; input_shape stays channels first
    layout: Literal["nchw", "nhwc"] = "nchw"
    name: StrictStr = ""

    @model_validator(mode="after")
    def _shape(self):
        if not self.input_shape:
            raise ValueError("input_shape must list the sample's dimensions, e.g. [3, 150, 150]")
        if (self.factory is None) == (self.onnx is None):
            raise ValueError("give the model exactly one source: `factory` (PyTorch) or `onnx` ({path, sha256})")
        if self.onnx is not None and self.weights is not None:
            raise ValueError("an ONNX model carries its weights: drop `weights` (the file is pinned by onnx.sha256)")
        role = roles.entry(self.samples)          # its task and source facts, without loading the role
        if self.preprocess is not None:
            if role.task != "embed":
                raise ValueError(f"preprocess is for embedders (samples: {_kinds('embed')})")
            size = self.preprocess.chip_size
            if self.input_shape != (3, size, size):
                raise ValueError(f"input_shape {list(self.input_shape)} does not match preprocess.chip_size {size}: "
                                 f"use [3, {size}, {size}]")
        if self.layout == "nhwc" and (self.onnx is None or len(self.input_shape) != 3):
            raise ValueError("layout: nhwc is for models delivered as ONNX with an image input (input_shape "
                             "[C, H, W]); a PyTorch factory's input is NCHW")
        if role.onnx_only and self.onnx is None:
            raise ValueError(f"a {self.samples} detector comes from an ONNX file (`onnx: {{path, sha256}}`)")
        if self.decode is not None and role.task != "detect":
            raise ValueError(f"decode is for single-shot detectors (samples: {_kinds('detect')})")
        if role.declared_decode and (self.decode is None or not self.decode.declared):
            raise ValueError(f"a {self.samples} detector declares its head: decode: {{strides, outputs, box, "
                             "score, …}} (kiln_runtime/singleshot.py)")
        if self.decode is not None and self.decode.declared and not role.declared_decode:
            raise ValueError(f"a {self.samples} detector's head is decoded by its own code: keep only "
                             "decode.score_threshold / nms_threshold, or use samples: singleshot")
        if self.metric == "cosine" and self.verify_threshold is not None and self.verify_threshold > 1:
            raise ValueError("a cosine verify_threshold is a similarity in (0, 1]")
        return self

    @property
    def weights_path(self) -> Path | None:
        return None if self.weights is None else Path(self.weights)

    @property
    def source_file(self) -> str | None:
        """The file the model's graph comes from: its weights (PyTorch) or its ONNX file; None for neither."""
        return self.onnx.path if self.onnx is not None else self.weights


@frozen
class Parity:
    max_abs: NonNeg
    min_cosine: Annotated[Float, Field(ge=-1, le=1)]


@frozen
class ExportConfig:
    opset: Annotated[StrictInt, Field(ge=13, le=23)]
    exporter: Literal["torchscript", "dynamo"]
    parity: Parity


# A calibration method: minmax, entropy, or percentile-<p> (p in [90, 100], e.g. percentile-99.999).
CalibrationMethod = Annotated[StrictStr, Field(pattern=r"^(minmax|entropy|percentile-\d{2,3}(\.\d+)?)$")]


@frozen
class CalibrateConfig:
    # Every candidate's ranges are computed (one streamed pass for min/max, one for the histograms); each candidate's
    # INT8 model (recipe `select_recipe`) is judged by the model's face-task gate and the best one is the calibration
    # every recipe and target uses (pipeline/quant/selection.py). One candidate = that method, still judged.
    candidates: Annotated[tuple[CalibrationMethod, ...], Field(min_length=1)]
    select_recipe: Slug
    bins: Annotated[StrictInt, Field(ge=256)]
    batch: Count

    @model_validator(mode="after")
    def _candidates(self):
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError("candidates must be distinct")
        for c in self.candidates:
            if c.startswith("percentile-") and not 90 <= float(c.partition("-")[2]) <= 100:
                raise ValueError(f"{c}: a percentile must be in [90, 100]")
        return self


@frozen
class Recipe:
    weights: Literal["s8"]
    activations: Literal["u8", "s8"]
    per_channel: StrictBool
    symmetric_activations: StrictBool
    bias_float: StrictBool      # leave biases in float (TensorRT form) instead of int32
    # 7-bit weights: x86 CPUs without VNNI (AVX2, AVX-512 before VNNI) multiply u8 x s8 pairs into a saturating
    # int16 (vpmaddubsw); full-range weights then overflow it (embedder golden cosine min 0.974 on a Zen 3)
    reduce_range: StrictBool = False
    name: StrictStr = ""
    models: tuple[Slug, ...] | None = None   # the quantize.models it applies to (default: all of them)
    # mixed precision: nodes of the pre-processed graph left in float (their names: `kiln compare`,
    # debug-precision@ reports); each must exist in every graph the recipe quantizes
    float_nodes: tuple[StrictStr, ...] = ()


@frozen
class QuantizeConfig:
    recipes: dict[Slug, Recipe]
    models: tuple[Slug, ...]


@frozen
class ProgramConfig:
    models: tuple[Slug, ...]


@frozen
class TargetConfig:
    """`enabled` and `fallback_policy` here; every other key is the target's own option, validated by the target
    (its `Options` model, pipeline/targets/)."""

    enabled: StrictBool = True
    fallback_policy: Literal["warn", "fail"] = "warn"
    options: dict[StrictStr, Any] = field(default_factory=dict)
    name: StrictStr = ""

    @model_validator(mode="before")
    @classmethod
    def _collect_options(cls, data: Any) -> Any:
        if isinstance(data, dict):
            own = {"enabled", "fallback_policy", "name"}
            return {**{k: v for k, v in data.items() if k in own},
                    "options": {k: v for k, v in data.items() if k not in own}}
        return data


@frozen
class EngineSpec:
    model: Slug
    target: Slug
    precision: Literal[PRECISIONS]
    source: StrictStr           # the artifact compiled (artifacts/export|quantized|program/…), as in dvc.yaml
    recipe: Optional[Slug] = None
    name: StrictStr = ""


# ---------------------------------------------------------------------------------------------- gates
@frozen
class DetectorGate:
    box_iou_min: Fraction           # every reference face matched by an engine face with at least this IoU
    landmark_err_max: NonNeg        # max landmark error, as a fraction of the inter-ocular distance
    face_agreement_min: Fraction    # lfw_subset face / non-face decisions equal to the reference (R-/O-Net)


@frozen
class AlignerGate:
    pixel_mae_max: NonNeg           # mean |Δ| of chip pixels (0..255) vs the reference warp
    pixel_max_abs_max: NonNeg


@frozen
class ValidateConfig:
    cosine_min: Annotated[Float, Field(ge=-1, le=1)]
    cosine_mean: Annotated[Float, Field(ge=-1, le=1)]
    l2_max: NonNeg
    top1_agreement_min: Fraction
    decision_agreement_min: Fraction
    tar_delta_max: Fraction
    far_delta_max: Fraction
    detector: DetectorGate
    aligner: AlignerGate


@frozen
class BenchConfig:
    batches: tuple[Annotated[StrictInt, Field(gt=0)], ...]
    warmup: Annotated[StrictInt, Field(ge=0)]
    min_runs: Count
    min_seconds: NonNeg
    # the INT8 margin: median per-round FP32/INT8 p50 ratio ≥ this, the rounds' spread < this − 1 or every round
    # ≥ this (gates/timing.py int8_decision)
    int8_min_speedup: NonNeg = 1.15


# What a sysbench point may ask of a host at all (checked in _check_systems). A point offers streams × fps frames a
# second, each a detection cascade, an embedding and a search: ≥ 0.03 CPU-s a frame on every system measured here
# (docs/measurements.md), so 10 000 frames/s keeps ≥ 300 cores busy — past any one host the sweep drives (≤ 64
# workers) — and the parent, one Python process putting every frame on one queue, could not offer them in time.
# Past it a point measures only its own backlog; its schedule (streams × fps × (1 + seconds) frames, made before
# the first is sent) stays ≤ 1.2 M entries. 1 024 streams is that rate at the default 10 fps, and bounds the
# schedule where a low fps would not; a batch (one embedder call for all its frames' faces) of 256 frames is far
# past any batch an engine here is benched at (bench.batches).
SYSBENCH_MAX_STREAMS = 1024
SYSBENCH_MAX_OFFERED_FPS = 10_000
SYSBENCH_MAX_BATCH = 256


@frozen
class SysbenchConfig:
    """sysbench@<system>: sustained load on a face system (pipeline/sysbench/)."""
    streams: tuple[Count, ...] = (1, 2, 4, 8)      # the sweep: concurrent streams, ascending
    fps: Annotated[Float, Field(gt=0, le=240)] = 10.0                # frames per second per stream
    resolution: tuple[Annotated[StrictInt, Field(ge=64, le=4096)], Annotated[StrictInt, Field(ge=64, le=4096)]] = \
        (640, 480)                                                   # width, height of every frame
    seconds: Annotated[Float, Field(gt=0, le=120)] = 5.0            # measured per stream count (after warm-up)
    p99_budget_ms: Annotated[Float, Field(gt=0)] = 100.0           # frame arrival → match decision
    max_batch: Count = 8                         # frames one worker takes at once (embedder + search batched)
    workers: Annotated[StrictInt, Field(ge=0, le=64)] = 0          # worker processes; 0 = one per CPU core


@frozen
class RegisterConfig:
    experiment: Slug
    sqlite_path: StrictStr
    timeout_s: Annotated[Float, Field(gt=0, le=600)] = 10.0   # longest wait for an unreachable tracking server


# ---------------------------------------------------------------------------------------------- matching
@frozen
class MatchTargets:
    recall_at_1_min: Annotated[Float, Field(gt=0, le=1)]   # the choice: fastest index with recall@1 ≥ this …
    recall_at_10_min: Fraction        # … and recall@10 ≥ this (recall@1 alone flatters IVF)
    golden_top1_agreement_min: Fraction   # identity gate: golden queries' top-1 identity as under exact search
    decision_agreement_min: Fraction  # identity gate: open-set decisions at the embedder's verify_threshold


@frozen
class Latency:
    runs_b1: Count
    runs_b64: Count
    max_seconds: Annotated[Float, Field(gt=0)]   # per measurement; cuts runs short on slow (exact, 1M) indexes


@frozen
class MatchingConfig:
    gallery_sizes: tuple[Annotated[StrictInt, Field(ge=1000)], ...]
    seed: Annotated[StrictInt, Field(ge=0)]
    queries: Count                    # noisy copies of gallery rows, golden ones first
    threads: Count                    # FAISS OpenMP threads for builds and timed searches (IVF-PQ depends on it)
    targets: MatchTargets
    nlist_per_sqrt_n: Annotated[Float, Field(gt=0)]   # `{nlist}` = power of two nearest to this × sqrt(size)
    sweep: tuple[StrictStr, ...]      # index specs (pipeline/matching/spec.py), `{nlist}` substituted
    latency: Latency
    max_size: dict[Literal["flat", "sq8", "hnsw", "ivf-flat", "ivf-pq"], Count] = field(default_factory=dict)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.gallery_sizes

    def nlist(self, size: int) -> int:
        return int(2 ** round(math.log2(max(1.0, self.nlist_per_sqrt_n * math.sqrt(size)))))

    def specs(self, size: int) -> list:
        """The parsed IndexSpecs of the sweep at one gallery size (kinds over their max_size left out)."""
        from pipeline.matching.spec import IndexSpec

        out = []
        for text in self.sweep:
            sp = IndexSpec.parse(text.replace("{nlist}", str(self.nlist(size))))
            if size <= self.max_size.get(sp.kind, size):
                out.append(sp)
        return out

    def check_size(self, size: int) -> int:
        if size not in self.gallery_sizes:
            raise KilnError(f"gallery size {size} is not in matching.gallery_sizes {list(self.gallery_sizes)}",
                            "add it to params.yaml matching.gallery_sizes (dvc.yaml has one stage per size)")
        return size


# ---------------------------------------------------------------------------------------------- systems
MTCNN = "mtcnn"     # the detector of a system that is the pnet → rnet → onet cascade (plus the aligner graph)


@frozen
class SystemGate:
    """system@'s gate: the system's engines against the reference system on the photos (pipeline/gates/system.py).
    The defaults are params.yaml's dlib-mtcnn values (justified there)."""
    box_iou_min: Fraction = 0.9             # every reference face found again with at least this box IoU
    faces_missed_max: Annotated[StrictInt, Field(ge=0)] = 0   # reference faces with no system face (IoU ≥ 0.5)
    faces_extra_max: Annotated[StrictInt, Field(ge=0)] = 0    # system faces that match no reference face
    identity_agreement_min: Fraction = 1.0  # identity or `unknown` equal to the reference's (full and leave-one-out)
    decision_agreement_min: Fraction = 1.0  # same/different decisions, every pair of detected faces


@frozen
class SystemSpec:
    """A face system: a detector and an embedder from `models:`, and the engines system@ gates it with."""
    detector: Slug          # `mtcnn` (the cascade of models pnet, rnet, onet) or a model with samples: retinaface
    embedder: Slug          # a model with samples: chips
    target: Slug = "ort-cpu"                # system@: each graph's engine on this target in `precision`, else
    precision: Literal[PRECISIONS] = "int8"     # its FP32 one (as `kiln identify --target/--precision`) …
    engines: dict[Slug, Slug] = field(default_factory=dict)   # … unless pinned here by name: {model: engine}
    gate: SystemGate = field(default_factory=SystemGate)
    # a singleshot detector's input: [width, height] the frame is scaled to fit before detection (boxes and
    # landmarks mapped back); None: the frame's own size
    detect_size: Optional[tuple[Annotated[StrictInt, Field(ge=16, le=4096)],
                                Annotated[StrictInt, Field(ge=16, le=4096)]]] = None
    name: StrictStr = ""


@frozen
class GalleryCompat:
    """A system's new embedder against the gallery the production embedder enrolled (pipeline/gates/gallery_compat.py):
    outside any limit, the system version is `re-enroll required`. Defaults: params.yaml's values (justified there)."""
    top1_agreement_min: Fraction = 1.0      # probes whose identity (or `unknown`) is what same-engine probing gives
    decision_flips_max: Annotated[StrictInt, Field(ge=0)] = 0   # probe × gallery same/different decisions changed
    tar_delta_max: Fraction = 0.02          # |Δ true-accept rate| of the genuine pairs, cross vs same engine
    far_delta_max: Fraction = 0.01          # |Δ false-accept rate| of the impostor pairs
    distance_delta_max: NonNeg = 0.03       # largest change of one probe-to-gallery distance (the model's space)


@frozen
class OutputLimits:
    max_rel_delta: NonNeg                   # largest |Δ| of any output, over the largest |production output|
    cosine_min: Fraction                    # lowest per-sample cosine between the two engines' outputs


@frozen
class UpgradeLimits:
    """`kiln upgrade-report` (pipeline/release/upgrade.py): a rebuilt engine against its production version on the
    golden feeds, within its precision's output limits (fp16 and bf16 engines take fp32's unless given), else (or
    with a failed gate) `differs`; a latency verdict needs every interleaved round beyond 1 ± latency_margin.
    Defaults: params.yaml's values (justified there)."""
    precisions: dict[Literal[PRECISIONS], OutputLimits] = field(default_factory=lambda: {
        "fp32": OutputLimits(1e-3, 0.9999), "int8": OutputLimits(0.1, 0.998)})
    latency_margin: NonNeg = 0.05

    def limits(self, precision: str) -> OutputLimits:
        return self.precisions.get(precision) or self.precisions.get("fp32") or OutputLimits(1e-3, 0.9999)


# ---------------------------------------------------------------------------------------------- root
@frozen
class Params:
    assets: Assets
    data: DataConfig
    models: dict[Slug, ModelConfig]
    export: ExportConfig
    calibrate: CalibrateConfig
    quantize: QuantizeConfig
    program: ProgramConfig
    targets: dict[Slug, TargetConfig]
    engines: dict[Slug, EngineSpec]
    validate: ValidateConfig
    bench: BenchConfig
    register: RegisterConfig
    matching: MatchingConfig
    systems: dict[Slug, SystemSpec] = field(default_factory=dict)
    gallery_compat: GalleryCompat = field(default_factory=GalleryCompat)
    upgrade: UpgradeLimits = field(default_factory=UpgradeLimits)
    sysbench: SysbenchConfig = field(default_factory=SysbenchConfig)


class Config:
    """The validated parameters (`Params`' sections as attributes) plus the file they came from and its raw
    values. Frozen: build another with `replace(**sections)` (tests), never by mutation."""

    def __init__(self, source: Path, raw: dict[str, Any], params: Params) -> None:
        object.__setattr__(self, "source", Path(source))
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "params", params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.params, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is frozen; use replace()")

    def replace(self, **sections: Any) -> "Config":
        import dataclasses

        return Config(self.source, self.raw, dataclasses.replace(self.params, **sections))

    @property
    def assets_dir(self) -> Path:
        return Path(self.params.assets.dir)

    @property
    def recipes(self) -> dict[str, Recipe]:
        return self.params.quantize.recipes

    def engine(self, name: str) -> EngineSpec:
        if name not in self.engines:
            raise KilnError(f"{self.source}: engines: no engine named {name!r}",
                            f"known engines: {', '.join(sorted(self.engines))}")
        return self.engines[name]

    def system(self, name: str) -> SystemSpec:
        if name not in self.systems:
            raise KilnError(f"{self.source}: systems: no system named {name!r}",
                            f"known systems: {', '.join(sorted(self.systems)) or '(none)'}")
        return self.systems[name]

    def engines_of(self, model: str) -> list[EngineSpec]:
        return [e for e in self.engines.values() if e.model == model]

    def model(self, name: str) -> ModelConfig:
        if name not in self.models:
            raise KilnError(f"{self.source}: models: no model named {name!r}",
                            f"known models: {', '.join(sorted(self.models))}")
        return self.models[name]

    def section(self, *keys: str) -> Any:
        """The raw values of one section, as DVC reads them."""
        value: Any = self.raw
        for k in keys:
            value = value[k]
        return value


# ---------------------------------------------------------------------------------------------- cross-checks
def _cross_check(p: Params) -> list[tuple[str, str, str]]:
    """(dotted key, problem, hint) for every reference between sections that does not resolve. What needs the
    target registry (a target's name, what it compiles, its options) is checked by pipeline.targets.check, which
    `kiln dag` runs before DVC and every engine stage runs for its engine: so reading params never depends on the
    target modules, and adding a target does not stale every stage."""
    return [*_check_recipes(p), *_check_model_lists(p), *_check_thresholds(p), *_check_engines(p),
            *_check_matching(p), *_check_systems(p)]


def _check_recipes(p: Params) -> list[tuple[str, str, str]]:
    """Each recipe's models are quantized; calibrate.select_recipe names a plain full-INT8 recipe."""
    bad: list[tuple[str, str, str]] = []
    recipes = set(p.quantize.recipes)
    for name, r in p.quantize.recipes.items():
        for m in r.models or ():
            if m not in p.quantize.models:
                bad.append((f"quantize.recipes.{name}.models", f"{m!r} is not in quantize.models",
                            f"quantized models: {', '.join(p.quantize.models)}"))
    sel = p.calibrate.select_recipe
    if sel not in recipes:
        bad.append(("calibrate.select_recipe", f"no recipe named {sel!r}",
                    f"name one of quantize.recipes: {', '.join(sorted(recipes))}"))
    elif p.quantize.recipes[sel].models is not None or p.quantize.recipes[sel].float_nodes:
        bad.append(("calibrate.select_recipe", f"recipe {sel!r} is scoped to some models or keeps nodes in float",
                    "judge calibrations with a plain full-INT8 recipe that applies to every model (e.g. ort)"))
    return bad


def _check_model_lists(p: Params) -> list[tuple[str, str, str]]:
    """quantize.models and program.models name known models; program.models only PyTorch ones."""
    bad: list[tuple[str, str, str]] = []
    models = set(p.models)
    for key in ("quantize", "program"):
        for m in getattr(p, key).models:
            if m not in models:
                bad.append((f"{key}.models", f"no model named {m!r}", f"known models: {', '.join(sorted(models))}"))
    for m in p.program.models:
        if m in models and p.models[m].onnx is not None:
            bad.append(("program.models", f"{m!r} comes from an ONNX file: it has no PyTorch module to torch.export",
                        f"drop {m} from program.models (its engines compile from artifacts/export/{m})"))
    return bad


def _check_thresholds(p: Params) -> list[tuple[str, str, str]]:
    """Every embedder has its verify_threshold."""
    bad: list[tuple[str, str, str]] = []
    for name, m in p.models.items():
        if roles.entry(m.samples).task == "embed" and m.verify_threshold is None:
            bad.append((f"models.{name}.verify_threshold", f"an embedder (samples: {m.samples}) needs its threshold",
                        "e.g. verify_threshold: 0.6 (same person when L2 < 0.6)"))
    return bad


def _check_engines(p: Params) -> list[tuple[str, str, str]]:
    """The first problem of each engine (model, target, source, precision ↔ recipe ↔ quantize)."""
    return [problem for name, e in p.engines.items() if (problem := _check_engine(p, name, e))]


def _check_engine(p: Params, name: str, e: EngineSpec) -> tuple[str, str, str] | None:
    """One engine's first problem, or None: its model and target exist, its source fits the model, and an int8
    engine names a recipe that quantizes its model (a float one names none)."""
    models, recipes = set(p.models), set(p.quantize.recipes)
    where = f"engines.{name}"
    if e.model not in models:
        return (f"{where}.model", f"no model named {e.model!r}", f"known models: {', '.join(sorted(models))}")
    if e.target not in p.targets:
        return (f"{where}.target", f"no target named {e.target!r}",
                f"configure it under targets: ({', '.join(p.targets)})")
    if p.models[e.model].onnx is not None and e.source == f"artifacts/program/{e.model}":
        return (f"{where}.source", f"{e.model!r} comes from an ONNX file, so there is no torch.export program",
                f"use a target that compiles ONNX ({e.target} compiles programs), from artifacts/export/"
                f"{e.model}")
    if e.precision == "int8" and e.source.rstrip("/") == f"artifacts/program/{e.model}":
        return None                    # a program target's int8 is calibrated at compile (targets.check: no recipe)
    if e.precision == "int8" and e.recipe not in recipes:
        return (f"{where}.recipe", f"int8 needs a quantization recipe, got {e.recipe!r}",
                f"name one of quantize.recipes: {', '.join(sorted(recipes))}")
    if e.precision != "int8" and e.recipe is not None:
        return (f"{where}.recipe", f"only int8 engines take a recipe ({e.precision} given)", "drop `recipe:`")
    if e.precision == "int8" and e.model not in p.quantize.models:
        return (f"{where}.model", f"{e.model!r} is not quantized (quantize.models)",
                f"add {e.model} to quantize.models")
    if e.precision == "int8" and e.model not in (p.quantize.recipes[e.recipe].models or p.quantize.models):
        return (f"{where}.recipe", f"recipe {e.recipe!r} does not quantize {e.model!r} "
                f"(quantize.recipes.{e.recipe}.models)", f"add {e.model} to that recipe's models")
    return None


def _check_matching(p: Params) -> list[tuple[str, str, str]]:
    """The matching sweep builds some index at every gallery size, each with enough training vectors, and the
    gallery sizes are distinct."""
    bad: list[tuple[str, str, str]] = []
    for size in p.matching.gallery_sizes:
        try:
            specs = p.matching.specs(size)
        except KilnError as err:
            bad.append(("matching.sweep", err.message, err.hint))
            break
        if not specs:
            bad.append(("matching.sweep", f"no index of the sweep is built at gallery size {size} (max_size)",
                        "keep at least one kind (flat or ivf-flat) without a max_size"))
        for sp in specs:
            if "nlist" in sp.p and 39 * sp.p["nlist"] > size:
                bad.append(("matching.sweep", f"{sp.name} at gallery size {size}: {sp.p['nlist']} lists need ≥ "
                            f"{39 * sp.p['nlist']} training vectors", "lower nlist or nlist_per_sqrt_n"))
    if len(set(p.matching.gallery_sizes)) != len(p.matching.gallery_sizes):
        bad.append(("matching.gallery_sizes", "sizes must be distinct", "drop the repeated size"))
    return bad


def _check_systems(p: Params) -> list[tuple[str, str, str]]:
    """Each system's detector (mtcnn or a detect model) and embedder resolve, and the face system's `embedder`
    model exists; the load test's stream counts ascend."""
    bad: list[tuple[str, str, str]] = []
    sb = p.sysbench
    if list(sb.streams) != sorted(set(sb.streams)):
        bad.append(("sysbench.streams", f"{_cut(str(list(sb.streams)), 80)} is not ascending without repeats",
                    "list the stream counts once each, smallest first (e.g. [1, 2, 4, 8])"))
    elif sb.streams and sb.streams[-1] > SYSBENCH_MAX_STREAMS:
        bad.append(("sysbench.streams", f"{sb.streams[-1]} streams: more than any host can serve (at most "
                    f"{SYSBENCH_MAX_STREAMS} per point)", f"sweep at most {SYSBENCH_MAX_STREAMS} streams; the sweep "
                    "stops at the first count that misses the budget anyway"))
    elif sb.streams and sb.streams[-1] * sb.fps > SYSBENCH_MAX_OFFERED_FPS:
        bad.append(("sysbench.streams", f"{sb.streams[-1]} streams × {sb.fps:g} fps = "
                    f"{sb.streams[-1] * sb.fps:g} frames/s: more than any host can decide (at most "
                    f"{SYSBENCH_MAX_OFFERED_FPS} per point)",
                    f"keep streams × fps ≤ {SYSBENCH_MAX_OFFERED_FPS}: fewer streams or a lower fps"))
    if sb.max_batch > SYSBENCH_MAX_BATCH:
        bad.append(("sysbench.max_batch", f"{sb.max_batch} frames a batch: more than an engine is run at (at most "
                    f"{SYSBENCH_MAX_BATCH})", "take fewer frames at once (e.g. 8)"))
    for name, sy in p.systems.items():
        det = p.models.get(sy.detector)
        if sy.detector == MTCNN:
            if missing := [n for n in ("pnet", "rnet", "onet") if n not in p.models]:
                bad.append((f"systems.{name}.detector", f"the mtcnn cascade needs models {', '.join(missing)}",
                            "keep the MTCNN nets in models:"))
        elif det is None or roles.entry(det.samples).task != "detect":
            bad.append((f"systems.{name}.detector", f"{sy.detector!r} is neither `mtcnn` nor a {_kinds('detect')} "
                        "model", f"name `mtcnn` or a model with samples: {_kinds('detect')}"))
        if sy.detect_size is not None and (det is None or not roles.entry(det.samples).declared_decode):
            bad.append((f"systems.{name}.detect_size", "scales the frame for a declared single-shot detector only",
                        "drop detect_size, or detect with a model of samples: singleshot"))
        if sy.embedder not in p.models or roles.entry(p.models[sy.embedder].samples).task != "embed":
            embedders = [m for m, s in p.models.items() if roles.entry(s.samples).task == "embed"]
            bad.append((f"systems.{name}.embedder", f"{sy.embedder!r} is not an embedder (samples: {_kinds('embed')})",
                        f"name one of: {', '.join(embedders)}"))
        if sy.target not in p.targets:
            bad.append((f"systems.{name}.target", f"no target named {sy.target!r}",
                        f"name one of targets: {', '.join(sorted(p.targets))}"))
        chips = p.models.get(sy.embedder)           # the aligner graph cuts the default chip geometry only
        parts = {*(("pnet", "rnet", "onet") if sy.detector == MTCNN else (sy.detector,)), sy.embedder,
                 *(("aligner",) if chips is not None and chips.preprocess is None else ())}
        for model, engine in sy.engines.items():
            e = p.engines.get(engine)
            if model not in parts:
                bad.append((f"systems.{name}.engines.{model}", f"{model!r} is not a graph of this system",
                            f"pin engines of: {', '.join(sorted(m for m in parts if m in p.models))}"))
            elif e is None or e.model != model:
                what = "no such engine" if e is None else f"a {e.model} engine, not a {model} one"
                bad.append((f"systems.{name}.engines.{model}", f"{engine!r}: {what}", "pin one of: " + (", ".join(
                    sorted(k for k, v in p.engines.items() if v.model == model)) or "(none)")))
    if "embedder" not in p.models:
        bad.append(("models", "the face system needs an `embedder` model", "see the repository's params.yaml"))
    return bad


def _named(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Give every model / recipe / target / engine / image set its own name (the key it is listed under)."""
    out = dict(raw)

    def name_all(section: Any, where: str) -> Any:
        if not isinstance(section, dict):
            return section
        named = {}
        for k, v in section.items():
            if isinstance(v, dict):
                if "name" in v:
                    raise KilnError(f"{path}: {where}.{_cut(str(k), 80)}.name: unknown key",
                                    "the name is the key it is listed under")
                v = {**v, "name": k}
            named[k] = v
        return named

    for key in ("models", "targets", "engines", "systems"):
        if key in out:
            out[key] = name_all(out[key], key)
    if isinstance(out.get("quantize"), dict) and "recipes" in out["quantize"]:
        out["quantize"] = {**out["quantize"], "recipes": name_all(out["quantize"]["recipes"], "quantize.recipes")}
    if isinstance(out.get("data"), dict) and isinstance(out["data"].get("sets"), dict):
        out["data"] = {**out["data"], "sets": name_all(out["data"]["sets"], "data.sets")}
    return out


_UNKNOWN = ("unexpected_keyword_argument", "extra_forbidden")
_MISSING = ("missing", "missing_argument")


def _key_path(loc: tuple) -> tuple[str, ...]:
    """The user's key path: without the member tags pydantic adds inside unions and validators."""
    return tuple(str(x) for x in loc if not (isinstance(x, str) and (x in ("int", "float", "str", "bool", "none")
                                                                     or "[" in x or x.startswith("function-"))))


def _first_error(path: Path, e: ValidationError) -> KilnError:
    """One clear line for the most useful error: unknown keys first (with the likely intended key), then the rest;
    a value that fails both branches of a number union reports the float branch's reason."""
    import difflib

    errors = e.errors()
    errors.sort(key=lambda er: (er["type"] not in _UNKNOWN, er["type"] in _MISSING))
    err = next((er for er in errors if str(er["loc"][-1]).startswith("float")), errors[0]) \
        if errors[0]["type"] not in _UNKNOWN else errors[0]
    loc = _key_path(err["loc"])
    dotted = _cut(".".join(loc)) or "top level"
    kind, value = err["type"], err.get("input")
    if kind in _UNKNOWN:
        missing = [_key_path(er["loc"])[-1] for er in errors if er["type"] in _MISSING
                   and _key_path(er["loc"])[:-1] == loc[:-1]]
        close = difflib.get_close_matches(loc[-1], missing, n=1) if loc else []
        hint = f"did you mean `{close[0]}`?" if close else "check the spelling against the repository's params.yaml"
        return KilnError(f"{path}: {dotted}: unknown key", hint)
    if kind in _MISSING:
        return KilnError(f"{path}: {dotted}: missing", f"add `{loc[-1]}:` (see the repository's params.yaml)")
    if kind == "string_pattern_mismatch" and SLUG.pattern in str(err.get("ctx", {}).get("pattern", "")):
        return KilnError(f"{path}: {dotted}: {_quote(value)} is not a valid name",
                         "names become paths: use 1-64 letters, digits, '-' or '_', starting with a letter or digit")
    shown = "a mapping" if isinstance(value, dict) else _quote(value)
    return KilnError(f"{path}: {dotted}: {_cut(err['msg'].rstrip('.'))} (got {shown})", "fix the value in params.yaml")


# ---------------------------------------------------------------------------------------------- reading YAML
MAX_BYTES = 1 << 20      # params.yaml is ~18 kB, a profile ~2 kB
MAX_NODES = 50_000       # values once aliases are expanded (params.yaml: ~700): a billion-laughs chain stops here
MAX_DEPTH = 32           # nesting once aliases are expanded (params.yaml: 6); libyaml itself stops at 1000
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _quote(value: Any) -> str:
    """A user's value as an error quotes it: abridged (never a whole alias-expanded value)."""
    return _cut(_repr.repr(value), 100)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _check_graph(root: yaml.Node) -> None:
    """Walk the composed nodes once, before any value is built. Aliases are shared nodes, so a sizes memo makes
    an exponential alias chain cost what its text costs; a value that would expand past MAX_NODES / MAX_DEPTH, an
    alias into its own collection and a key given twice in one mapping (the last would silently win, where DVC
    refuses the file) are refused with their line."""
    done: dict[int, tuple[int, int]] = {}       # id(node) → (nodes, depth) once expanded
    open_: set[int] = set()                     # the nodes on the path being walked
    stack = [root]
    while stack:
        node = stack[-1]
        if id(node) in done:
            stack.pop()
            continue
        kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else
                node.value if isinstance(node, yaml.SequenceNode) else [])
        if id(node) not in open_:
            open_.add(id(node))
            if isinstance(node, yaml.MappingNode):
                _unique_keys(node)
            for kid in kids:
                if id(kid) in open_:
                    raise KilnError(f"line {_line(kid)}: an alias refers to a collection that contains it",
                                    "a value cannot contain itself: write it out")
            stack.extend(kids)
            continue
        open_.discard(id(node))
        stack.pop()
        nodes = 1 + sum(done[id(k)][0] for k in kids)
        depth = 1 + max((done[id(k)][1] for k in kids), default=0)
        if nodes > MAX_NODES or depth > MAX_DEPTH:
            raise KilnError(f"line {_line(node)}: this value, aliases expanded, "
                            + (f"holds more than {MAX_NODES} values" if nodes > MAX_NODES
                               else f"is nested more than {MAX_DEPTH} levels deep"),
                            "a params file is small and shallow: check its anchors (&) and aliases (*)")
        done[id(node)] = (nodes, depth)


def _unique_keys(node: yaml.MappingNode) -> None:
    first: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode):       # `<<` too: DVC (ruamel) refuses two merge keys
            if (key.tag, key.value) in first:
                raise KilnError(f"line {_line(key)}: duplicate key `{_cut(key.value, 80)}` (first on line "
                                f"{first[key.tag, key.value]})", "keep one of them: the last would silently win")
            first[key.tag, key.value] = _line(key)


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):     # libyaml: ~10x faster than the pure-Python one
    def construct_document(self, node):
        _check_graph(node)
        return super().construct_document(node)

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:      # a tagged value that does not parse, e.g. a date 2020-13-45
            raise yaml.constructor.ConstructorError(None, None, _cut(str(e)), node.start_mark) from None


def read_yaml(path: Path, not_found_hint: str) -> Any:
    """A user's YAML file (params.yaml, a profile), read within bounds: a regular file of at most MAX_BYTES, UTF-8,
    its values bounded as `_check_graph` says. Every failure is a KilnError naming the file (and the line)."""
    path = Path(path)
    with open_regular(path, "pass the path of a YAML file", (f"{path}: not found", not_found_hint)) as f:
        try:
            data = f.read(MAX_BYTES + 1)
        except OSError as e:
            raise KilnError(f"{path}: cannot read it ({e.strerror})", "pass the path of a readable YAML file") \
                from None
    if len(data) > MAX_BYTES:
        raise KilnError(f"{path}: larger than {MAX_BYTES >> 20} MiB", "check that this is the right file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KilnError(f"{path}: not UTF-8 text (byte {e.start})", "save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_Loader)
    except KilnError as e:
        raise KilnError(f"{path}: {e.message}", e.hint) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}: " if mark else ""
        raise KilnError(f"{path}: invalid YAML: {where}{_cut(e.problem or e.context or '')}",
                        "fix the YAML syntax (quote a value meant as text)") from None
    except yaml.YAMLError as e:
        raise KilnError(f"{path}: invalid YAML: {_cut(str(e).splitlines()[0])}", "fix the YAML syntax") \
            from None
    except RecursionError:                       # the pure-Python loader (no libyaml) on deep nesting
        raise KilnError(f"{path}: invalid YAML: nested too deeply", "a params file is a few levels deep") from None


def load(path: Path = DEFAULT_PARAMS) -> Config:
    path = Path(path)
    raw = read_yaml(path, "run kiln from the repository root, or pass --params PATH")
    if not isinstance(raw, dict):
        raise KilnError(f"{path}: must be a mapping of sections", "see the repository's params.yaml")
    try:
        params = TypeAdapter(Params).validate_python(_named(raw, path))
    except ValidationError as e:
        raise _first_error(path, e) from None
    if bad := _cross_check(params):
        key, problem, hint = bad[0]
        raise KilnError(f"{path}: {key}: {_cut(problem)}", _cut(hint))     # a problem may quote a value
    return Config(path, raw, params)
