"""toolchain@<target> (always runs): the target's toolchain fingerprint as a tiny YAML.

`compile` lists only the `rebuild_on` keys of this file under `params:` in dvc.yaml, so an upgrade of that target's
compiler/runtime (or a different CPU ISA) rebuilds exactly that target's engines, and reverting restores the old
engines from DVC's run cache. `info` is recorded for audit and never triggers a rebuild.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline import paths, targets
from pipeline.manifest import write_bytes_atomic
from pipeline.targets.base import Toolchain


def run(target_name: str, root: Path = Path(".")) -> tuple[Toolchain, Path]:
    tc = targets.get(target_name).probe()
    doc = {"target": tc.target, "available": tc.available, "reason": tc.reason,
           "rebuild_on": tc.rebuild_on, "info": tc.info}
    out = paths.toolchain_file(target_name, root)
    write_bytes_atomic(out, yaml.safe_dump(doc, sort_keys=True).encode())
    return tc, out


def read(target_name: str, root: Path = Path(".")) -> dict:
    path = paths.toolchain_file(target_name, root)
    if not path.is_file():
        from pipeline.errors import KilnError
        raise KilnError(f"{path}: toolchain fingerprint missing", f"run `kiln toolchain {target_name}` first")
    return yaml.safe_load(path.read_text())
