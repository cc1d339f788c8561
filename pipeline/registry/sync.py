"""`kiln registry sync`: register every built, validated engine and chosen index, what a new or lost registry needs.

Each artifact is registered by its own stage's `run` (register@<engine>, register-index@<size>), loaded by name as
`kiln <stage>` loads a stage (pipeline/cli/parser.py), so the receipt sync writes is the one `dvc repro` writes and the
engine's bench gate applies. Idempotent by content (pipeline/registry/registration.py).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.errors import GateFailed
from pipeline.registry import registration as reg
from pipeline.registry.receipts import REPAIRED

if TYPE_CHECKING:
    from pipeline.config import Config


def _run(module: str):
    """A stage's `run`, loaded by name: no module imports a stage module."""
    return importlib.import_module(f"pipeline.stages.{module}").run


def sync(cfg: Config, root: Path = Path("."), progress=print) -> list[reg.Receipt]:
    """Register every built, validated engine and chosen index (idempotent): what a new or lost registry needs.
    Artifacts not built here, or whose verdict is a failure, are reported and skipped."""
    out = []
    run = _run("register")
    jobs = [(e, lambda e=e: run(cfg, e, root), reg.engine_registrable(cfg, e, root)) for e in cfg.engines]
    run_index = _run("register_index")
    jobs += [(paths.gallery_name(s), lambda s=s: run_index(cfg, s, root), reg.index_registrable(cfg, s, root))
             for s in cfg.matching.gallery_sizes]
    for name, job, art in jobs:
        if not art.manifest_file.is_file() or not art.verdict_manifest.is_file():
            progress(f"registry sync: {name}: not built or not validated here; skipped")
            continue
        try:
            r = job()
        except GateFailed as e:
            progress(f"registry sync: {name}: not registered: {e.message}")
            continue
        progress(f"registry sync: {name}: {'registered new version' if r.new else 'already registered as'} "
                 f"{r.name} v{r.version}{REPAIRED if r.repaired else ''}")
        out.append(r)
    return out
