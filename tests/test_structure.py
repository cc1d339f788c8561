"""The shape of the code, checked (issue 33): the import graph of pipeline/ has no cycles; no module imports a stage
module (a stage is its STAGE, run and main: a library never lives in one); each stage module is short; and the
derived closures are narrow — a package bump reruns only the stages whose code uses it, an edit of the face-metric
maths reruns the gates and none of the builds. The deployment runtime (runtime/kiln_runtime, section f) imports
nothing of the build, its lock holds nothing of the build and pins the build's versions, and the closures follow it
like pipeline/ code.

Imports are read as the DAG reads them: by the project's own reader (`_direct`, beside `closure`; module-level and
function-level imports alike, `if TYPE_CHECKING:` blocks excepted). Closures are those of the declarations rendered in
memory (pipeline/dagtools/dag.py `render` of the repository's params.yaml), never the committed dvc.yaml. Fast: nothing
is built, nothing runs but the reader and the renderer.
"""

from __future__ import annotations

import importlib
import re
from collections import deque
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from conftest import REPO

PIPELINE = REPO / "pipeline"
STAGES = PIPELINE / "stages"
MAX_STAGE_LINES = 160
# The groups that build what engines are made from, and the engines: a metric edit must rerun none of them.
BUILD_GROUPS = ("golden", "export", "program", "quantize", "compile", "debug-precision")
GATE_GROUPS = ("validate", "calibrate")               # the gates that judge with the face metrics
PACKAGE = "openvino"                                  # the package bump of issue 33 item 4


# ---------------------------------------------------------------------------------------------- the import reader
@lru_cache(maxsize=None)
def reader():
    """The module that holds the project's import reader (`def _direct(`), wherever the code keeps it."""
    hits = [p for p in sorted(PIPELINE.rglob("*.py")) if re.search(r"(?m)^def _direct\(", p.read_text())]
    assert len(hits) == 1, f"the import reader `_direct` should be defined once under pipeline/: {hits}"
    return importlib.import_module(".".join(hits[0].relative_to(REPO).with_suffix("").parts))


def rel(p: Path) -> str:
    return p.resolve().relative_to(REPO).as_posix()


def imports(path: Path) -> tuple[set[str], set[str]]:
    """(the pipeline/ files `path` imports, the third-party top-level names it imports)."""
    r = reader()
    ours, theirs = r._direct(path, path.stat().st_mtime_ns)
    return {rel(f) for n in ours if (f := r.module_file(n)) is not None}, set(theirs)


def pipeline_files() -> list[Path]:
    return sorted(p for p in PIPELINE.rglob("*.py") if "__pycache__" not in p.parts)


def loads_by_name(path: Path) -> set[str]:
    """The pipeline/ files `path` names as string literals to load by name: a registry's module (`Entry(
    "pipeline.roles.retinaface", …)`), a role's `"module:function"` reference, a stage's own module name."""
    import ast

    r = reader()
    names = {n.value.partition(":")[0] for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.fullmatch(r"pipeline(\.\w+)+(:\w+)?", n.value)}
    return {rel(f) for n in names if (f := r.module_file(n)) is not None}


def graph() -> dict[str, set[str]]:
    """pipeline/ file → the pipeline/ files it imports or loads by name (importlib on a module it names)."""
    return {rel(p): (imports(p)[0] | loads_by_name(p)) - {rel(p)} for p in pipeline_files()}


def path_between(edges: dict[str, set[str]], start: str, goals: set[str]) -> list[str] | None:
    """A shortest import chain from `start` to any of `goals` (breadth first), or None."""
    parent: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        if node in goals and node != start:
            chain = [node]
            while (node := parent[node]) is not None:
                chain.append(node)
            return chain[::-1]
        for nxt in sorted(edges.get(node, ())):
            if nxt not in parent:
                parent[nxt] = node
                todo.append(nxt)
    return None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle per strongly connected component of more than one file (Tarjan), shortest first found."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:                       # recursion depth ≤ the number of files (≈ 120)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            comps.append([v, *comp])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_cycle_through({v: edges[v] & set(comp) for v in comp}, min(comp)) for comp in comps if len(comp) > 1]


def _cycle_through(inner: dict[str, set[str]], start: str) -> list[str]:
    """A shortest cycle start → … → start inside one component."""
    best: list[str] | None = None
    for nxt in sorted(inner[start]):
        back = path_between(inner, nxt, {start}) if nxt != start else [start]
        if back and (best is None or len(back) + 1 < len(best)):
            best = [start, *back]
    return best or [start]


# ---------------------------------------------------------------------------------------------- (a) (b) (c)
def test_the_import_graph_of_pipeline_has_no_cycles():
    """Module-level and function-level imports both count, and loads by name: a cycle is one a lazy import or
    importlib only hides."""
    found = cycles(graph())
    assert not found, "import cycles in pipeline/:\n" + "\n".join(" → ".join(c) for c in found)


