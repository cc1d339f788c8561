"""The golden samples a system release carries (kiln_runtime/golden.py reads them): a few real inputs of each part's
model from the build's golden feed, and what the shipped engine gives for them on this host — which must run the
engine's gated runtime (its requirement, kiln_runtime/requirements.py), or the recorded outputs would be another
runtime's. `kiln-run … --allow-runtime-drift` re-runs an engine on them on a host whose runtime differs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln_runtime import golden, requirements, runners
from kiln_runtime.errors import KilnError
from pipeline import samples

if TYPE_CHECKING:
    from pipeline.config import Config


def write(cfg: Config, tree: Path, parts: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    """golden/<engine>/ for every part; release.json's `golden` entry (limits, each engine's files and samples)."""
    engines = {}
    for part in parts:
        req = part["runtime"]
        if found := requirements.drifts(req):
            raise KilnError(f"{part['engine']}: this host cannot record its golden outputs: {'; '.join(found)}",
                            "release from a host with the runtime the engine was gated with (the build's lock)")
        runner = runners.load(req["target"], tree / part["dir"], part["engine"], threads=1)
        feeds = golden.pick(samples.feeds(cfg, part["model"], "golden", root))
        files, count = golden.record(runner, feeds)
        gdir = tree / golden.DIR / part["engine"]
        gdir.mkdir(parents=True)
        for name, data in sorted(files.items()):
            (gdir / name).write_bytes(data)
        engines[part["engine"]] = {"files": sorted(files), "samples": count}
    return {"limits": dict(golden.LIMITS), "engines": engines}
