"""The tensorrt target's options (params.yaml `targets.tensorrt`), parsed and checked without TensorRT: the target
(pipeline/targets/tensorrt.py) builds from them, and trt-audit@ (pipeline/targets/trt_static.py) reads its audit
settings from them without loading the target module and the packages it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.errors import KilnError
from pipeline.targets.trt_onnx import PRECISIONS

HW_LEVELS = {"none": "NONE", "ampere_plus": "AMPERE_PLUS", "same_compute_capability": "SAME_COMPUTE_CAPABILITY"}
CACHE_MODES = ("reuse", "strict", "off")


# ---------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class TrtOptions:
    min_batch: int = 1
    opt_batch: int = 8
    max_batch: int = 32
    builder_optimization_level: int = 3
    workspace_mib: int = 2048
    timing_cache_dir: str = "artifacts/cache/tensorrt"
    timing_cache_mode: str = "reuse"
    hardware_compatibility: str = "none"
    version_compatible: bool = False
    audit_precisions: tuple[str, ...] = ("fp32", "fp16", "int8")
    int8_recipe: str = "symmetric"

    @classmethod
    def parse(cls, options: dict[str, Any]) -> "TrtOptions":
        """params.yaml `targets.tensorrt` (less enabled/fallback_policy) → validated options; errors name the key."""
        def fail(key: str, problem: str, hint: str) -> KilnError:
            return KilnError(f"targets.tensorrt.{key}: {problem}", hint)

        def integer(d: dict, key: str, default: int, lo: int, hi: int | None = None, where: str = "") -> int:
            v = d.get(key, default)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
                raise fail(where + key, f"must be an integer in [{lo}, {hi if hi is not None else '∞'}], got {v!r}",
                           "fix the value in params.yaml")
            return v

        known = {"profile", "builder_optimization_level", "workspace_mib", "timing_cache", "hardware_compatibility",
                 "version_compatible", "static_audit"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise fail(unknown[0], "unknown option", f"known options: {', '.join(sorted(known))}")
        prof = options.get("profile", {}) or {}
        if not isinstance(prof, dict):
            raise fail("profile", "must be a mapping {min_batch, opt_batch, max_batch}", "e.g. {min_batch: 1, ...}")
        lo = integer(prof, "min_batch", cls.min_batch, 1, where="profile.")
        opt = integer(prof, "opt_batch", cls.opt_batch, 1, where="profile.")
        hi = integer(prof, "max_batch", cls.max_batch, 1, where="profile.")
        if not lo <= opt <= hi:
            raise fail("profile", f"needs min_batch ≤ opt_batch ≤ max_batch, got {lo}/{opt}/{hi}",
                       "TensorRT rejects a profile whose opt lies outside [min, max]")
        cache = options.get("timing_cache", {}) or {}
        if not isinstance(cache, dict):
            raise fail("timing_cache", "must be a mapping {dir, mode}", "e.g. {dir: artifacts/cache/tensorrt}")
        mode = cache.get("mode", cls.timing_cache_mode)
        if mode not in CACHE_MODES:
            raise fail("timing_cache.mode", f"unknown mode {mode!r}", f"use one of {', '.join(CACHE_MODES)}")
        hw = options.get("hardware_compatibility", cls.hardware_compatibility)
        if hw not in HW_LEVELS:
            raise fail("hardware_compatibility", f"unknown level {hw!r}", f"use one of {', '.join(HW_LEVELS)}")
        vc = options.get("version_compatible", False)
        if not isinstance(vc, bool):
            raise fail("version_compatible", f"must be true or false, got {vc!r}", "fix the value in params.yaml")
        sa = options.get("static_audit", {}) or {}
        precs = tuple(sa.get("precisions", cls.audit_precisions))
        if not set(precs) <= set(PRECISIONS):
            raise fail("static_audit.precisions", f"unknown precision in {list(precs)}", "use fp32, fp16, int8")
        return cls(lo, opt, hi, integer(options, "builder_optimization_level", 3, 0, 5),
                   integer(options, "workspace_mib", cls.workspace_mib, 1), str(cache.get("dir", cls.timing_cache_dir)),
                   mode, hw, vc, precs, str(sa.get("int8_recipe", cls.int8_recipe)))
