"""`kiln rebuild-check <stage>`: rebuild a stage in a fresh process, in a scratch project, and classify the result.

Classes, strongest first (pipeline/targets/base.py CLASSES):

* bit-identical — every output file (manifests included) has the same bytes;
* numerically-equivalent — (engines) both builds give outputs within the target's declared bound (max |Δ|) on
  every golden feed;
* task-equivalent — (engines) the rebuilt engine passes the same face-task gate as the built one;
* different.

An engine must reach its target's claim (`reproducibility.claim`: ort-cpu and aoti-cpu claim bit-identical,
TensorRT task-equivalent, TensorRT-RTX numerically-equivalent); every other build stage claims bit-identical.
The command exits 1 below the claim.
Stages that are not builds (toolchain, bench timings, registration) are refused: rebuilding them proves nothing.

`--cpu MODEL` rebuilds a portable stage (pipeline/portable.py) on an emulated CPU — qemu-user with that model's
CPUID, so PyTorch, oneDNN, MKL, NumPy, OpenBLAS and ONNX Runtime all pick that CPU's kernels — and must find this
host's bytes: the cross-ISA check of the stages every host shares, without a second machine. The record of the
emulated run names the host class its CPUID gave, which the output prints, so a run that escaped the emulator
shows. Emulation is slow (≈ 10× here) and is no place for timings.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import engines, paths, samples, scratch, targets
from pipeline.dagtools import dag
from pipeline.dvcfiles import address
from pipeline.errors import KilnError
from pipeline.manifest import file_digests
from pipeline.records import read_record
from pipeline.targets.base import CLASSES

if TYPE_CHECKING:
    from pipeline.config import Config

NOT_BUILDS = ("toolchain", "bench", "register", "register-index")


def _files(root: Path, rel: str) -> dict[str, str]:
    p = root / rel
    if p.is_file():
        return {rel: file_digests(p)["sha256"]}
    if not p.is_dir():
        return {}
    return {f.relative_to(root).as_posix(): file_digests(f)["sha256"] for f in sorted(p.rglob("*")) if f.is_file()}


def compare_outputs(outs: list[str], a: Path, b: Path) -> list[str]:
    """Output files (repo-relative) whose bytes differ between project roots `a` and `b`, or exist in one only."""
    fa, fb = {}, {}
    for rel in outs:
        fa.update(_files(a, rel))
        fb.update(_files(b, rel))
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def engine_max_abs(cfg: Config, engine: str, a: Path, b: Path, root: Path) -> float:
    """Largest |Δ| between two builds of an engine over every output on the model's golden feeds."""
    spec = cfg.engine(engine)
    ra, rb = engines.load(spec.target, a, engine), engines.load(spec.target, b, engine)
    worst = 0.0
    for feed in samples.feeds(cfg, spec.model, "golden", root):
        for x, y in zip(ra.run_all(feed), rb.run_all(feed)):
            worst = max(worst, float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))))
    return worst


def classify(cfg: Config, stage_name: str, root: Path = Path("."), cpu: str | None = None) -> dict:
    """Rebuild `stage_name` in a scratch project (on an emulated CPU model when `cpu` is given); classify it."""
    prefix = scratch.emulator(cpu) if cpu is not None else ()     # the CPU model first: a value qemu is given
    group, _, key = stage_name.partition("@")
    if group in NOT_BUILDS:
        raise KilnError(f"{stage_name}: not a build (a probe, timings or a registry write); nothing to rebuild",
                        "rebuild-check a build stage, e.g. compile@<engine> or export@<model>")
    spec = dag.find(group)
    key = key or None
    if (spec.keys is None) != (key is None) or (key is not None and key not in spec.keys(cfg)):
        raise KilnError(f"no stage {stage_name!r}", "see dvc.yaml for the stage names")
    if cpu is not None and not spec.portable:
        from pipeline.dagtools.lockdiff import portable_groups

        portable = ", ".join(sorted(portable_groups()))
        raise KilnError(f"{stage_name}: not a portable stage; what it builds follows the CPU it runs on, by design",
                        f"--cpu checks the stages every host shares: {portable}")
    outs = [o.path for o in spec.outs(cfg, key)]
    for rel in outs:
        if not (root / rel).exists():
            raise KilnError(f"{root / rel}: not built", f"build it first: dvc repro {address(stage_name)}")
    claim = targets.get(cfg.engine(key).target).reproducibility if group == "compile" else None
    with scratch.rebuild(spec, cfg, key, root, prefix=prefix) as other:
        other = Path(other)
        differ = compare_outputs(outs, root, other)
        result = {"stage": stage_name, "differing_files": differ, "claim": claim.claim if claim else CLASSES[0],
                  "cpu": cpu or "this host", "ran_as": (read_record(stage_name, other) or {}).get("cpuid_class")}
        if not differ:
            result["class"] = CLASSES[0]
        elif group != "compile":
            result["class"] = CLASSES[-1]
        else:
            from pipeline.gates.evaluate import evaluate

            built, rebuilt = paths.engine(key, root), paths.engine(key, other)
            result["max_abs"] = engine_max_abs(cfg, key, built, rebuilt, root)
            if result["max_abs"] <= claim.bound:
                result["class"] = CLASSES[1]
            else:
                runner = engines.load(cfg.engine(key).target, rebuilt, key)
                _, failures, _, _ = evaluate(cfg, key, runner, root)
                result["gate_failures"] = failures
                result["class"] = CLASSES[2] if not failures else CLASSES[3]
    result["meets_claim"] = CLASSES.index(result["class"]) <= CLASSES.index(result["claim"])
    return result


def main(cfg: Config, stage_name: str, root: Path = Path("."), cpu: str | None = None) -> int:
    r = classify(cfg, stage_name, root, cpu)
    detail = ""
    if r["differing_files"]:
        detail = f"; differs in {', '.join(r['differing_files'][:5])}"
    if "max_abs" in r:
        detail += f"; max |Δ| on the golden feeds {r['max_abs']:.3g}"
    if r.get("gate_failures"):
        detail += "; gate: " + "; ".join(r["gate_failures"][:3])
    where = f" on an emulated {cpu} (its CPUID: {r['ran_as']})" if cpu else ""
    print(f"rebuild-check {stage_name}{where}: {r['class']} (claim: {r['claim']}){detail}")
    if not r["meets_claim"]:
        print(f"kiln: gate failed: {stage_name} rebuilds as {r['class']}, below its claim {r['claim']}")
        return 1
    return 0
