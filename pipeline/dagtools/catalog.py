"""The stages the project declares: every module under pipeline/stages/ that holds a `STAGE`, found by its name.

Nothing lists the stages by hand: `kiln` (its subcommands and help) and `kiln dag` (dvc.yaml) both take them from
here. `declared` reads each module's `STAGE = Stage("name", "module", "desc", ..., help="...")` without importing
it — `kiln --help` and `kiln verify` must not import every stage's libraries (torch among them) — and `load`
imports one and checks that its STAGE says what was read. A declaration whose name, module or descriptions are not
literal strings is read by importing its module. Stages are listed by name: the DAG's order depends on params.yaml,
the CLI's list must not.

A stage's module is named after the stage (`module_for`): '-' becomes '_', and a Python keyword gets a trailing
'_' (`fallback-table` → pipeline/stages/fallback_table.py, `import` → pipeline/stages/import_.py).
"""

from __future__ import annotations

import ast
import importlib
import keyword
import pkgutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import KilnError

PACKAGE = "pipeline.stages"
DIR = Path(__file__).resolve().parents[1] / "stages"
FIELDS = ("group", "module", "desc")            # Stage's first positional fields; `help` is keyword-only in use


@dataclass(frozen=True)
class Declared:
    """What a stage module's STAGE says about itself, read without importing it."""

    name: str                                   # STAGE.group: `kiln <name>`, the dvc.yaml group
    module: str                                 # its module, `python -m <module>`
    desc: str
    help: str = ""


def module_for(name: str) -> str:
    """The module of the stage `name` by the naming convention (`debug-precision` → pipeline.stages.debug_precision,
    `import` → pipeline.stages.import_)."""
    base = name.replace("-", "_")
    return f"{PACKAGE}.{base}_" if keyword.iskeyword(base) else f"{PACKAGE}.{base}"


def declared() -> list[Declared]:
    """Every stage under pipeline/stages/, by name."""
    found: dict[str, Declared] = {}
    for info in pkgutil.iter_modules([str(DIR)]):
        if info.ispkg or info.name.startswith("_"):
            continue
        d = _read(DIR / f"{info.name}.py", f"{PACKAGE}.{info.name}")
        if d is None:
            continue
        if d.name in found:
            raise KilnError(f"stage {d.name!r} is declared by both {found[d.name].module} and {d.module}",
                            "a stage name belongs to one module")
        found[d.name] = d
    return [found[n] for n in sorted(found)]


def find(name: str) -> Declared | None:
    """The declared stage `name`; None if no module declares it. Its conventional module is read first."""
    module = module_for(name)
    path = DIR / (module.rpartition(".")[2] + ".py")
    if module.rpartition(".")[2].isidentifier() and path.is_file() and (d := _read(path, module)) and d.name == name:
        return d
    return next((d for d in declared() if d.name == name), None)


def load(d: Declared):
    """Import a declared stage's module; its `STAGE` (a pipeline.stage.Stage), checked against the declaration."""
    spec = importlib.import_module(d.module).STAGE
    if (spec.group, spec.module, spec.desc, spec.help) != (d.name, d.module, d.desc, d.help):
        raise KilnError(f"{d.module}: STAGE differs from its declaration as read ({spec.group!r} vs {d.name!r})",
                        "assign STAGE once, at module level")
    return spec


def _read(path: Path, module: str) -> Declared | None:
    """`path`'s top-level `STAGE = ...Stage(...)`, read statically; None when the module declares no STAGE."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    call = next((node.value for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                 and any(isinstance(t, ast.Name) and t.id == "STAGE"
                         for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))), None)
    if call is None:
        return None
    try:
        if not isinstance(call, ast.Call):
            raise ValueError
        fields = dict(zip(FIELDS, call.args))
        fields.update((k.arg, k.value) for k in call.keywords if k.arg in (*FIELDS, "help"))
        values = {k: ast.literal_eval(v) for k, v in fields.items()}
        d = Declared(values["group"], values["module"], values["desc"], values.get("help", ""))
    except (ValueError, KeyError, TypeError, SyntaxError):        # not literals: ask the module itself
        spec = importlib.import_module(module).STAGE
        d = Declared(spec.group, spec.module, spec.desc, spec.help)
    if d.module != module:
        raise KilnError(f"{path}: its STAGE says module {d.module!r}", f"declare module={module!r}")
    return d
