"""compile@<engine>: lower one model's ONNX (FP32 export or INT8 QDQ) for one target; audit what really runs.

The audit reads the compiled graph and lists compute nodes that fell back from the requested precision (e.g. a
Conv left in float inside an INT8 engine) — the "silent fallback" that passes functional tests and ruins latency.
The target's `fallback_policy` decides whether that warns (recorded in the manifest) or fails the stage.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline import paths, targets
from pipeline.config import Config, EngineSpec, source_kind
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import atomic_dir, build_manifest, input_ref, manifest_path, source_info, write_manifest
from pipeline.stages import fingerprint
from pipeline.targets.base import CompileOptions, OpSupport


@dataclass(frozen=True)
class CompileResult:
    directory: Path
    audit: OpSupport
    reproducible: bool | None
    warnings: list[str]


def source_artifact(spec: EngineSpec, root: Path) -> tuple[Path, Path]:
    """The file an engine is compiled from and its manifest, by the target's `source_kind`: the torch.export
    program (program targets), else the FP32 ONNX export or the recipe's INT8 QDQ model."""
    if source_kind(spec.target) == "program":
        from pipeline.stages.program import PROGRAM_FILE

        d = paths.program(spec.model, root)
        return d / PROGRAM_FILE, manifest_path(d, spec.model)
    if spec.precision == "int8":
        d = paths.quantized(spec.model, spec.recipe, root)
        return d / "model.onnx", manifest_path(d, f"{spec.model}-{spec.recipe}")
    d = paths.export(spec.model, root)
    return d / "model.onnx", manifest_path(d, spec.model)


def _digests(files: list[Path]) -> list[str]:
    return [hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(files)]


def run(cfg: Config, engine_name: str, root: Path = Path(".")) -> CompileResult:
    spec = cfg.engine(engine_name)
    tcfg = cfg.targets[spec.target]
    if not tcfg.enabled:
        raise KilnError(f"engine {engine_name}: target {spec.target} is disabled in params.yaml",
                        f"set targets.{spec.target}.enabled: true, or drop the engine from `engines:`")
    fp = fingerprint.read(spec.target, root)
    if not fp["available"]:
        raise KilnError(f"engine {engine_name}: {spec.target}: unavailable ({fp['reason']})",
                        "build it on a host that has this toolchain, or drop the engine from `engines:`")
    onnx_path, onnx_manifest = source_artifact(spec, root)
    if not onnx_path.is_file():
        raise KilnError(f"{onnx_path}: source artifact for {engine_name} not found", "run the upstream stages: dvc repro")
    target = targets.get(spec.target)
    options = CompileOptions(spec.precision, tcfg.options)
    out = paths.engine(engine_name, root)
    with atomic_dir(out) as d:
        files = target.compile(onnx_path, options, d)
        audit = target.audit(d, spec.precision)
        warnings = [f"{f['node']} ({f['op']}) runs as {f['runs_as']}" for f in audit.fallback]
        if warnings and tcfg.fallback_policy == "fail":
            raise GateFailed(f"compile@{engine_name}: {len(warnings)} compute nodes fell back from {spec.precision}: "
                             + "; ".join(warnings[:5]), f"fix the quantization recipe, or set targets.{spec.target}"
                             ".fallback_policy: warn to accept it")
        reproducible = None
        if getattr(target, "cheap_rebuild", False):  # compile again and compare bytes: is the engine reproducible?
            with tempfile.TemporaryDirectory(dir=d.parent) as again:
                reproducible = _digests(files) == _digests(target.compile(onnx_path, options, Path(again)))
        inputs = [input_ref(source_kind(spec.target), onnx_manifest, root)]  # role "onnx" or "program"
        # targets whose engines carry more than files (tensorrt: builder plan, inspector summary, equivalence)
        extras = target.manifest_extras(d) if hasattr(target, "manifest_extras") else {}
        write_manifest(d, build_manifest(
            kind="engine", name=engine_name, model=spec.model, target=spec.target, precision=spec.precision,
            directory=d, files=files, inputs=inputs, toolchain={**fp["rebuild_on"], **fp["info"]},
            build={"options": tcfg.options, "recipe": spec.recipe, "fallback_policy": tcfg.fallback_policy,
                   "deterministic": reproducible, **extras.get("build", {})},
            source=source_info(root, {"engine": cfg.section("engines", engine_name),
                                      "target": cfg.section("targets", spec.target)}),
            results={"audit": audit.summary(), "fallback_warnings": warnings, **extras.get("results", {})}))
    return CompileResult(out, audit, reproducible, warnings)
