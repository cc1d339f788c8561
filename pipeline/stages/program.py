"""program@<model>: the `torch.export` program of a model (dynamic batch), saved as a .pt2 archive.

This is the source artifact of the program targets (`aoti-cpu`, later `aoti-cuda`), the way the ONNX export is the
source of the ONNX targets. The program is exported non-strict with the model's declared dynamic dimensions,
checked against the golden outputs (it runs the same ATen kernels as eager PyTorch, so parity is near-exact), and
saved with `torch.export.save`. torch records each node's Python stack trace (absolute source paths) in the
program; those are dropped before saving, so the bytes do not depend on where the checkout is. Whether the bytes
are reproducible is checked on every run by exporting once more in a fresh process and comparing sha256: a
mismatch fails the stage. The manifest says so (`build.reproducibility`).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline import models, paths, samples, stage
from pipeline.checkout import cli_env
from pipeline.config import ModelConfig
from pipeline.errors import GateFailed, KilnError
from pipeline.gates.agreement import compare, model_deps, print_parity
from pipeline.gates.reference import load_reference
from pipeline.manifest import (atomic_dir, build_manifest, file_input, input_ref, manifest_path, write_bytes_atomic,
                               write_manifest)
from pipeline.models.program import aten_ops, export_program, feed_runner, program_bytes
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config

PROGRAM_FILE = paths.PROGRAM_FILE

STAGE = stage.Stage(
    "program", "pipeline.stages.program",
    "PyTorch → torch.export program (.pt2, dynamic dims), parity-gated against golden; source of aoti-cpu",
    keys=lambda cfg: list(cfg.program.models), deps=model_deps,
    params=lambda cfg, key: [f"models.{key}", "export.parity", *samples.params(cfg, key)],
    dynamic=lambda cfg, key: [*models.factory_modules(cfg.model(key)), *roles.modules(cfg.model(key).samples)],
    outs=lambda cfg, key: [stage.Out(paths.program(key).as_posix())],
    portable=True,
    help="save a model's torch.export program (.pt2), parity-checked; the source of aoti-cpu")


@dataclass(frozen=True)
class ProgramResult:
    path: Path
    parity: dict
    ops: dict[str, int]
    deterministic: str


def build_model(mcfg: ModelConfig, root: Path) -> torch.nn.Module:
    return models.build(mcfg, root)


def bytes_in_fresh_process(params: Path, model_name: str, root: Path) -> bytes:
    """Export again in a new interpreter: the honest test of byte-reproducibility (hash seeds, ids, caches)."""
    with tempfile.TemporaryDirectory(dir=paths.program(model_name, root).parent) as tmp:
        out = Path(tmp) / PROGRAM_FILE
        r = subprocess.run([sys.executable, "-m", STAGE.module, "--params", str(Path(params).resolve()),
                            "--bytes-only", str(out), model_name], cwd=root, capture_output=True, text=True,
                           env=cli_env(), encoding="utf-8", errors="replace")
        if r.returncode != 0:
            raise KilnError(f"program@{model_name}: re-export in a fresh process failed: "
                            f"{(r.stderr.strip().splitlines() or ['?'])[-1]}", "run `kiln program` to see the error")
        return out.read_bytes()


def export_bytes(cfg: Config, model_name: str, root: Path) -> tuple[torch.export.ExportedProgram, bytes]:
    mcfg = cfg.model(model_name)
    ep = export_program(build_model(mcfg, root), mcfg, samples.feeds(cfg, model_name, "golden", root)[0])
    return ep, program_bytes(ep)


def run(cfg: Config, model_name: str, root: Path = Path("."), check_reproducible: bool = True) -> ProgramResult:
    mcfg = cfg.model(model_name)
    golden_dir = paths.golden(model_name, root)
    feeds = samples.feeds(cfg, model_name, "golden", root)
    _, reference = load_reference(golden_dir)
    ep, data = export_bytes(cfg, model_name, root)
    par = compare(feed_runner(ep), feeds, reference)   # vs the golden (eager PyTorch) outputs, as export@ does
    max_abs = cfg.export.parity.max_abs if mcfg.parity_max_abs is None else mcfg.parity_max_abs
    min_cos = cfg.export.parity.min_cosine
    if par["max_abs"] > max_abs or par["cosine_min"] < min_cos:
        raise GateFailed(f"program@{model_name}: exported program differs from PyTorch eager: max |Δ| "
                         f"{par['max_abs']:.3g} (limit {max_abs:g}), min cosine {par['cosine_min']:.7f} "
                         f"(limit {min_cos:g})", "torch.export traced a different computation; inspect its graph")
    out = paths.program(model_name, root)
    out.parent.mkdir(parents=True, exist_ok=True)
    reproducibility = {"claim": "bit-identical", "checked": "not checked (check_reproducible=False)"}
    if check_reproducible:
        again = bytes_in_fresh_process(cfg.source, model_name, root)
        if hashlib.sha256(again).digest() != hashlib.sha256(data).digest():
            raise GateFailed(f"program@{model_name}: a second export in a fresh process gave different bytes",
                             "torch.export is not reproducible for this model; nothing was written")
        reproducibility["checked"] = "fresh-process re-export: bit-identical"
    ops = aten_ops(ep)
    with atomic_dir(out) as d:
        write_bytes_atomic(d / PROGRAM_FILE, data)
        torch.export.load(d / PROGRAM_FILE)  # what we wrote loads back
        results = {"parity": {k: (round(v, 9) if isinstance(v, float) else v) for k, v in par.items()},
                   "parity_limits": {"max_abs": max_abs, "min_cosine": min_cos},
                   "ops": ops, "nodes": sum(ops.values()),
                   "range_constraints": {str(k): str(v) for k, v in ep.range_constraints.items()}}
        inputs = [input_ref("golden", manifest_path(golden_dir, model_name), root)]
        inputs += [file_input("weights", root / w, root) for w in models.weight_deps(mcfg)]
        write_manifest(d, build_manifest(
            kind="program", name=model_name, model=model_name, precision="fp32", directory=d,
            files=[d / PROGRAM_FILE], inputs=inputs,
            build={"exporter": "torch.export", "strict": False, "dim": "Dim.DYNAMIC",
                   "dynamic_axes": {k: list(v) for k, v in mcfg.dynamic.items()},
                   "example_inputs": {k: list(v.shape) for k, v in feeds[0].items()},
                   "stack_traces": "dropped", "reproducibility": reproducibility},
            results=results, **STAGE.identity(cfg, model_name, root)))
    return ProgramResult(out / PROGRAM_FILE, results["parity"], ops, reproducibility["checked"])


def main(argv: list[str] | None = None) -> int:
    import time

    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--bytes-only", type=Path, metavar="FILE",
                       help="only export and write the program's bytes to FILE (the reproducibility check)")

    def body(args, run_) -> int:
        if args.bytes_only:
            write_bytes_atomic(args.bytes_only, export_bytes(args.cfg, args.key, Path("."))[1])
            return 0
        t0 = time.perf_counter()
        r = run(args.cfg, args.key)
        print(f"program@{args.key}: {r.path} ({r.path.stat().st_size / 1e6:.1f} MB, {sum(r.ops.values())} ATen "
              f"nodes) in {time.perf_counter() - t0:.1f} s; reproducibility: {r.deterministic}")
        print_parity(r.parity)
        return 0

    return stage.main(STAGE, body, argv, build=extra, key_help="model name from program.models (e.g. embedder)")


if __name__ == "__main__":
    sys.exit(main())