def test_loads_by_name_are_edges_of_the_graph():
    """The registries' by-name loads are seen: the roles registry names every role module, a role its metrics."""
    edges = graph()
    assert {"pipeline/roles/retinaface.py", "pipeline/roles/singleshot.py"} <= edges["pipeline/roles/registry.py"]
    assert "pipeline/gates/detection.py" in edges["pipeline/roles/singleshot.py"]
    assert "pipeline/targets/ort_cpu.py" in edges["pipeline/targets/__init__.py"]


def private_imports(path: Path) -> list[str]:
    """`from pipeline.x import _name` and `module._name` (module one of the checkout's, imported by `path`)."""
    import ast

    r = reader()
    where = rel(path) if REPO in path.resolve().parents else path.name
    tree, found, modules = ast.parse(path.read_text(encoding="utf-8")), [], set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and r.package_of(n.module):
            for a in n.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{where}:{n.lineno} imports {n.module}.{a.name}")
                elif r.module_file(f"{n.module}.{a.name}") is not None:
                    modules.add(a.asname or a.name)
        elif isinstance(n, ast.Import):
            modules |= {a.asname for a in n.names if a.asname and r.package_of(a.name)}
    for n in ast.walk(tree):
        if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules
                and n.attr.startswith("_") and not n.attr.startswith("__")):
            found.append(f"{where}:{n.lineno} uses {n.value.id}.{n.attr}")
    return found


def test_no_module_imports_another_modules_private_name():
    """A name another module needs is public: no `from pipeline.x import _helper`, no `x._helper(...)` across
    modules, in pipeline/, the runtime, bench/ or scripts/ (tests may reach in)."""
    files = [p for d in ("pipeline", "runtime/kiln_runtime", "bench", "scripts")
             for p in sorted((REPO / d).rglob("*.py")) if "__pycache__" not in p.parts]
    found = [line for p in files for line in private_imports(p)]
    assert not found, "private names used across modules:\n  " + "\n  ".join(found)


def test_the_private_name_check_sees_both_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from pipeline.dagtools import dag\nfrom pipeline.manifest import _x\ndag._y()\ndag.render\n",
                 encoding="utf-8")
    found = private_imports(f)
    assert len(found) == 2 and "pipeline.manifest._x" in found[0] and "dag._y" in found[1], found


def stage_modules() -> list[str]:
    return sorted(rel(p) for p in STAGES.glob("*.py") if p.name != "__init__.py")


def test_no_module_imports_a_stage_module():
    """pipeline/stages/*.py are entry points: no module of pipeline/ (another stage included), bench/ or scripts/
    imports one. The CLI and the DAG load them by name (tests may import them)."""
    targets = set(stage_modules())
    assert len(targets) >= 15, targets
    importers = [p for d in ("pipeline", "bench", "scripts") for p in sorted((REPO / d).rglob("*.py"))
                 if "__pycache__" not in p.parts]
    found = {rel(p): sorted((imports(p)[0] & targets) - {rel(p)}) for p in importers}
    found = {k: v for k, v in found.items() if v}
    assert not found, "stage modules imported by other modules:\n" + "\n".join(
        f"  {k} imports {', '.join(v)}" for k, v in sorted(found.items()))


def test_each_stage_module_is_short():
    """A stage module is its STAGE, `run` and `main`; what is longer is a library that belongs elsewhere."""
    long = {m: n for m in stage_modules() if (n := len((REPO / m).read_text().splitlines())) > MAX_STAGE_LINES}
    assert not long, f"stage modules over {MAX_STAGE_LINES} lines: " + ", ".join(
        f"{m} ({n})" for m, n in sorted(long.items(), key=lambda x: -x[1]))


# The stages whose own work is PyTorch (building image sets through the aligner graph, the reference outputs, the
# export and the torch.export program). Every other stage module starts without torch: importing it costs ≈ 1 s a
# process, and the default DAG runs about 60 such stage processes.
TORCH_STAGES = {"dataset", "golden", "export", "program"}


