"""A stage's code, derived: the checkout's files its module imports (any depth), their digests, and the versions of
the third-party distributions they import. The checkout's code is its packages (pipeline/checkout.py `PACKAGES`): the
build's `pipeline/` and the deployment runtime's `runtime/kiln_runtime/`, which the build imports (what the gates
judge is what a deployment host runs), so a stage that imports the runtime lists its files (`runtime/kiln_runtime/
mtcnn.py`) as deps and digests them like its own, and kiln-runtime is never one of its third-party distributions.

The closure is static: every `import` anywhere in a module counts (function-level imports included, `if
TYPE_CHECKING:` blocks excepted), and importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too. A module
loaded by name (a model's factory, an engine's target) is added by the stage's declaration. dvc.yaml lists these
files as the stage's deps and the stage records their digests in its manifests, so both say the same.
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

from pipeline.checkout import PACKAGES, REPO, package_of


def module_file(name: str) -> Path | None:
    """`pipeline.stages.export` → pipeline/stages/export.py, `kiln_runtime.mtcnn` → runtime/kiln_runtime/mtcnn.py
    (or a package's __init__.py); None if not the checkout's (pipeline/checkout.py `PACKAGES`)."""
    if (top := package_of(name)) is None:
        return None
    base = PACKAGES[top].joinpath(*name.split("."))
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


def _package(path: Path) -> list[str] | None:
    """The package (dotted parts) a file of the checkout's packages is in, which its relative imports start from;
    None for any other file."""
    path = Path(path).resolve()
    for name, root in PACKAGES.items():
        if path.is_relative_to(root / name):
            parts = list(path.relative_to(root).with_suffix("").parts)
            return parts[:-1]                       # a package's __init__.py is in the package itself
    return None


@lru_cache(maxsize=None)
def _direct(path: Path, mtime_ns: int) -> tuple[frozenset[str], frozenset[str]]:
    """(our modules, third-party top-level names) a file imports anywhere, except under `if TYPE_CHECKING:`; a
    relative import (`from .mtcnn import Face`) in one of the checkout's packages counts as its absolute name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    ours, theirs = set(), set()
    package = _package(path)

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = _from(node.module, node.names)
        elif isinstance(node, ast.ImportFrom) and node.level and package and node.level <= len(package):
            names = _from(".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])),
                          node.names)
        for n in names:
            top = n.split(".")[0]
            if package_of(n):
                if module_file(n):
                    ours.add(n)
            elif top not in sys.stdlib_module_names and top != "__future__":
                theirs.add(top)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return frozenset(ours), frozenset(theirs)


def _from(base: str, aliases: list[ast.alias]) -> list[str]:
    """What `from base import a, b` imports: each submodule it names (`from pipeline.cli import parser`), and `base`
    itself when it takes a name defined there. A package's __init__ runs either way; `closure` adds parents."""
    subs = [f"{base}.{a.name}" for a in aliases]
    return subs + ([base] if not all(module_file(n) for n in subs) else [])


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
            if package_of(name) is None:     # (one of the checkout's names without a file: no distribution either)
                theirs.add(name.split(".")[0])
            continue
        files.add(path)
        ours, others = _direct(path, path.stat().st_mtime_ns)
        todo.extend(ours)
        theirs |= others
    return sorted(_relative(p) for p in files), sorted(theirs)


def _relative(p: Path) -> str:
    """A code file as dvc.yaml lists it: relative to the checkout (pipeline/…, runtime/kiln_runtime/…), or to the
    project (a user's module)."""
    try:
        return p.relative_to(REPO).as_posix()
    except ValueError:
        return p.relative_to(Path(".").resolve()).as_posix()


def installed_key() -> str:
    """What names the installed distributions: their metadata folders (`numpy-2.4.6.dist-info`: name and version)
    on sys.path, digested."""
    import hashlib
    import os

    found = sorted({e for d in sys.path if d and os.path.isdir(d) for e in os.listdir(d)
                    if e.endswith((".dist-info", ".egg-info"))})
    return hashlib.sha256("\n".join(found).encode("utf-8")).hexdigest()[:16]


@lru_cache(maxsize=None)
def _distributions() -> dict[str, list[str]]:
    """importlib.metadata.packages_distributions(), which reads every installed distribution's RECORD on each call
    (0.2 s on an idle 2-core Zen 4, 0.8 s beside a busy core) in every stage that writes a manifest. Kept beside the
    environment it describes (sys.prefix), under `installed_key`: a package added, removed or bumped is another key,
    so the answer is the one metadata gives. A read-only environment asks metadata every time."""
    import json
    import os
    from importlib import metadata

    cache = Path(sys.prefix) / f"{DISTRIBUTIONS_CACHE}{installed_key()}.json"
    try:
        kept = json.loads(cache.read_text(encoding="utf-8"))
        if isinstance(kept, dict) and all(isinstance(v, list) for v in kept.values()):
            return kept
    except (OSError, ValueError):
        pass
    found = {k: list(v) for k, v in metadata.packages_distributions().items()}
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(found, sort_keys=True), encoding="utf-8")
        os.replace(tmp, cache)
        for old in cache.parent.glob(f"{DISTRIBUTIONS_CACHE}*.json"):
            if old != cache:
                old.unlink(missing_ok=True)
    except OSError:
        tmp.unlink(missing_ok=True)
    return found


DISTRIBUTIONS_CACHE = ".kiln-distributions-"


def distributions(top_level: list[str]) -> list[str]:
    """Import names → installed distribution names (`PIL` → pillow); a missing one keeps its import name."""
    dists = _distributions()
    return sorted({d.lower() for t in top_level for d in dists.get(t, [t])})


def code_digests(files: list[str]) -> dict[str, str]:
    from pipeline.manifest import file_digests

    return {f: file_digests(REPO / f if (REPO / f).is_file() else Path(f), sha256=False)["xxh3_128"] for f in files}
