"""params.yaml → frozen dataclasses. All validation and every user-facing configuration error lives here.

Stages receive typed, already-validated options; nothing downstream re-reads params.yaml or checks a value again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import KilnError

DEFAULT_PARAMS = Path("params.yaml")


class _Reader:
    """Walks a nested mapping and raises one clear error naming the file and the dotted key."""

    def __init__(self, source: Path, data: Any, where: str = "") -> None:
        self.source, self.data, self.where = source, data, where

    def fail(self, key: str, problem: str, hint: str) -> KilnError:
        dotted = f"{self.where}.{key}" if self.where else key
        return KilnError(f"{self.source}: {dotted}: {problem}", hint)

    def section(self, key: str) -> "_Reader":
        value = self.get(key, dict)
        return _Reader(self.source, value, f"{self.where}.{key}" if self.where else key)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., hint: str = "") -> Any:
        if not isinstance(self.data, dict):
            raise KilnError(f"{self.source}: {self.where or 'top level'} must be a mapping", "fix the YAML structure")
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "missing", hint or f"add `{key}:` (see the defaults in the repository's params.yaml)")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.fail(key, f"must be {names}, got {value!r}", hint or "fix the value in params.yaml")
        return value

    def number(self, key: str, lo: float | None = None, hi: float | None = None, default: Any = ...) -> float:
        value = self.get(key, float, default)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.fail(key, f"{value} is outside [{lo}, {hi}]", "choose a value in range")
        return value

    def integer(self, key: str, lo: int | None = None, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if lo is not None and value < lo:
            raise self.fail(key, f"{value} must be ≥ {lo}", "choose a larger value")
        return value


@dataclass(frozen=True)
class Augment:
    max_rotation_deg: float
    max_scale: float
    max_shift: float
    flip: bool
    brightness: tuple[float, float]


@dataclass(frozen=True)
class SetSpec:
    name: str
    per_photo: int
    seed: int


@dataclass(frozen=True)
class DataConfig:
    photos: Path
    chip_size: int
    template: tuple[tuple[float, float], ...]
    min_face_size: int
    augment: Augment
    sets: dict[str, SetSpec]


SAMPLE_KINDS = ("chips", "pnet", "rnet", "onet", "aligner")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    factory: str          # "module:callable", called with the weights path (or nothing when weights is None)
    weights: Path | None
    input_shape: tuple[int, ...]         # one sample, for benchmarks (P-Net: a typical pyramid level)
    verify_threshold: float | None       # embedders: same person when L2 < threshold
    samples: str                         # which inputs this graph sees (pipeline/samples.py)
    dynamic: dict[str, tuple[int, ...]]  # input name → dynamic axes in the exported ONNX
    parity_max_abs: float | None         # overrides export.parity.max_abs for this graph's output scale


@dataclass(frozen=True)
class ExportConfig:
    opset: int
    exporter: str
    parity_max_abs: float
    parity_min_cosine: float


@dataclass(frozen=True)
class CalibrateConfig:
    method: str           # minmax | percentile | entropy
    percentile: float
    bins: int
    batch: int


@dataclass(frozen=True)
class Recipe:
    name: str
    weights: str          # s8
    activations: str      # u8 | s8
    per_channel: bool
    symmetric_activations: bool
    bias_float: bool      # leave biases in float (TensorRT form) instead of int32


@dataclass(frozen=True)
class TargetConfig:
    name: str
    enabled: bool
    options: dict[str, Any]   # target-specific, validated by the target module
    fallback_policy: str      # warn | fail


@dataclass(frozen=True)
class EngineSpec:
    name: str             # e.g. embedder-ort-cpu-int8
    model: str
    target: str
    precision: str        # fp32 | fp16 | int8
    recipe: str | None    # quantization recipe for int8
    source: str = ""      # the artifact compiled (artifacts/export|quantized|program/…), as in dvc.yaml


@dataclass(frozen=True)
class ValidateConfig:
    cosine_min: float
    cosine_mean: float
    l2_max: float
    top1_agreement_min: float
    decision_agreement_min: float
    tar_delta_max: float
    far_delta_max: float
    detector: "DetectorGate"
    aligner: "AlignerGate"


@dataclass(frozen=True)
class DetectorGate:
    box_iou_min: float           # every reference face matched by an engine face with at least this IoU
    landmark_err_max: float      # max landmark error, as a fraction of the inter-ocular distance
    face_agreement_min: float    # lfw_subset face / non-face decisions equal to the reference (R-/O-Net)


@dataclass(frozen=True)
class AlignerGate:
    pixel_mae_max: float         # mean |Δ| of chip pixels (0..255) vs the reference warp
    pixel_max_abs_max: float


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...]
    warmup: int
    min_runs: int
    min_seconds: float
    int8_min_speedup: float


@dataclass(frozen=True)
class RegisterConfig:
    experiment: str
    sqlite_path: Path


@dataclass(frozen=True)
class Config:
    source: Path
    raw: dict[str, Any]
    assets_dir: Path
    data: DataConfig
    models: dict[str, ModelConfig]
    export: ExportConfig
    calibrate: CalibrateConfig
    recipes: dict[str, Recipe]
    targets: dict[str, TargetConfig]
    engines: dict[str, EngineSpec]
    validate: ValidateConfig
    bench: BenchConfig
    register: RegisterConfig
    matching: "MatchingConfig | None" = None   # None when params.yaml has no matching: section

    def engine(self, name: str) -> EngineSpec:
        if name not in self.engines:
            raise KilnError(f"{self.source}: engines: no engine named {name!r}",
                            f"known engines: {', '.join(sorted(self.engines))}")
        return self.engines[name]

    def engines_of(self, model: str) -> list[EngineSpec]:
        return [e for e in self.engines.values() if e.model == model]

    def model(self, name: str) -> ModelConfig:
        if name not in self.models:
            raise KilnError(f"{self.source}: models: no model named {name!r}",
                            f"known models: {', '.join(sorted(self.models))}")
        return self.models[name]

    def section(self, *keys: str) -> Any:
        """The raw values of one section, for the params hash recorded in manifests."""
        value: Any = self.raw
        for k in keys:
            value = value[k]
        return value


def _pairs(r: _Reader, key: str, n: int | None = None) -> tuple[tuple[float, float], ...]:
    value = r.get(key, list)
    ok = all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p) for p in value)
    if not ok or (n is not None and len(value) != n):
        raise r.fail(key, f"must be a list of {n or 'N'} [x, y] pairs", "e.g. [[46.4, 44.1], ...]")
    return tuple((float(x), float(y)) for x, y in value)


def _data(r: _Reader) -> DataConfig:
    a = r.section("augment")
    bright = a.get("brightness", list)
    if len(bright) != 2 or not all(isinstance(v, (int, float)) for v in bright) or not 0 < bright[0] <= bright[1]:
        raise a.fail("brightness", f"must be [low, high] with 0 < low ≤ high, got {bright!r}", "e.g. [0.75, 1.25]")
    augment = Augment(a.number("max_rotation_deg", 0, 45), a.number("max_scale", 0, 0.5),
                      a.number("max_shift", 0, 0.5), a.get("flip", bool), (float(bright[0]), float(bright[1])))
    s = r.section("sets")
    sets = {}
    for name in ("golden", "calibration"):
        spec = s.section(name)
        sets[name] = SetSpec(name, spec.integer("per_photo", 1), spec.integer("seed", 0))
    return DataConfig(Path(r.get("photos", str)), r.integer("chip_size", 16), _pairs(r, "template", 5),
                      r.integer("min_face_size", 12), augment, sets)


def _model(name: str, r: _Reader) -> ModelConfig:
    factory = r.get("factory", str)
    if ":" not in factory:
        raise r.fail("factory", f"{factory!r} is not 'module:callable'", "e.g. pipeline.models.dlib_resnet:build_embedder")
    shape = r.get("input_shape", list)
    if not shape or not all(isinstance(v, int) and v > 0 for v in shape):
        raise r.fail("input_shape", f"must be positive integers (C, H, W), got {shape!r}", "e.g. [3, 150, 150]")
    samples = r.get("samples", str, "chips")
    if samples not in SAMPLE_KINDS:
        raise r.fail("samples", f"unknown kind {samples!r}", f"use one of {', '.join(SAMPLE_KINDS)}")
    dynamic = r.get("dynamic", dict, {"input": [0]})
    if not all(isinstance(k, str) and isinstance(v, list) and all(isinstance(a, int) and a >= 0 for a in v)
               for k, v in dynamic.items()):
        raise r.fail("dynamic", f"must map input names to lists of axes, got {dynamic!r}", "e.g. {input: [0, 2, 3]}")
    weights = r.get("weights", (str, type(None)), None)
    threshold = r.number("verify_threshold", 0, default=None) if "verify_threshold" in r.data else None
    parity = r.number("parity_max_abs", 0, default=None) if "parity_max_abs" in r.data else None
    return ModelConfig(name, factory, None if weights is None else Path(weights), tuple(shape), threshold, samples,
                       {k: tuple(v) for k, v in dynamic.items()}, parity)


def _export(r: _Reader) -> ExportConfig:
    exporter = r.get("exporter", str)
    if exporter not in ("torchscript", "dynamo"):
        raise r.fail("exporter", f"unknown exporter {exporter!r}", "use torchscript or dynamo")
    opset = r.integer("opset", 17)
    p = r.section("parity")
    return ExportConfig(opset, exporter, p.number("max_abs", 0), p.number("min_cosine", -1, 1))


def _calibrate(r: _Reader) -> CalibrateConfig:
    method = r.get("method", str)
    if method not in ("minmax", "percentile", "entropy"):
        raise r.fail("method", f"unknown calibration method {method!r}", "use minmax, percentile or entropy")
    return CalibrateConfig(method, r.number("percentile", 90, 100), r.integer("bins", 128), r.integer("batch", 1))


def _recipes(r: _Reader) -> dict[str, Recipe]:
    out = {}
    for name in r.data:
        q = r.section(name)
        w, a = q.get("weights", str), q.get("activations", str)
        if w != "s8":
            raise q.fail("weights", f"{w!r} is not supported", "use s8 (signed 8-bit weights)")
        if a not in ("u8", "s8"):
            raise q.fail("activations", f"{a!r} is not supported", "use u8 or s8")
        out[name] = Recipe(name, w, a, q.get("per_channel", bool), q.get("symmetric_activations", bool),
                           q.get("bias_float", bool))
    return out


def _targets(r: _Reader) -> dict[str, TargetConfig]:
    out = {}
    for name in r.data:
        t = r.section(name)
        policy = t.get("fallback_policy", str, "warn")
        if policy not in ("warn", "fail"):
            raise t.fail("fallback_policy", f"unknown policy {policy!r}", "use warn or fail")
        options = {k: v for k, v in t.data.items() if k not in ("enabled", "fallback_policy")}
        out[name] = TargetConfig(name, t.get("enabled", bool, True), options, policy)
    return out


def _engines(r: _Reader, models: dict, recipes: dict, targets: dict,
             program_models: tuple[str, ...] = ()) -> dict[str, EngineSpec]:
    out = {}
    for name in r.data:
        e = r.section(name)
        model, target, precision = e.get("model", str), e.get("target", str), e.get("precision", str)
        recipe = e.get("recipe", str, None)
        if model not in models:
            raise e.fail("model", f"no model named {model!r}", f"known models: {', '.join(sorted(models))}")
        if target not in targets:
            raise e.fail("target", f"no target named {target!r}", f"configure it under targets: ({', '.join(targets)})")
        if precision not in ("fp32", "fp16", "int8"):
            raise e.fail("precision", f"unknown precision {precision!r}", "use fp32, fp16 or int8")
        if precision == "int8" and recipe not in recipes:
            raise e.fail("recipe", f"int8 needs a quantization recipe, got {recipe!r}",
                         f"name one of quantize.recipes: {', '.join(sorted(recipes))}")
        if "onnx" in e.data:
            raise e.fail("onnx", "the key is now `source:` (the artifact compiled: ONNX or torch.export program)",
                         f"rename `onnx:` to `source:` in engines.{name}")
        source, kind = e.get("source", str).rstrip("/"), source_kind(target)
        if kind == "program":
            if precision != "fp32":
                raise e.fail("precision", f"{target} compiles the FP32 torch.export program; {precision} is not built",
                             "use precision: fp32 for this target")
            if model not in program_models:
                raise e.fail("model", f"{model!r} has no torch.export program: it is not in program.models",
                             f"add {model} to program.models in params.yaml")
            expected = f"artifacts/program/{model}"
        else:
            expected = f"artifacts/quantized/{model}-{recipe}" if precision == "int8" else f"artifacts/export/{model}"
        if source != expected:
            raise e.fail("source", f"{source!r} is not the artifact a {precision} {target} engine of {model!r} "
                         "compiles", f"set it to {expected}")
        out[name] = EngineSpec(name, model, target, precision, recipe if precision == "int8" else None, expected)
    return out


def source_kind(target: str) -> str:
    """What a target compiles: "onnx" (artifacts/export, artifacts/quantized) or "program" (artifacts/program).

    Declared by the target class (`source_kind`); a target configured but not registered is taken as ONNX."""
    from pipeline.targets import TARGETS

    return getattr(TARGETS.get(target), "source_kind", "onnx")


def _program_models(r: _Reader, models: dict) -> tuple[str, ...]:
    """params `program.models`: the models whose torch.export program is saved (program@<model>)."""
    if not isinstance(r.data, dict) or "program" not in r.data:
        return ()
    p = r.section("program")
    names = p.get("models", list)
    unknown = [m for m in names if m not in models]
    if unknown or not all(isinstance(m, str) for m in names):
        raise p.fail("models", f"unknown models {unknown or names!r}", f"known models: {', '.join(sorted(models))}")
    return tuple(names)


def _validate(r: _Reader) -> ValidateConfig:
    d, a = r.section("detector"), r.section("aligner")
    return ValidateConfig(r.number("cosine_min", -1, 1), r.number("cosine_mean", -1, 1), r.number("l2_max", 0),
                          r.number("top1_agreement_min", 0, 1), r.number("decision_agreement_min", 0, 1),
                          r.number("tar_delta_max", 0, 1), r.number("far_delta_max", 0, 1),
                          DetectorGate(d.number("box_iou_min", 0, 1), d.number("landmark_err_max", 0),
                                       d.number("face_agreement_min", 0, 1)),
                          AlignerGate(a.number("pixel_mae_max", 0), a.number("pixel_max_abs_max", 0)))


def _bench(r: _Reader) -> BenchConfig:
    batches = r.get("batches", list)
    if not batches or not all(isinstance(b, int) and b > 0 for b in batches):
        raise r.fail("batches", f"must be positive integers, got {batches!r}", "e.g. [1, 8]")
    return BenchConfig(tuple(batches), r.integer("warmup", 0), r.integer("min_runs", 1), r.number("min_seconds", 0),
                       r.number("int8_min_speedup", 0))


@dataclass(frozen=True)
class MatchingConfig:
    """params.yaml `matching:` — gallery sizes, the FAISS index sweep, and the targets the choice must meet."""

    sizes: tuple[int, ...]            # gallery sizes; one gallery@ / match@ / register-index@ stage each
    seed: int                         # distractors, queries, training samples
    queries: int                      # recall / latency queries (noisy copies of gallery rows, golden ones first)
    threads: int                      # FAISS OpenMP threads for builds and timed searches (recorded: IVF-PQ depends)
    recall_at_1_min: float            # the choice: cheapest index with recall@1 ≥ this …
    recall_at_10_min: float           # … and recall@10 ≥ this (recall@1 alone flatters IVF on near-duplicate queries)
    golden_top1_agreement_min: float  # identity gate: golden-identity queries' top-1 label as under exact search
    decision_agreement_min: float     # identity gate: open-set decisions (all queries) at verify_threshold
    nlist_per_sqrt_n: float           # `{nlist}` in the sweep = power of two nearest to this × sqrt(size)
    max_size: dict[str, int]          # index kinds left out above this gallery size
    sweep: tuple[str, ...]            # index spec templates (pipeline/matching/index.py), `{nlist}` substituted
    runs_b1: int
    runs_b64: int
    max_seconds: float                # per latency measurement; cuts runs short on slow (exact, 1M) indexes

    def nlist(self, size: int) -> int:
        import math

        return int(2 ** round(math.log2(max(1.0, self.nlist_per_sqrt_n * math.sqrt(size)))))

    def specs(self, size: int) -> list:
        """The parsed IndexSpecs of the sweep at one gallery size (kinds over their max_size left out)."""
        from pipeline.matching.index import IndexSpec

        out = []
        for text in self.sweep:
            sp = IndexSpec.parse(text.replace("{nlist}", str(self.nlist(size))))
            if size <= self.max_size.get(sp.kind, size):
                out.append(sp)
        return out

    def check_size(self, size: int) -> int:
        if size not in self.sizes:
            raise KilnError(f"gallery size {size} is not in matching.gallery_sizes {list(self.sizes)}",
                            "add it to params.yaml matching.gallery_sizes (dvc.yaml builds one stage per size)")
        return size


def _matching(r: _Reader) -> MatchingConfig | None:
    if not isinstance(r.data, dict) or "matching" not in r.data:
        return None
    m = r.section("matching")
    sizes = m.get("gallery_sizes", list)
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1000 for s in sizes) \
            or len(set(sizes)) != len(sizes):
        raise m.fail("gallery_sizes", f"must be distinct integers ≥ 1000, got {sizes!r}", "e.g. [10000, 100000, 1000000]")
    t = m.section("targets")
    r1 = t.get("recall_at_1_min", float)
    if not 0 < r1 <= 1:
        raise t.fail("recall_at_1_min", f"{r1} is outside (0, 1]; recall@1 can never exceed 1.0",
                     "set a fraction such as 0.99 (1.0 demands exact search: keep `flat` in the sweep)")
    sweep = m.get("sweep", list)
    if not sweep or not all(isinstance(s, str) for s in sweep):
        raise m.fail("sweep", f"must be a non-empty list of index specs, got {sweep!r}",
                     'e.g. [flat, sq8, "ivf-flat:nlist={nlist},nprobe=8"]')
    max_size = m.get("max_size", dict, {})
    if not set(max_size) <= {"flat", "sq8", "hnsw", "ivf-flat", "ivf-pq"} or \
            not all(isinstance(v, int) and v > 0 for v in max_size.values()):
        raise m.fail("max_size", f"must map index kinds to positive sizes, got {max_size!r}", "e.g. {hnsw: 100000}")
    lat = m.section("latency")
    cfg = MatchingConfig(tuple(sizes), m.integer("seed", 0), m.integer("queries", 64), m.integer("threads", 1), r1,
                         t.number("recall_at_10_min", 0, 1), t.number("golden_top1_agreement_min", 0, 1),
                         t.number("decision_agreement_min", 0, 1), m.number("nlist_per_sqrt_n", 0.01),
                         dict(max_size), tuple(sweep), lat.integer("runs_b1", 1), lat.integer("runs_b64", 1),
                         lat.number("max_seconds", 0.01))
    for size in cfg.sizes:
        try:
            specs = cfg.specs(size)
        except KilnError as e:
            raise m.fail("sweep", e.message, e.hint) from None
        for sp in specs:
            if "nlist" in sp.p and 39 * sp.p["nlist"] > size:
                raise m.fail("sweep", f"{sp.name} at gallery size {size}: {sp.p['nlist']} lists need ≥ "
                             f"{39 * sp.p['nlist']} training vectors", "lower nlist or nlist_per_sqrt_n")
        if not specs:
            raise m.fail("sweep", f"no index of the sweep is built at gallery size {size} (max_size)",
                         "keep at least one kind (flat or ivf-flat) without a max_size")
    return cfg


def load(path: Path = DEFAULT_PARAMS) -> Config:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path}: not found", "run kiln from the repository root, or pass --params PATH") from None
    except yaml.YAMLError as e:
        raise KilnError(f"{path}: invalid YAML: {e}".splitlines()[0], "fix the YAML syntax") from None
    r = _Reader(path, raw)
    if not isinstance(raw, dict):
        raise KilnError(f"{path}: must be a mapping of sections", "see the repository's params.yaml")
    models_r = r.section("models")
    models = {name: _model(name, models_r.section(name)) for name in models_r.data}
    recipes = _recipes(r.section("quantize").section("recipes"))
    targets = _targets(r.section("targets"))
    reg = r.section("register")
    return Config(path, raw, Path(r.section("assets").get("dir", str)), _data(r.section("data")), models,
                  _export(r.section("export")), _calibrate(r.section("calibrate")), recipes, targets,
                  _engines(r.section("engines"), models, recipes, targets, _program_models(r, models)),
                  _validate(r.section("validate")),
                  _bench(r.section("bench")), RegisterConfig(reg.get("experiment", str), Path(reg.get("sqlite_path", str))),
                  _matching(r))
