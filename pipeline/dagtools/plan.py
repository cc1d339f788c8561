"""`kiln plan`: which engines each hardware family must build, given params.yaml, this host and the shared remote.

A build matrix is one CI job per hardware family (`.github/workflows/build.yml`): `cpu-x86` builds the CPU targets
from the default params, `gpu` merges `profiles/gpu.yaml` (TensorRT), `rtx` merges `profiles/rtx.yaml`. Each job
runs `dvc pull --allow-missing` and `dvc repro --pull --allow-missing` (what another host already built comes from
the shared remote and its run cache) and pushes what it built. `kiln plan` is the dry run of that: per engine of the
current params, its family, whether this host can build its target (the same probe `dvc repro` uses), and its state
against `dvc.lock`, the local cache and the remote (`dvc status` and `dvc status --cloud` of the compile stages, so
it reads the same truth DVC acts on):

    in remote      the remote has this exact build (dvc.lock's hash): nobody rebuilds it, `dvc pull` gets it
    not pushed     built here, not in the remote yet: `dvc push`
    to build       no build of the current inputs anywhere (not in dvc.lock, stale, or in no cache)
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.errors import KilnError

if TYPE_CHECKING:
    from pipeline.config import Config

FAMILY = {"ort-cpu": "cpu-x86", "aoti-cpu": "cpu-x86", "openvino-cpu": "cpu-x86", "tensorrt": "gpu",
          "tensorrt-rtx": "rtx"}            # the CI matrix job (hardware family) that builds each target


@dataclass(frozen=True)
class Row:
    engine: str
    target: str
    family: str
    here: bool          # this host can build the target
    state: str          # in remote | not pushed | to build
    why: str


def _dvc(root: Path, *args: str) -> dict:
    exe = Path(sys.executable).parent / "dvc"
    r = subprocess.run([str(exe), *args, "--json"], cwd=root, capture_output=True, text=True, encoding="utf-8",
                       errors="replace")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise KilnError(f"dvc {' '.join(args)} failed: {last}",
                        "configure the shared remote first (scripts/remote-server.sh prints the two lines), "
                        "or pass --no-remote to plan against this host only")
    return json.loads(r.stdout or "{}")


def _inputs_changed(changes: list) -> bool:
    """Did a stage's inputs change (deps, params, command)? Missing files are not a change — a checkout that has
    not pulled its deps or outputs yet still has the lock's build, and the remote may hold it."""
    for c in changes:
        if not isinstance(c, dict):
            return True                                  # "changed command", "always changed", …
        for kind, files in c.items():
            if kind == "changed outs" or (kind == "changed deps" and isinstance(files, dict)
                                          and all(v == "deleted" for v in files.values())):
                continue
            return True
    return False


def plan(cfg: Config, root: Path = Path("."), remote: bool = True) -> list[Row]:
    from pipeline import targets
    from pipeline.dvcfiles import address, bare, read_locks

    root = Path(root)
    lock = read_locks(root)
    # only the compile stages the lock has: DVC checks those alone (the whole project's status took 10-20 s)
    built = [address(f"compile@{name}") for name in sorted(cfg.engines) if f"compile@{name}" in lock]
    stale = {bare(a) for a, changes in (_dvc(root, "status", *built) if built else {}).items()
             if _inputs_changed(changes)}
    cloud = _dvc(root, "status", "--cloud", *built) if remote and built else {}
    probes: dict[str, bool] = {}
    rows = []
    for name, spec in sorted(cfg.engines.items()):
        if spec.target not in probes:
            probes[spec.target] = targets.get(spec.target).probe().available
        compile_stage, out = f"compile@{name}", paths.engine(name).as_posix()
        if compile_stage not in lock:
            state, why = "to build", "not in dvc.lock"
        elif compile_stage in stale:
            state, why = "to build", "its inputs, code, params or toolchain changed since dvc.lock"
        elif not remote:
            state, why = "not pushed", "built here (remote not checked)"
        elif cloud.get(out) == "new":
            state, why = "not pushed", "in this host's cache, not in the remote"
        elif cloud.get(out) == "missing":
            state, why = "to build", "in dvc.lock but in no cache"
        else:
            state, why = "in remote", "the remote has dvc.lock's build"
        rows.append(Row(name, spec.target, FAMILY.get(spec.target, "cpu-x86"), probes[spec.target], state, why))
    return rows


def render(rows: list[Row]) -> str:
    from pipeline import tables

    body = [[r.family, r.engine, r.target, "yes" if r.here else "no", r.state, r.why] for r in
            sorted(rows, key=lambda r: (r.family, r.engine))]
    out = [tables.markdown(["family", "engine", "target", "buildable here", "state", "why"], body)]
    for family in sorted({r.family for r in rows}):
        todo = [r for r in rows if r.family == family and r.state == "to build"]
        out.append(f"{family}: {len(todo)} to build"
                   + (f" ({', '.join(r.engine for r in todo)})" if todo else "")
                   + f", {sum(r.family == family and r.state == 'in remote' for r in rows)} in the remote")
    return "\n".join(out)


__all__ = ["FAMILY", "Row", "plan", "render"]
