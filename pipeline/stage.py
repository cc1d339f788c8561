"""A stage's declaration and its run edge: what every stage module imports.

A stage module (pipeline/stages/*.py) declares one `STAGE = Stage(...)`: the dvc.yaml group it becomes (one stage,
or `foreach` over keys such as models or engines), its data deps, params and outs. `pipeline/dagtools/dag.py` renders
dvc.yaml from these declarations, and the stage uses the same declaration at run time, so what a manifest records
(code digests, parameter values) is exactly what DVC tracks:

* code — the closure of `pipeline/` modules the stage's module imports, plus the modules it loads by name (a
  model's factory, an engine's target): derived, never hand-listed (pipeline/closure.py). The record of each run
  lists the modules really imported, and a test checks they are covered.
* params — the params.yaml keys the stage reads; packages — the versions of the third-party distributions its
  closure imports (artifacts/toolchain/python.yaml), so a lockfile bump reruns exactly the stages that use it — less
  the `probes` a stage only asks a question of (their versions go to the run's record).

`main` is a stage module's CLI: it parses, loads params, runs the stage inside `running` (which writes the run's
record, pipeline/records.py) and maps Kiln's errors to exit codes (`report_errors`).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pipeline import portable
from pipeline.closure import closure, code_digests, distributions
from pipeline.dvcfiles import dvcfile
from pipeline.errors import GateFailed, KilnError, Terminated, exit_quietly, handle_sigterm
from pipeline.records import write_record
from pipeline.toolchain import read_fingerprint, versions

if TYPE_CHECKING:
    from pipeline.config import Config

__all__ = ["Out", "Stage", "Run", "report_errors", "printable_streams", "parser", "running", "main"]


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


def _none(cfg: Config, key) -> list:
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
    help: str = ""                              # the line `kiln --help` shows for it (empty: desc)
    portable: bool = False                      # its outputs are every host's: computed on portable float kernels
    probes: tuple[str, ...] = ()                # distributions it only asks a question of (import@: a target's op
                                                # support): versions in its run record, never in its identity

    @property
    def dvcfile(self) -> str:
        return dvcfile(self.group)

    def name(self, key: str | None = None) -> str:
        return self.group if key is None else f"{self.group}@{key}"

    def code(self, cfg: Config, key: str | None) -> list[str]:
        """Files of the stage's closure: its own module's plus the modules it loads by name."""
        return closure([self.module, *self.dynamic(cfg, key)])[0]

    def packages(self) -> list[str]:
        """Distributions the stage's own module closure imports (a dynamic module's are its target's keys), less its
        probes: a portable stage whose output followed OpenVINO's version (import@ asks OpenVINO which ops it can
        run) would rerun, and rebuild every engine after it, whenever a host image updates one target."""
        return [d for d in distributions(closure([self.module])[1]) if d not in self.probes]

    def param_values(self, cfg: Config, key: str | None) -> dict[str, Any]:
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

    def identity(self, cfg: Config, key: str | None, root: Path = Path("."),
                 toolchain: dict[str, Any] | None = None) -> dict[str, Any]:
        """The manifest fields that say what ran: code digests, params slice, toolchain (packages + targets)."""
        chain = {**versions(*self.packages()), **(toolchain or {})}
        for target in self.targets(cfg, key):
            chain[f"target.{target}"] = read_fingerprint(target, root)["rebuild_on"]
        if self.portable:
            chain["float_kernels"] = portable.kernels()
        return {"code": code_digests(self.code(cfg, key)), "params": self.param_values(cfg, key),
                "toolchain": chain}


# ---------------------------------------------------------------------------------------------- CLI edge
def printable_streams() -> None:
    """stdout and stderr escape what their encoding cannot show (`\\u2014`) instead of raising: under an ASCII locale
    (LC_ALL=C, PYTHONUTF8=0) every line holding `—`, `×` or `→`, `--help` included, was a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower().replace("-", "") != "utf8":
            stream.reconfigure(errors="backslashreplace")


def report_errors(fn: Callable[[], int]) -> int:
    """Run `fn`; turn Kiln's errors into one line + hint and the documented exit code (1 gate, 2 user error).
    SIGTERM is handled like Ctrl-C (exit 143): it unwinds through the same cleanup; one during the exit that
    follows ends the process at once, quietly (`exit_quietly`)."""
    printable_streams()
    handle_sigterm()
    try:
        return _report(fn)
    finally:
        exit_quietly()


def _report(fn: Callable[[], int]) -> int:
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
    printable_streams()
    p = parser(stage, key_help)
    if build:
        build(p)
    args = p.parse_args(argv)

    def go() -> int:
        from pipeline import config, paths

        if stage.portable:
            portable.pin(stage.module)
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
