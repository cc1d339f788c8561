"""Building one engine: the artifact it compiles from, the target's compile into a directory and the target's audit
of what it built, under the target's fallback policy. compile@<engine> adds the manifest and the reproducibility
check; `kiln rebuild-check` rebuilds through the same stage.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, targets
from pipeline.toolchain import read_fingerprint
from pipeline.config import EngineSpec
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import manifest_path, read_verified
from pipeline.targets import source_kind
from pipeline.targets.base import CompileOptions, OpSupport

if TYPE_CHECKING:
    from pipeline.config import Config

# A program target's int8 engine is calibrated at compile (PT2E) on the stored calibration chips, streamed by
# pipeline.samples. It is loaded by name (`dynamic`), so that only those engines' stages depend on it and its
# imports (the detectors' code, image libraries); every other compile stage's closure stays as narrow as before.
SAMPLES = "pipeline.samples"


def samples_module():
    return importlib.import_module(SAMPLES)


def calibrates(cfg: Config, key: str) -> bool:
    e = cfg.engine(key)
    return source_kind(e.target) == "program" and e.precision == "int8"


def source_artifact(spec: EngineSpec, root: Path) -> tuple[Path, Path]:
    """The file an engine is compiled from and its manifest, by what the target compiles: the torch.export
    program (program targets), else the FP32 ONNX export or the recipe's INT8 QDQ model."""
    if source_kind(spec.target) == "program":
        d = paths.program(spec.model, root)
        return d / paths.PROGRAM_FILE, manifest_path(d, spec.model)
    if spec.precision == "int8":
        d = paths.quantized(spec.model, spec.recipe, root)
        return d / paths.ONNX_FILE, manifest_path(d, f"{spec.model}-{spec.recipe}")
    d = paths.export(spec.model, root)
    return d / paths.ONNX_FILE, manifest_path(d, spec.model)


def build(cfg: Config, engine_name: str, root: Path, out: Path) -> tuple[list[Path], OpSupport, list[str]]:
    """Compile into `out` and audit; the fallback policy may refuse. No manifest, no reproducibility check."""
    spec = cfg.engine(engine_name)
    targets.check(cfg, [engine_name])
    tcfg = cfg.targets[spec.target]
    if not tcfg.enabled:
        raise KilnError(f"engine {engine_name}: target {spec.target} is disabled in params.yaml",
                        f"set targets.{spec.target}.enabled: true, or drop the engine from `engines:`")
    fp = read_fingerprint(spec.target, root)
    if not fp["available"]:
        raise KilnError(f"engine {engine_name}: {spec.target}: unavailable ({fp['reason']}); not built",
                        "build it on a host that has this toolchain, or drop the engine from `engines:`")
    src, src_manifest = source_artifact(spec, root)
    read_verified(src_manifest)             # the source must be exactly what its manifest says, before use
    target = targets.get(spec.target)
    calibration = (samples_module().stream(cfg, spec.model, "calibration", root) if calibrates(cfg, engine_name)
                   else None)
    tuning = paths.tuning(engine_name, root) if targets.tuned(cfg, engine_name) else None
    if tuning is not None:
        read_verified(manifest_path(tuning, engine_name))       # the database is what tune@ recorded
    options = CompileOptions(spec.precision, targets.options(cfg, spec.target), calibration, tuning)
    with tempfile.TemporaryDirectory(prefix="kiln-compile-") as work:
        files = target.compile(src, options, out, Path(work))
    audit = target.audit(out, spec.precision)
    warnings = [f"{f['node']} ({f['op']}) runs as {f['runs_as']}" for f in audit.fallback]
    if warnings and tcfg.fallback_policy == "fail":
        raise GateFailed(f"compile@{engine_name}: {len(warnings)} compute nodes fell back from {spec.precision}: "
                         + "; ".join(warnings[:5]), f"fix the quantization recipe, or set targets.{spec.target}"
                         ".fallback_policy: warn to accept it")
    return files, audit, warnings