def test_a_stage_that_runs_no_pytorch_starts_without_it():
    import subprocess
    import sys

    names = [Path(m).stem for m in stage_modules()]
    assert TORCH_STAGES <= set(names), TORCH_STAGES - set(names)
    probe = ("import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module('pipeline.stages.' + n)\n"
             "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe, *sorted(set(names) - TORCH_STAGES)], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"a stage module imports PyTorch at import time: {r.stdout.strip()}"


MAX_COLUMNS = 120
CODE_DIRS = ("pipeline", "runtime/kiln_runtime", "tests", "bench", "scripts")


def code_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_line_is_wider_than_the_house_width():
    """The house reads at 120 columns: code, docstrings and comments alike."""
    wide = [f"{rel(p)}:{i} ({len(line)})" for p in code_files()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"lines over {MAX_COLUMNS} columns:\n  " + "\n  ".join(wide)


def untyped_config(path: Path) -> list[str]:
    """Parameters that carry configuration (named `cfg` or `…cfg`: the Config, or a slice such as a ModelConfig)
    without an annotation."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            out += [f"{path.name}:{node.lineno} {node.name}({a.arg})"
                    for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                    if a.arg.endswith("cfg") and a.annotation is None]
    return out


def test_config_is_typed_at_every_boundary():
    """Every function of the build and the runtime that takes configuration says which: `cfg: Config`, `mcfg:
    ModelConfig`, … (imported under TYPE_CHECKING where only the annotation needs it: no import cost, no closure)."""
    untyped = [f"{rel(p.parent)}/{u}" for p in code_files() if not rel(p).startswith(("tests/", "bench/", "scripts/"))
               for u in untyped_config(p)]
    assert not untyped, "configuration parameters without a type:\n  " + "\n  ".join(untyped)


def test_the_config_type_check_sees_an_untyped_slice(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(cfg: 'Config', mcfg, x):\n    pass\nclass A:\n    def g(self, *, dcfg=None):\n"
                   "        pass\n", encoding="utf-8")
    assert [u.split(" ", 1)[1] for u in untyped_config(src)] == ["f(mcfg)", "g(dcfg)"]


# ---------------------------------------------------------------------------------------------- (d) closures
@pytest.fixture(scope="module")
def declared() -> dict[str, dict]:
    """Every stage of the default DAG as the declarations render it (in memory): name → {deps, packages,
    targets, module}: its deps (code and data), the packages of artifacts/toolchain/python.yaml it tracks, and the
    targets whose fingerprint (artifacts/toolchain/<target>.yaml) it tracks."""
    from pipeline import config
    from pipeline.dagtools import dag

    cfg = config.load(REPO / "params.yaml")
    out: dict[str, dict] = {}
    for file, text in dag.render(cfg).items():
        for group, body in (yaml.safe_load(text).get("stages") or {}).items():
            keyed = body.get("foreach")
            spec = body["do"] if keyed is not None else body
            for key, item in (keyed.items() if keyed is not None else [(None, {})]):
                def sub(s: str) -> str:
                    s = re.sub(r"\$\{item\.(\w+)\}", lambda m: str(item[m.group(1)]), s)
                    return s.replace("${key}", str(key))
                params = [{sub(k): v for k, v in p.items()} if isinstance(p, dict) else sub(p)
                          for p in spec.get("params", [])]
                files = {k: v for p in params if isinstance(p, dict) for k, v in p.items()}
                out[group if key is None else f"{group}@{key}"] = {
                    "module": rel(reader().module_file(spec["cmd"].split()[2])),
                    "deps": {sub(d) for d in spec.get("deps", [])},
                    "outs": {sub(next(iter(o)) if isinstance(o, dict) else o)
                             for kind in ("outs", "metrics", "plots") for o in spec.get(kind, [])},
                    "file": file,
                    "packages": {v.removeprefix("packages.") for v in files.get("artifacts/toolchain/python.yaml",
                                                                                  []) if v.startswith("packages.")},
                    "targets": {Path(k).stem for k in files if k.startswith("artifacts/toolchain/")
                                and k != "artifacts/toolchain/python.yaml"}}
    assert len(out) >= 80, len(out)
    return out


def test_a_package_bump_reruns_only_the_stages_whose_code_uses_it(declared):
    """An OpenVINO upgrade reruns the stages of targets whose module imports openvino (through their fingerprint)
    and may rerun the stages that load engines of any target (their deps include an engine); no other stage —
    golden@, export@, the FP32 chain of a PyTorch model above all — may list `packages.openvino`. The expectation
    is derived from which modules import openvino (the reader), not a hand list."""
    from pipeline import paths, targets

    r = reader()
    dist = set(r.distributions([PACKAGE]))
    users = {rel(p) for p in pipeline_files() if PACKAGE in imports(p)[1]}
    assert users, f"no module under pipeline/ imports {PACKAGE}"
    using_targets = {t for s in declared.values() for t in s["targets"] if PACKAGE in r.closure([targets.module(t)])[1]}
    engines_dir = paths.engine("x").parent.as_posix() + "/"

    def depends(s: dict) -> bool:
        return bool(s["packages"] & dist) or bool(s["targets"] & using_targets)

    must = {n for n, s in declared.items() if s["targets"] & using_targets}
    may = {n for n, s in declared.items() if any(d.startswith(engines_dir) for d in s["deps"])}
    edges = graph()
    rerun = {n for n, s in declared.items() if depends(s)}
    # import@ asks OpenVINO's frontend which ops it can run (pipeline/opsupport.py), a question, not a computation:
    # its answer goes to the run's record, so the portable stage must not rerun (and rebuild every engine after it)
    from pipeline.dagtools.lockdiff import portable_groups

    groups = portable_groups()
    assert "import" in groups, groups
    portable = sorted(n for n in rerun if n.partition("@")[0] in groups)
    assert not portable, f"portable stages rerun on a {PACKAGE} bump: {portable}"
    assert must, f"no stage tracks a target whose module imports {PACKAGE}: {sorted(using_targets)}"
    assert must <= rerun, sorted(must - rerun)
    wrong = {}
    for n in sorted(rerun - must - may):
        module = declared[n]["module"]
        wrong[n] = " → ".join(path_between(edges, module, users) or [module, "(a module it loads by name)"])
    assert not wrong, (f"{len(wrong)} stages rerun on a {PACKAGE} bump without using it ({PACKAGE} is imported by "
                       f"{', '.join(sorted(users))}):\n" + "\n".join(f"  {n}: {c}" for n, c in wrong.items()))


def test_a_plain_dvc_repro_reaches_every_stage(declared):
    """`dvc repro` (scripts/run.sh) reproduces the root dvc.yaml and what its stages depend on. So a stage in a group
    file (dag/<group>/dvc.yaml) must be upstream of another stage: an output of it is another stage's dependency.
    A group nothing depends on must be read by the build's summary (pipeline/report/summary.py: cached outputs
    only) or sit in the root file (pipeline/dvcfiles.py ROOT_GROUPS: registrations, load sweeps, reports), or the
    full default DAG silently never runs it."""
    def feeds(out: str, dep: str) -> bool:
        return dep == out or dep.startswith(out + "/") or out.startswith(dep + "/")

    deps = {d for s in declared.values() for d in s["deps"]}
    unreached = sorted(n for n, s in declared.items() if s["file"] not in ("dvc.yaml", "toolchain/dvc.yaml")
                       and not any(feeds(o, d) for o in s["outs"] for d in deps))
    assert not unreached, f"no stage depends on these, and they are not in the root dvc.yaml: {unreached}"


def facemetrics_file() -> str:
    found = [rel(p) for p in pipeline_files() if p.name == "facemetrics.py"]
    assert len(found) == 1, found
    return found[0]


def test_a_metrics_edit_reruns_the_gates_not_the_builds(declared):
    """Editing the face-metric maths (facemetrics.py, wherever it lives) stales the gates (validate@, calibrate@),
    which judge with it, and none of the builds: an engine's identity must not change with a metric."""
    f = facemetrics_file()
    stale = {n for n, s in declared.items() if f in s["deps"]}
    gates = {n for n in declared if n.partition("@")[0] in GATE_GROUPS}
    builds = {n for n in declared if n.partition("@")[0] in BUILD_GROUPS}
    assert gates and builds
    assert gates <= stale, f"gates that would not rerun on an edit of {f}: {sorted(gates - stale)}"
    edges = graph()
    wrong = {}
    for n in sorted(stale & builds):
        module = declared[n]["module"]
        wrong[n] = " → ".join(path_between(edges, module, {f}) or [module, "(a module it loads by name)"])
    by_group = {g: sum(n.partition("@")[0] == g for n in wrong) for g in BUILD_GROUPS}
    assert not wrong, (f"an edit of {f} stales {len(wrong)} build stages "
                       f"({', '.join(f'{g}@ ×{c}' for g, c in by_group.items() if c)}):\n"
                       + "\n".join(f"  {n}: {c}" for n, c in wrong.items()))


# ---------------------------------------------------------------------------------------------- (e) encodings
# Calls that decode or encode text with the locale's encoding unless told otherwise (issue 44 item 6: with
# PYTHONUTF8=0 and an ASCII locale, `kiln --help` died reading a file that holds `—`): (mode argument position,
# or None: always text) by how the call is named.
_TEXT_CALLS = {"read_text": None, "write_text": None, "TextIOWrapper": None, "open": 1, "fdopen": 1,
               "NamedTemporaryFile": 0, "TemporaryFile": 0, "SpooledTemporaryFile": 1}
_NOT_FILES = ("tarfile", "zipfile", "Image", "gzip", "bz2", "lzma", "os", "tar", "zf", "zip", "archive", "webbrowser")


def _unencoded_text_io(tree) -> list[tuple[int, str]]:
    """(line, call) of every text-mode file or subprocess call in `tree` that does not name its encoding."""
    return sorted((node.lineno, call) for node, call in _unencoded_calls(tree))


def _unencoded_calls(tree) -> list:
    import ast

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if "encoding" in kw or any(k.arg is None for k in node.keywords):        # named, or **kwargs passed on
            continue
        if name in ("run", "Popen", "check_output", "check_call", "call") and owner == "subprocess":
            text = [kw.get(k) for k in ("text", "universal_newlines")]
            if any(isinstance(v, ast.Constant) and v.value for v in text) or "errors" in kw:
                found.append((node, f"subprocess.{name}(text=True)"))
            continue
        if name not in _TEXT_CALLS or (name == "open" and owner in _NOT_FILES) or (name == "fdopen" and owner != "os"):
            continue
        if name == "read_text" and node.args or name == "write_text" and len(node.args) > 1:
            continue                                    # the encoding given by position
        at = _TEXT_CALLS[name]
        if name == "open" and isinstance(f, ast.Attribute) and owner not in ("io", "codecs"):
            at = 0                                      # Path.open(mode=…): the mode comes first
        if at is not None:
            mode = kw.get("mode", node.args[at] if len(node.args) > at else None)
            if name in ("NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile") and mode is None:
                continue                                # their default mode is w+b
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and "b" in mode.value:
                continue
        found.append((node, f"{owner + '.' if owner else ''}{name}()"))
    return found


def test_every_text_file_kiln_reads_or_writes_names_its_encoding():
    """Path.read_text / write_text, open() and os.fdopen in text mode, io.TextIOWrapper, tempfile's text modes and
    subprocess text pipes in pipeline/, bench/, scripts/ and the runtime (runtime/kiln_runtime/) all name their
    encoding: never the locale's."""
    import ast

    files = [p for d in ("pipeline", "bench", "runtime/kiln_runtime") for p in sorted((REPO / d).rglob("*.py"))
             if "__pycache__" not in p.parts]
    files += sorted((REPO / "scripts").glob("*.py"))
    assert len(files) > 100, len(files)
    bad = {rel(p): hits for p in files if (hits := _unencoded_text_io(ast.parse(p.read_bytes(), str(p))))}
    assert not bad, "text I/O without an encoding (add encoding=\"utf-8\"):\n" + "\n".join(
        f"  {f}:{line}: {call}" for f, hits in sorted(bad.items()) for line, call in hits)


def test_the_encoding_check_sees_each_kind_of_call():
    """The checker itself, on code that shows each case once."""
    import ast

    src = ("Path('a').read_text()\nPath('a').write_text(s)\nopen(p)\nopen(p, 'w')\nPath(p).open()\n"
           "os.fdopen(fd, 'w')\nio.TextIOWrapper(b)\nsubprocess.run(c, text=True)\ntempfile.NamedTemporaryFile('w')\n"
           "Path('a').read_text(encoding='utf-8')\nopen(p, 'rb')\nPath(p).open('rb')\nos.fdopen(fd, 'wb')\n"
           "tarfile.open(p)\nsubprocess.run(c, capture_output=True)\nopen(p, 'w', encoding='utf-8')\n"
           "subprocess.run(c, text=True, encoding='utf-8')\ntempfile.NamedTemporaryFile()\nopen(p, **kw)\n")
    assert [line for line, _ in _unencoded_text_io(ast.parse(src))] == list(range(1, 10))


# ---------------------------------------------------------------------------------------------- (f) the runtime
# kiln-runtime (runtime/, import name kiln_runtime) is what a deployment host installs: the build imports it (so what
# the gates judged is what runs), never the other way round, and its lock holds nothing of the build.
RUNTIME = REPO / "runtime"
RUNTIME_PKG = RUNTIME / "kiln_runtime"
RUNTIME_LOCKS = sorted(RUNTIME.glob("lockfile*.txt"))
# Top-level import names no runtime module may import (function level and `if TYPE_CHECKING:` included): the build's
# own package and the build-only packages. `onnx` is exactly that name: onnxruntime is the runtime's engine.
BUILD_ONLY_IMPORTS = {"pipeline", "torch", "dvc", "mlflow", "onnx", "pydantic", "model_signing", "sigstore", "yaml"}
# Distributions the runtime's locks must not hold (PEP 503 names).
BUILD_ONLY_DISTS = {"torch", "dvc", "mlflow", "mlflow-skinny", "onnx", "pydantic", "model-signing", "sigstore"}


def runtime_files() -> list[Path]:
    files = sorted(p for p in RUNTIME_PKG.rglob("*.py") if "__pycache__" not in p.parts)
    assert RUNTIME_PKG / "__init__.py" in files, f"no package at {RUNTIME_PKG}"
    return files


def every_import(path: Path) -> dict[str, int]:
    """Top-level name → first line, of every absolute import anywhere in `path` (module level, function level, under
    `if TYPE_CHECKING:`) and every `importlib.import_module("…")` / `__import__("…")` of a literal name."""
    import ast

    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            if (f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None) in \
                    ("import_module", "__import__"):
                names = [node.args[0].value]
        for n in names:
            found.setdefault(n.split(".")[0], node.lineno)
    return found


def canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def lock_entries(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """A uv/pip hash-locked requirements file: canonical name → (the requirement line, its sha256 hashes)."""
    text = re.sub(r"\\\n\s*", " ", lock.read_text(encoding="utf-8"))          # join the continuation lines
    out: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        req = line.split()[0]
        name = re.split(r"[=<>!~; \[]", req, maxsplit=1)[0]
        out[canonical(name)] = (line, re.findall(r"--hash=sha256:([0-9a-f]{64})\b", line))
    return out


def test_the_runtime_imports_nothing_of_the_build():
    """No module of runtime/kiln_runtime imports `pipeline` or a build-only package (torch, DVC, MLflow, onnx,
    pydantic, model-signing, Sigstore, PyYAML), at any level: a deployment host has none of them."""
    files = runtime_files()
    bad = {f"{rel(p)}:{line}": top for p in files for top, line in every_import(p).items()
           if top in BUILD_ONLY_IMPORTS}
    assert not bad, "the runtime imports what only the build has:\n" + "\n".join(
        f"  {where}: import {top}" for where, top in sorted(bad.items()))


def test_the_import_graph_of_the_runtime_has_no_cycles():
    found = cycles({rel(p): imports(p)[0] - {rel(p)} for p in runtime_files()})
    assert not found, "import cycles in runtime/kiln_runtime:\n" + "\n".join(" → ".join(c) for c in found)


def test_the_import_scan_sees_each_kind_of_import(tmp_path):
    """The scanner itself: function-level, TYPE_CHECKING, `from` and import_module imports all count; a relative
    import and `onnxruntime` (not `onnx`) do not trip it."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nimport onnxruntime\nfrom . import x\n"
                   "if TYPE_CHECKING:\n    import torch\n"
                   "def f():\n    from pipeline.manifest import a\n    import yaml\n"
                   "    importlib.import_module('mlflow.pyfunc')\n    return __import__('onnx')\n", encoding="utf-8")
    found = every_import(src)
    assert set(found) & BUILD_ONLY_IMPORTS == {"torch", "pipeline", "yaml", "mlflow", "onnx"}, found
    assert "onnxruntime" in found and "x" not in found


def test_the_runtime_lock_is_hash_locked_and_holds_nothing_of_the_build():
    """runtime/lockfile.txt (and each extra's lock beside it): every requirement pinned `==` with its sha256 hashes,
    none of them a build-only distribution, and each at the build lock's exact version (lockfiles/main.txt), so a
    deployment host computes with the numerics the build's gates judged."""
    assert RUNTIME / "lockfile.txt" in RUNTIME_LOCKS, RUNTIME_LOCKS
    main = lock_entries(REPO / "lockfiles/main.txt")
    for lock in RUNTIME_LOCKS:
        entries = lock_entries(lock)
        assert {"numpy", "onnxruntime"} <= set(entries), (lock.name, sorted(entries))
        unpinned = sorted(line for line, hashes in entries.values()
                          if not re.match(r"^[A-Za-z0-9._-]+==[^\s=]+ ", line + " ") or not hashes)
        assert not unpinned, f"{lock.name}: requirements not pinned with == and --hash=sha256: {unpinned}"
        assert not set(entries) & BUILD_ONLY_DISTS, f"{lock.name}: {sorted(set(entries) & BUILD_ONLY_DISTS)}"
        version = lambda line: line.split()[0].partition("==")[2]                      # noqa: E731
        off = {n: (version(line), version(main[n][0]) if n in main else None) for n, (line, _) in entries.items()
               if n not in main or version(line) != version(main[n][0])}
        assert not off, f"{lock.name}: not the build lock's versions (runtime, lockfiles/main.txt): {off}"


def test_every_package_the_runtime_imports_is_in_its_lock_or_an_extra():
    """Each third-party top-level module a runtime module imports is provided (importlib.metadata, in this venv) by a
    distribution that runtime/lockfile.txt pins or that an extra of runtime/pyproject.toml names."""
    import sys
    import tomllib
    from importlib import metadata

    project = tomllib.loads((RUNTIME / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = {canonical(re.split(r"[=<>!~; \[]", r, maxsplit=1)[0])
              for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    locked = set(lock_entries(RUNTIME / "lockfile.txt"))
    provided = metadata.packages_distributions()
    missing = {}
    for p in runtime_files():
        for top, line in every_import(p).items():
            if top in sys.stdlib_module_names or top in ("__future__", "kiln_runtime"):
                continue
            dists = {canonical(d) for d in provided.get(top, [])}
            if not dists & (locked | extras):
                missing[f"{rel(p)}:{line}"] = f"{top} ({', '.join(sorted(dists)) or 'no installed distribution'})"
    assert not missing, ("runtime imports no lock or extra provides (add the distribution to runtime/lockfile.in and "
                         "runtime/pyproject.toml, or to an extra):\n"
                         + "\n".join(f"  {w}: {m}" for w, m in sorted(missing.items())))


def test_the_closure_follows_the_runtime_like_pipeline_code(declared):
    """A pipeline module that imports kiln_runtime has the runtime's files in its closure (repo-relative:
    runtime/kiln_runtime/…), transitively, and kiln-runtime among none of its third-party distributions; the
    rendered dvc.yaml lists those paths as deps, and the stage records recognise them as the checkout's code."""
    from pipeline import records

    r = reader()
    importers = {p: ours for p in pipeline_files()
                 if (ours := {n for n in r._direct(p, p.stat().st_mtime_ns)[0] if n.split(".")[0] == "kiln_runtime"})}
    assert importers, "no module under pipeline/ imports kiln_runtime: the build must run the runtime's code"
    runtime_rel = {rel(p) for p in runtime_files()}
    for path, names in importers.items():
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        files, theirs = r.closure([module])
        direct = {rel(r.module_file(n)) for n in names} | {"runtime/kiln_runtime/__init__.py"}
        assert direct <= set(files), (module, sorted(direct - set(files)))
        assert "kiln_runtime" not in theirs and "kiln-runtime" not in r.distributions(theirs), (module, theirs)
        # transitively: what those runtime files import is in the closure too
        for f in sorted(set(files) & runtime_rel):
            for top_name in r._direct(REPO / f, (REPO / f).stat().st_mtime_ns)[0]:
                assert rel(r.module_file(top_name)) in files, (module, f, top_name)
    for f in runtime_rel:
        assert records._repo_relative(str(REPO / f)) == f
    listed = {d for s in declared.values() for d in s["deps"] if d.startswith("runtime/")}
    assert listed, "no stage lists a runtime file as a dependency"
    assert listed <= runtime_rel, sorted(listed - runtime_rel)


def test_relative_imports_in_the_checkouts_packages_count(tmp_path, monkeypatch):
    """`from . import x` / `from ..y import z` in one of the checkout's packages (the runtime may write them) are
    followed like their absolute names: the closure would otherwise miss a file the stage runs."""
    from pipeline import checkout

    r = reader()
    pkg = tmp_path / "kilnprobe"
    (pkg / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "", "b.py": "import numpy\n", "c.py": "", "d.py": "",
                       "a.py": "from . import b\nfrom .c import X\n", "sub/__init__.py": "from .. import d\n",
                       "sub/e.py": "from ..c import Y\nfrom .... import nothing\n"}.items():
        (pkg / name).write_text(text, encoding="utf-8")
    monkeypatch.setitem(checkout.PACKAGES, "kilnprobe", tmp_path)
    monkeypatch.chdir(tmp_path)
    files, theirs = r.closure(["kilnprobe.a", "kilnprobe.sub.e"])
    assert files == ["kilnprobe/__init__.py", "kilnprobe/a.py", "kilnprobe/b.py", "kilnprobe/c.py", "kilnprobe/d.py",
                     "kilnprobe/sub/__init__.py", "kilnprobe/sub/e.py"], files
    assert theirs == ["numpy"], theirs


# ---------------------------------------------------------------------------------------------- (g) tests mirror
# Modules no test imports by name are covered through the feature tests that run them, named here (file::test).
COVERED_THROUGH = {
    "pipeline/cli/": "tests/cli/test_parser.py::test_each_commands_help_parses",   # each `run`: via cli.main
    "pipeline/stages/": "tests/test_dvc_pipeline.py::test_repro_builds_then_reruns_nothing",   # the whole DAG
    "pipeline/gates/": "tests/test_dvc_pipeline.py::test_repro_builds_then_reruns_nothing",    # validate@, system@
    "pipeline/roles/": "tests/roles/test_roles.py::test_every_role_meets_the_contract",       # every registered role
    "pipeline/closure.py": "tests/test_structure.py::test_relative_imports_in_the_checkouts_packages_count",
    "pipeline/stage.py": "tests/test_dvc_pipeline.py::test_each_stage_imports_only_what_it_lists",
    "pipeline/dagtools/catalog.py": "tests/test_dvc_pipeline.py::test_each_stage_imports_only_what_it_lists",
    "pipeline/coldstart.py": "tests/targets/test_targets.py::test_a_cold_start_imports_only_the_runtime",
    "pipeline/userfiles.py": "tests/test_reliability_inputs.py",                   # every user file Kiln opens
    "pipeline/models/program.py": "tests/targets/test_aoti.py::test_program_stage_writes_a_loadable_program",
    "pipeline/quant/contract.py": "tests/quant/test_calibrate_quantize.py",
    "pipeline/registry/receipts.py":
        "tests/registry/test_registry.py::test_register_is_idempotent_and_new_bytes_make_a_new_candidate",
    "pipeline/release/golden_samples.py":
        "tests/release/test_system_release.py::"
        "test_a_host_with_another_runtime_is_refused_unless_the_golden_check_passes_there",
    "pipeline/release/attestation.py":
        "tests/release/test_release.py::test_release_is_deterministic_signed_recorded_and_verifies_offline",
    "pipeline/release/content.py": "tests/release/test_release.py::test_every_tampering_fails_naming_the_item",
    "pipeline/targets/build.py": "tests/targets/test_targets.py::test_every_registered_target_meets_the_whole_contract",
    "pipeline/targets/litert_convert.py":
        "tests/targets/test_litert.py::test_int8_is_full_integer_with_nhwc_io_and_both_are_checked_reproducible",
    "pipeline/targets/trt_options.py": "tests/targets/test_tensorrt.py::test_params_map_to_builder_plan",
    "runtime/kiln_runtime/":
        "tests/release/test_system_release.py::test_the_runtime_alone_runs_the_release_as_the_build_does",
}


def modules_named_by_tests() -> set[str]:
    """The checkout's modules some test imports (the DAG's own reader on every test file)."""
    r = reader()
    return {rel(f) for t in (REPO / "tests").rglob("*.py") if "__pycache__" not in t.parts
            for n in r._direct(t, t.stat().st_mtime_ns)[0] if (f := r.module_file(n)) is not None}


def test_tests_mirror_the_source_and_name_every_module():
    """A test about one module is tests/<package>/test_<module>.py; every module of pipeline/ and the runtime is
    imported by a test, mirrored by one, or covered through a feature test named in COVERED_THROUGH — which must
    exist (file and test function)."""
    mods = sorted(rel(p) for d in (PIPELINE, REPO / "runtime" / "kiln_runtime") for p in d.rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)
    named = modules_named_by_tests()

    def mirrored(m: str) -> bool:
        parts = Path(m).with_suffix("").parts[1:]            # pipeline/release/system.py → release, system
        return (REPO / "tests" / Path(*parts[:-1]) / f"test_{parts[-1]}.py").is_file()

    def through(m: str) -> str | None:
        return next((v for k, v in COVERED_THROUGH.items() if m == k or (k.endswith("/") and m.startswith(k))), None)

    bare = [m for m in mods if m not in named and not mirrored(m) and through(m) is None]
    assert not bare, "modules no test names (import one, mirror it in tests/<package>/, or name the feature test " \
                     "in COVERED_THROUGH):\n  " + "\n  ".join(bare)
    for ref in COVERED_THROUGH.values():
        file, _, test = ref.partition("::")
        assert (REPO / file).is_file(), ref
        assert not test or re.search(rf"(?m)^def {test}\(", (REPO / file).read_text(encoding="utf-8")), ref
    stale = [k for k in COVERED_THROUGH if not any(m == k or m.startswith(k) for m in mods)]
    assert not stale, f"COVERED_THROUGH names what is no module: {stale}"


def test_the_distributions_of_imports_are_metadata_s_answer_kept_per_installed_set(tmp_path, monkeypatch):
    """A stage's package versions come from packages_distributions(), kept beside the environment: the kept answer is
    metadata's, one that is not a mapping is asked again, and another installed set (a package added) is another
    key whose answer replaces the old one."""
    import json
    import sys
    from importlib import metadata

    from pipeline import closure

    asked = {k: list(v) for k, v in metadata.packages_distributions().items()}
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    closure._distributions.cache_clear()
    try:
        assert closure._distributions() == asked
        (kept,) = tmp_path.glob(f"{closure.DISTRIBUTIONS_CACHE}*.json")
        assert json.loads(kept.read_text(encoding="utf-8")) == asked
        kept.write_text('["not a mapping"]', encoding="utf-8")
        closure._distributions.cache_clear()
        assert closure._distributions() == asked and json.loads(kept.read_text(encoding="utf-8")) == asked
        site = tmp_path / "site"
        (site / "newpkg-1.0.dist-info").mkdir(parents=True)
        monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
        closure._distributions.cache_clear()
        assert closure._distributions() == asked                     # not a real install: metadata's answer again
        (now,) = tmp_path.glob(f"{closure.DISTRIBUTIONS_CACHE}*.json")
        assert now != kept and not kept.exists()
    finally:
        closure._distributions.cache_clear()
