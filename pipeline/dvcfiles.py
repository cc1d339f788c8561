"""Where each stage group's DVC file is, a stage's DVC address, and the project's dvc.yaml / dvc.lock files.

DVC rewrites a stage's whole lock file after the stage runs (a round-trip YAML parse and dump, pure Python): with
every stage in one dvc.lock (450 KB) that bookkeeping cost ~7 s per stage on a 2-core host, more than most stages'
own work. So each group has its own dvc.yaml + dvc.lock under dag/, and the root dvc.yaml holds the groups nothing
depends on: the registrations and load sweeps (uncached outputs: a host that pulls with `--allow-missing` has no
receipts of engines it did not register, so no stage may read them) and the reports, the last of them `summary`,
which reads the cached outputs nothing else reads (precision reports, system gates): a plain `dvc repro`
reproduces the root file and everything upstream of it — the whole DAG. (Until 2026-12 the root file held the
precision reports, TensorRT audits and system gates too: 46 stages, a 322 KB lock, ≈ 2 s per root stage.) The
always-changed probe has toolchain/dvc.yaml.
"""

from __future__ import annotations

from pathlib import Path

# The groups of the root dvc.yaml, in the order it lists them.
ROOT_GROUPS = ("register", "register-index", "sysbench", "fallback-table", "leaderboard", "summary")
OWN_FILES = {"toolchain": "toolchain/dvc.yaml"}


def dvcfile(group: str) -> str:
    """The dvc.yaml (from the project root) that holds the stages of `group`."""
    return OWN_FILES.get(group) or ("dvc.yaml" if group in ROOT_GROUPS else f"dag/{group}/dvc.yaml")


def address(name: str) -> str:
    """The DVC address of a stage (`compile@x` → `dag/compile/dvc.yaml:compile@x`) for `dvc repro`/`dvc status`."""
    f = dvcfile(name.partition("@")[0])
    return name if f == "dvc.yaml" else f"{f}:{name}"


def bare(address_: str) -> str:
    """A stage's name from its DVC address (`dag/compile/dvc.yaml:compile@x` → `compile@x`)."""
    return address_.rpartition(":")[2] if ".yaml:" in address_ else address_


def dvc_files(root: Path = Path(".")) -> list[Path]:
    """Every dvc.yaml of the project: the root one, dag/<group>/dvc.yaml, toolchain/dvc.yaml."""
    root = Path(root)
    found = [root / "dvc.yaml", *sorted((root / "dag").glob("*/dvc.yaml")), *(root / f for f in OWN_FILES.values())]
    return [f for f in found if f.is_file()]


def read_locks(root: Path = Path(".")) -> dict[str, dict]:
    """Every stage's lock entry, by stage name, from all the project's dvc.lock files."""
    import yaml

    out: dict[str, dict] = {}
    for f in dvc_files(root):
        lock = f.with_name("dvc.lock")
        if lock.is_file():
            out.update((yaml.load(lock.read_text(encoding="utf-8"),
                                  Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}).get("stages", {}))
    return out
