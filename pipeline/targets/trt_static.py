"""The GPU-free TensorRT audit of a model's engine sources: which ONNX each audited precision's engine is built from
(`targets.tensorrt.static_audit`), its static audit (trt_onnx.static_audit → trt_rules), and where trt-audit@<model>
writes the report that fallback-table reads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.errors import KilnError
from pipeline.targets.trt_onnx import static_audit
from pipeline.targets.trt_options import TrtOptions

if TYPE_CHECKING:
    from pipeline.config import Config

TARGET = "tensorrt"


def _options(cfg: Config) -> TrtOptions:
    """targets.tensorrt's options, by the target's own parser (pipeline/targets/trt_options.py) but without loading
    the target module, so trt-audit@ and fallback-table do not depend on the TensorRT packages they never use."""
    try:
        return TrtOptions.parse(cfg.targets[TARGET].options)
    except KilnError as err:
        raise KilnError(f"{cfg.source}: {err.message}", err.hint) from None


def audited_models(cfg: Config) -> list[str]:
    """The models trt-audit@ audits: all of them, if params.yaml has a `tensorrt` target."""
    return list(cfg.models) if TARGET in cfg.targets else []


def int8_source(cfg: Config, model: str) -> list[str]:
    recipe = _options(cfg).int8_recipe
    return [paths.quantized(model, recipe).as_posix()] if model in cfg.quantize.models and recipe in cfg.recipes else []


def report_path(model: str, root: Path = Path(".")) -> Path:
    return paths.reports(root) / "trt-audit" / f"{paths.slug(model, 'model')}.json"


def source_for(cfg: Config, model: str, precision: str, root: Path) -> tuple[Path, str]:
    """The ONNX a `precision` TensorRT engine of `model` is built from, and how it is named in reports."""
    if precision == "int8":
        recipe = _options(cfg).int8_recipe
        return paths.quantized(model, recipe, root) / "model.onnx", f"artifacts/quantized/{model}-{recipe}"
    return paths.export(model, root) / "model.onnx", f"artifacts/export/{model}"


def audits(cfg: Config, model: str, root: Path = Path(".")) -> list[dict]:
    """One entry per audited precision: the static audit summary, or why it was skipped (no such ONNX here)."""
    if TARGET not in cfg.targets:
        raise KilnError(f"{cfg.source}: targets: no `{TARGET}` entry", "add targets.tensorrt (see params.yaml)")
    cfg.model(model)
    opts = _options(cfg)
    out = []
    for precision in opts.audit_precisions:
        onnx_path, label = source_for(cfg, model, precision, root)
        if not onnx_path.is_file():
            out.append({"precision": precision, "onnx": label, "skipped": f"{label}/model.onnx not built"})
            continue
        out.append({"onnx": label, **static_audit(onnx_path, precision).summary()})
    return out
