"""toolchain (always runs, one cheap process): every configured target's toolchain fingerprint, and the versions of
the Python packages the stages import.

* artifacts/toolchain/<target>.yaml — `rebuild_on` (compiler/runtime versions, ISA, device) and `available`;
  compile@ and validate@ list only its `rebuild_on` under `params:` in dvc.yaml, so an upgrade of that target's
  toolchain reruns exactly that target's engines, and reverting restores them from DVC's run cache.
* artifacts/toolchain/python.yaml — Python major.minor and each imported distribution's version (read from package
  metadata, nothing imported); every stage tracks the packages its own code closure imports.

A file is rewritten only when its content changed, so a no-op `dvc repro` runs this stage and nothing else. The
probes avoid heavy imports (torch's flags are cached per torch + compiler + CPU; see pipeline/targets/aoti.py).
Host facts that are not rebuild keys (CPU model, host name) are in the stage's record, not in these files.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pipeline import paths, stage, targets, toolchain
from pipeline.checkout import PACKAGES
from pipeline.closure import closure, distributions
from pipeline.toolchain import PYTHON_TOOLCHAIN
from pipeline.manifest import write_bytes_atomic
from pipeline.targets.base import Toolchain

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "toolchain", "pipeline.stages.toolchain",
    "toolchain fingerprints of every configured target + Python package versions (one cheap process; a file "
    "changes only when a fingerprint does)",
    # persist: DVC must not delete them before the stage runs, or every run would rewrite them
    outs=lambda cfg, key: [stage.Out(paths.toolchain_file(t).as_posix(), cache=False, persist=True)
                           for t in cfg.targets] + [stage.Out(PYTHON_TOOLCHAIN, cache=False, persist=True)],
    always_changed=True,
    help="write every target's toolchain fingerprint and the Python package versions")


def all_packages() -> list[str]:
    """Every third-party distribution imported anywhere in the checkout's code, pipeline/ and runtime/kiln_runtime/
    (what python.yaml lists). Walking the code and the installed distributions takes most of this stage's time, so
    the answer is cached under what it depends on: each module's path, size and mtime, and the interpreter's package
    directories (an install changes them)."""
    files = sorted((root, p) for name, root in PACKAGES.items() for p in (root / name).rglob("*.py"))

    def compute() -> list[str]:
        modules = [".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__") for root, p in files]
        return distributions(closure(modules)[1])

    stat = lambda p: [str(p), p.stat().st_size, p.stat().st_mtime_ns]      # noqa: E731
    key = ["packages/2", sys.version, sys.prefix, [stat(p) for _, p in files],
           [stat(Path(d)) for d in sys.path if d and Path(d).is_dir()]]
    return toolchain.cached(key, compute)


def _write_if_changed(path: Path, doc: dict) -> bool:
    data = yaml.safe_dump(doc, sort_keys=True).encode()
    if path.is_file() and path.read_bytes() == data:
        return False
    write_bytes_atomic(path, data)
    return True


def probe(target_name: str) -> Toolchain:
    return targets.get(target_name).probe()


def write(target_name: str, tc: Toolchain, root: Path = Path(".")) -> tuple[Path, bool]:
    doc = {"target": tc.target, "available": tc.available, "reason": tc.reason, "rebuild_on": tc.rebuild_on}
    path = paths.toolchain_file(target_name, root)
    return path, _write_if_changed(path, doc)


def write_python(root: Path = Path(".")) -> tuple[Path, bool]:
    path = root / PYTHON_TOOLCHAIN
    doc = {"python": toolchain.python_version(),
           "packages": {p: toolchain.version(p) for p in all_packages()}}
    return path, _write_if_changed(path, doc)


def run(cfg: Config, root: Path = Path(".")) -> dict[str, tuple[Toolchain, Path, bool]]:
    out = {}
    for name in cfg.targets:
        tc = probe(name)
        out[name] = (tc, *write(name, tc, root))
    return out


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        results = run(args.cfg)
        path, changed = write_python()
        run_.record["info"] = {}
        for name, (tc, p, ch) in results.items():
            run_.record["info"][name] = tc.info
            print(f"{tc.line()} → {p}{' (changed)' if ch else ''}")
        print(f"python packages → {path}{' (changed)' if changed else ''}")
        return 0

    return stage.main(STAGE, body, argv)


if __name__ == "__main__":
    sys.exit(main())
