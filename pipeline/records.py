"""A stage run's record: git commit, dirty state, host and host class, times and the modules it imported, in
artifacts/records/.

The record sits beside the DVC outputs, never inside them, so an output's bytes never depend on when, where or from
which commit it was built; an auditor still finds the commit (`kiln provenance`, the registry's run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.checkout import PACKAGES, REPO


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """HEAD commit and whether tracked files differ from it (dvc.lock and DVC outputs excepted)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True, encoding="utf-8", errors="replace").stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, check=True, encoding="utf-8", errors="replace").stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": "unknown", "dirty": True, "changed": []}
    return {"commit": commit, **dirty_files(status)}


def dirty_files(porcelain_z: str) -> dict[str, Any]:
    """Parse `git status --porcelain=v1 -z`: entries are `XY path`, a rename adds the old path as its own entry."""
    changed, entries, i = [], porcelain_z.split("\0"), 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        path = entry[3:]
        if entry[0] in "RC":
            i += 1                                  # the rename's source path follows
        if Path(path).name != "dvc.lock" and not path.startswith("artifacts/"):
            changed.append(path)
    return {"dirty": bool(changed), "changed": sorted(changed)}


def record_path(stage_name: str, root: Path = Path(".")) -> Path:
    from pipeline import paths

    return paths.records(root) / f"{stage_name}.json"


def write_record(stage_name: str, root: Path, record: dict[str, Any]) -> Path:
    from pipeline import toolchain
    from pipeline.manifest import write_json_atomic

    imported = sorted(p for m in list(sys.modules.values())
                      if (f := getattr(m, "__file__", None)) and (p := _repo_relative(f)))
    doc = {"stage": stage_name, "git": git_state(), **toolchain.host(), "host_class": toolchain.host_class(),
           "cpuid_class": toolchain.cpuid_class(),
           "argv": sys.argv,
           "modules_imported": imported, **record}
    path = record_path(stage_name, root)
    write_json_atomic(path, doc)
    return path


def _repo_relative(f: str) -> str | None:
    """A module file of the checkout's own packages (pipeline/…, runtime/kiln_runtime/…) as dvc.yaml lists it."""
    path = Path(f).resolve()
    for name, root in PACKAGES.items():
        if path.is_relative_to(root / name):
            return path.relative_to(REPO).as_posix()
    return None


def read_record(stage_name: str, root: Path = Path(".")) -> dict[str, Any] | None:
    path = record_path(stage_name, root)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
