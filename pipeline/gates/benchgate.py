"""One engine's bench verdict, alone and without timings: written by bench@<model>, read by register@<engine>.

bench@ times every engine of a model side by side; its timings are records (never cached, never the same twice).
What registration needs from it is only the verdict — an INT8 engine must beat its FP32 sibling by the margin, with
confidence (pipeline/gates/timing.py `int8_decision`) — so each engine's verdict is its own small file in a cached
directory (`artifacts/bench/<model>/gate/<engine>.json`) holding the digests of the builds it is about (the engine,
its validation verdict, the FP32 sibling of an INT8 engine), the gate applied and its verdict: pass / not-faster-here
(an INT8 engine that does not pay on this host class: registrable, never a leaderboard winner, said in promote's
record) / not-run / fail (written by older benches; register@ refuses it without --allow-failed). The same builds and
verdicts give the same bytes: a bench rerun, or another engine added to the model (another host's target), stales
no registration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.dvcfiles import address
from pipeline.errors import KilnError
from pipeline.manifest import (atomic_dir, build_manifest, input_ref, manifest_path, verify_manifest,
                               write_json_atomic, write_manifest)

if TYPE_CHECKING:
    from pipeline.config import Config

NOT_FASTER = "not-faster-here"
VERDICTS = ("pass", "fail", "not-run", NOT_FASTER)


def directory(model: str, root: Path = Path(".")) -> Path:
    """artifacts/bench/<model>/gate: bench@<model>'s one cached output (register@ depends on single files in it)."""
    return paths.bench(model, root) / "gate"


def path(model: str, engine_name: str, root: Path = Path(".")) -> Path:
    """artifacts/bench/<model>/gate/<engine>.json"""
    return directory(model, root) / f"{paths.slug(engine_name, 'engine')}.json"


def fp32_sibling(e, engines: list):
    """The FP32 engine of the same model on the same target: what an INT8 engine must beat."""
    return next((s for s in engines if s.target == e.target and s.precision == "fp32"), None)


def _sibling(cfg: Config, e):
    return fp32_sibling(e, cfg.engines_of(e.model)) if e.precision == "int8" else None


def refs(cfg: Config, e, root: Path = Path(".")) -> list[dict]:
    """The builds an engine's bench verdict is about, by their manifests' identity digests."""
    about = [e] + ([s] if (s := _sibling(cfg, e)) else [])
    return [*(input_ref(f"engine:{x.name}", manifest_path(paths.engine(x.name, root), x.name), root) for x in about),
            input_ref("validation", manifest_path(paths.validation(e.name, root), e.name), root)]


def doc(cfg: Config, e, verdict: str, root: Path = Path(".")) -> dict:
    assert verdict in VERDICTS, verdict
    s = _sibling(cfg, e)
    return {"kind": "bench-gate", "engine": e.name, "model": e.model, "verdict": verdict,
            # the speed-up floor is in the gate manifest's params, not here: a floor that moves and leaves the
            # verdict as it was re-registers nothing
            "gate": {"int8_vs": s.name, "batches": list(cfg.bench.batches)} if s else None,
            "inputs": refs(cfg, e, root)}


def write(cfg: Config, model: str, verdicts: dict[str, str], inputs: list[dict], identity: dict,
          root: Path = Path(".")) -> Path:
    """The gate directory of `model`, whole or not at all: one file per engine + a manifest over them (its inputs
    every engine and verdict benched, `identity` the bench stage's code, params and toolchain)."""
    with atomic_dir(directory(model, root)) as g:
        files = []
        for name, verdict in sorted(verdicts.items()):
            files.append(g / path(model, name).name)
            write_json_atomic(files[-1], doc(cfg, cfg.engine(name), verdict, root))
        write_manifest(g, build_manifest(
            kind="bench-gate", name=model, model=model, directory=g, files=files, inputs=inputs,
            build={"gate": "an INT8 engine must beat its FP32 sibling on the same target, at every benched batch: the "
                           "median of the per-round FP32/INT8 p50 ratios ≥ bench.int8_min_speedup (the margin) and "
                           "either their spread (max − min) < margin − 1 or every round's ratio ≥ margin; else "
                           "not-faster-here (not a failure)",
                   "timings": "none: the same builds and verdicts give the same bytes"},
            results={"verdicts": dict(sorted(verdicts.items()))}, **identity))
    return directory(model, root)


def check(cfg: Config, engine_name: str, root: Path = Path(".")) -> str | None:
    """The bench verdict of `engine_name` (pass / fail / not-run / not-faster-here), or None when its model was not
    benched here.
    A verdict that does not match its manifest, or is about other builds than the current engine, its validation
    and its FP32 sibling, is refused."""
    e = cfg.engine(engine_name)
    f = path(e.model, engine_name, root)
    if not f.is_file():
        return None
    m = manifest_path(directory(e.model, root), e.model)
    problems = verify_manifest(m) if m.is_file() else [f"{m} is missing"]
    if problems:
        raise KilnError(f"{f}: the bench verdict does not verify: {'; '.join(problems)[:300]}",
                        f"rerun: dvc repro -f {address(f'bench@{e.model}')}")
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
        recorded, verdict = d["inputs"], d["verdict"]
    except (ValueError, KeyError, TypeError):
        recorded, verdict = None, None
    if verdict not in VERDICTS:
        raise KilnError(f"{f}: not a bench verdict", f"rerun: dvc repro -f {address(f'bench@{e.model}')}")
    if recorded != refs(cfg, e, root):
        raise KilnError(f"{f}: the bench verdict is about other builds than the current engine and its verdict",
                        f"rerun: dvc repro {address(f'bench@{e.model}')}")
    return verdict


__all__ = ["NOT_FASTER", "VERDICTS", "check", "directory", "doc", "fp32_sibling", "path", "refs", "write"]
