"""What every stage shares: its DVC declaration, the code it runs, its parameter slice, its record, its CLI edge.

A stage module (pipeline/stages/*.py) declares one `STAGE = Stage(...)`: the dvc.yaml group it becomes (one stage,
or `foreach` over keys such as models or engines), its data deps, params and outs. `pipeline/dag.py` renders
dvc.yaml from these declarations, and the stage uses the same declaration at run time, so what a manifest records
(code digests, parameter values) is exactly what DVC tracks:

* code — the closure of `pipeline/` modules the stage's module imports (statically, any depth, function-level
  imports included), plus the modules it loads by name (a model's factory, an engine's target): derived, never
  hand-listed. The record of each run lists the modules really imported, and a test checks they are covered.
* params — the params.yaml keys the stage reads; packages — the versions of the third-party distributions its
  closure imports (artifacts/toolchain/python.yaml), so a lockfile bump reruns exactly the stages that use it.

Each run leaves a record (git commit, dirty state, host, times, modules imported) in artifacts/records/: beside the
DVC outputs, never inside them, so an output's bytes never depend on when, where or from which commit it was built.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline.errors import GateFailed, KilnError, Terminated, handle_sigterm

REPO = Path(__file__).resolve().parents[1]      # the checkout whose code runs (pipeline/ lives here)
PACKAGE = "pipeline"
PYTHON_TOOLCHAIN = "artifacts/toolchain/python.yaml"

# Where each group's stages live. DVC rewrites a stage's whole lock file after the stage runs (a round-trip YAML
# parse and dump, pure Python): with every stage in one dvc.lock (450 KB) that bookkeeping cost ~7 s per stage on
# a 2-core host, more than most stages' own work. So each group has its own dvc.yaml + dvc.lock under dag/, and the
# root dvc.yaml holds the groups nothing depends on (registrations and reports): a plain `dvc repro` reproduces the
# root file and everything upstream of it — the whole DAG. The always-changed probe has toolchain/dvc.yaml.
ROOT_GROUPS = ("register", "register-index", "debug-precision", "trt-audit", "fallback-table", "leaderboard")
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
            out.update((yaml.load(lock.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
                        or {}).get("stages", {}))
    return out


# ---------------------------------------------------------------------------------------------- code closure
def module_file(name: str) -> Path | None:
    """`pipeline.stages.export` → pipeline/stages/export.py (or a package's __init__.py); None if not ours."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    base = REPO.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def project_module(name: str, root: Path = Path(".")) -> Path | None:
    """A module outside pipeline/ that lives in the project (a user's own model factory): its file, else None."""
    base = Path(root).resolve().joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


@lru_cache(maxsize=None)
def _direct(path: Path, mtime_ns: int) -> tuple[frozenset[str], frozenset[str]]:
    """(our modules, third-party top-level names) a file imports anywhere, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    ours, theirs = set(), set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            top = n.split(".")[0]
            if top == PACKAGE:
                if module_file(n):
                    ours.add(n)
            elif top not in sys.stdlib_module_names and top != "__future__":
                theirs.add(top)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return frozenset(ours), frozenset(theirs)


def closure(modules: list[str]) -> tuple[list[str], list[str]]:
    """(repo-relative files, third-party top-level import names) of everything `modules` import, transitively.

    Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too, so parent packages count."""
    seen: set[str] = set()
    files: set[Path] = set()
    theirs: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        path = module_file(name) or project_module(name)
        if path is None:                 # an installed package (a user's factory from PyPI): a package version
            theirs.add(name.split(".")[0])
            continue
        files.add(path)
        ours, others = _direct(path, path.stat().st_mtime_ns)
        todo.extend(ours)
        theirs |= others
    return sorted(_relative(p) for p in files), sorted(theirs)


def _relative(p: Path) -> str:
    """A code file as dvc.yaml lists it: relative to the checkout (pipeline/), or to the project (a user's module)."""
    try:
        return p.relative_to(REPO).as_posix()
    except ValueError:
        return p.relative_to(Path(".").resolve()).as_posix()


@lru_cache(maxsize=None)
def _distributions() -> dict[str, list[str]]:
    from importlib import metadata

    return metadata.packages_distributions()


def distributions(top_level: list[str]) -> list[str]:
    """Import names → installed distribution names (`PIL` → pillow); a missing one keeps its import name."""
    dists = _distributions()
    return sorted({d.lower() for t in top_level for d in dists.get(t, [t])})


def code_digests(files: list[str]) -> dict[str, str]:
    from pipeline.manifest import file_digests

    return {f: file_digests(REPO / f if (REPO / f).is_file() else Path(f), sha256=False)["xxh3_128"] for f in files}


# ---------------------------------------------------------------------------------------------- declaration
@dataclass(frozen=True)
class Out:
    path: str
    cache: bool = True
    kind: str = "outs"                          # outs | metrics | plots
    plot: dict[str, str] = field(default_factory=dict)
    persist: bool = False                       # DVC leaves it in place when the stage runs (not deleted first)


Keys = Callable[[Any], list[str]]
PerKey = Callable[[Any, "str | None"], list]


def _none(cfg, key) -> list:
    return []


@dataclass(frozen=True)
class Stage:
    """One dvc.yaml group. `keys(cfg)` makes it a foreach over those keys (None: one stage named `group`)."""

    group: str
    module: str                                 # run as `python -m <module> [key]`
    desc: str
    outs: PerKey
    keys: Keys | None = None
    deps: PerKey = _none                        # data deps (artifacts, weights, photos): repo-relative paths
    params: PerKey = _none                      # params.yaml keys (dotted)
    targets: PerKey = _none                     # targets whose fingerprint `rebuild_on` the stage tracks
    dynamic: PerKey = _none                     # modules loaded by name: a model's factory, a target's module
    always_changed: bool = False

    @property
    def dvcfile(self) -> str:
        return dvcfile(self.group)

    def name(self, key: str | None = None) -> str:
        return self.group if key is None else f"{self.group}@{key}"

    def code(self, cfg, key: str | None) -> list[str]:
        """Files of the stage's closure: its own module's plus the modules it loads by name."""
        return closure([self.module, *self.dynamic(cfg, key)])[0]

    def packages(self) -> list[str]:
        """Distributions the stage's own module closure imports (a dynamic module's are its target's keys)."""
        return distributions(closure([self.module])[1])

    def param_values(self, cfg, key: str | None) -> dict[str, Any]:
        out = {}
        for dotted in self.params(cfg, key):
            value: Any = cfg.raw
            for part in dotted.split("."):
                if not isinstance(value, dict) or part not in value:
                    raise KilnError(f"{cfg.source}: {dotted}: missing (stage {self.name(key)} reads it)",
                                    "see the repository's params.yaml")
                value = value[part]
            out[dotted] = value
        return out

    def identity(self, cfg, key: str | None, root: Path = Path("."),
                 toolchain: dict[str, Any] | None = None) -> dict[str, Any]:
        """The manifest fields that say what ran: code digests, params slice, toolchain (packages + targets)."""
        from pipeline import toolchain as tc

        chain = {**tc.versions(*self.packages()), **(toolchain or {})}
        for target in self.targets(cfg, key):
            chain[f"target.{target}"] = read_fingerprint(target, root)["rebuild_on"]
        return {"code": code_digests(self.code(cfg, key)), "params": self.param_values(cfg, key),
                "toolchain": chain}


def read_fingerprint(target: str, root: Path = Path(".")) -> dict[str, Any]:
    """artifacts/toolchain/<target>.yaml, written by the toolchain stage."""
    import yaml

    from pipeline import paths

    path = paths.toolchain_file(target, root)
    if not path.is_file():
        raise KilnError(f"{path}: toolchain fingerprint missing", "run `kiln toolchain` (the toolchain stage) first")
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("rebuild_on"), dict):
        raise KilnError(f"{path}: not a toolchain fingerprint", "rerun `kiln toolchain`")
    return doc


# ---------------------------------------------------------------------------------------------- record
def git_state(repo: Path = REPO) -> dict[str, Any]:
    """HEAD commit and whether tracked files differ from it (dvc.lock and DVC outputs excepted)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, check=True).stdout
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
    doc = {"stage": stage_name, "git": git_state(), **toolchain.host(), "argv": sys.argv,
           "modules_imported": imported, **record}
    path = record_path(stage_name, root)
    write_json_atomic(path, doc)
    return path


def _repo_relative(f: str) -> str | None:
    try:
        rel = Path(f).resolve().relative_to(REPO)
    except ValueError:
        return None
    return rel.as_posix() if rel.parts and rel.parts[0] == PACKAGE else None


def read_record(stage_name: str, root: Path = Path(".")) -> dict[str, Any] | None:
    path = record_path(stage_name, root)
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------------------------- CLI edge
def report_errors(fn: Callable[[], int]) -> int:
    """Run `fn`; turn Kiln's errors into one line + hint and the documented exit code (1 gate, 2 user error).
    SIGTERM is handled like Ctrl-C (exit 143): it unwinds through the same cleanup."""
    handle_sigterm()
    try:
        return fn()
    except GateFailed as e:
        print(f"kiln: gate failed: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 1
    except KilnError as e:
        print(f"kiln: error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"kiln: {how}; nothing was left half-written", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except MemoryError as e:      # its message is often empty; never a traceback
        print(f"kiln: error: out of memory{': ' + str(e)[:200] if str(e) else ''}", file=sys.stderr)
        print("hint: the input is larger than this machine can hold; check it, or run with more memory",
              file=sys.stderr)
        return 2


def parser(stage: Stage, key_help: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kiln {stage.group}", description=stage.desc)
    p.add_argument("--params", type=Path, default=Path("params.yaml"), help="parameters file (params.yaml)")
    if stage.keys is not None:
        p.add_argument("key", help=key_help or "which one (see dvc.yaml)")
    return p


@dataclass
class Run:
    """One run of a stage: its name and what it records beside its outputs."""

    stage: Stage
    key: str | None
    root: Path
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.stage.name(self.key)


@contextmanager
def running(stage: Stage, key: str | None, root: Path = Path(".")) -> Iterator[Run]:
    """Time a stage run and, when it succeeds, write its record (artifacts/records/<stage>.json)."""
    run = Run(stage, key, Path(root))
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    yield run
    write_record(run.name, run.root, {"started_at": started, "seconds": round(time.perf_counter() - t0, 3),
                                      **run.record})


def main(stage: Stage, body: Callable[[argparse.Namespace, Run], int], argv: list[str] | None = None,
         build: Callable[[argparse.ArgumentParser], None] | None = None, key_help: str = "") -> int:
    """The CLI of a stage module: parse, load params, run `body` inside `running`, map errors to exit codes."""
    p = parser(stage, key_help)
    if build:
        build(p)
    args = p.parse_args(argv)

    def go() -> int:
        from pipeline import config, paths

        args.cfg = config.load(args.params)
        key = getattr(args, "key", None)
        if key is not None:
            paths.slug(key, "stage key")
            known = stage.keys(args.cfg)
            if key not in known:
                raise KilnError(f"{stage.group}: no {key!r} in this params file",
                                f"known: {', '.join(known) or '(none)'}")
        with running(stage, key) as run:
            return body(args, run)

    return report_errors(go)


def cli_env() -> dict[str, str]:
    """Environment for a `python -m pipeline...` child that must run this checkout's code from another cwd."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
