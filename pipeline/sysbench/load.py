"""sysbench@'s sustained-load sweep: kiln_runtime/loadtest.py — the one implementation, which `kiln-run bench` runs
on a release — with the plan of params `sysbench:` and worker processes that each build the checkout's gated system
(`checkout_system`). How a point runs, when the sweep stops and how workers stop: kiln_runtime/loadtest.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln_runtime import loadtest
from kiln_runtime.loadtest import WARMUP_S, Plan, cores  # noqa: F401

if TYPE_CHECKING:
    from pipeline.config import Config


def plan(cfg: Config) -> Plan:
    """The sweep for this machine: workers one per core unless params say, threads per engine = cores / workers."""
    sb = cfg.sysbench
    if not sb.streams:              # (checked here, not in config.py's schema: every stage tracks config.py)
        from pipeline.errors import KilnError

        raise KilnError(f"{cfg.source}: sysbench.streams is empty: nothing to sweep",
                        "list stream counts, smallest first (e.g. [1, 2, 4, 8])")
    n = cores()
    workers = sb.workers or n
    return Plan(tuple(sb.streams), sb.fps, sb.seconds, sb.p99_budget_ms, sb.max_batch, workers,
                max(1, n // workers))


def checkout_system(threads: int, params: str, root: str, system: str, picks: dict[str, str]):
    """A worker's system: `picks` of the checkout's engines, each verified as it loads, `threads` intra-op threads
    per engine, the golden gallery enrolled."""
    from pipeline import config
    from pipeline.e2e import System

    cfg = config.load(Path(params))
    s = System.from_picks(cfg, system, picks, Path(root), system=system, threads=threads)
    s.enroll(Path(root))
    return s


def sweep(cfg: Config, system: str, picks: dict[str, str], frames: list[np.ndarray], root: Path = Path("."),
          params: Path = Path("params.yaml"), progress=print) -> dict:
    """Run the sweep for `system` (engines `picks`); the points, the headline and what was picked."""
    return loadtest.sweep(plan(cfg), f"sysbench@{system}", "pipeline.sysbench.load:checkout_system",
                          {"params": str(params), "root": str(root), "system": system, "picks": dict(picks)},
                          frames, progress, hint=f"run system@{system} first (dvc repro) and check that its engines "
                          f"load: kiln identify --system {system}")
