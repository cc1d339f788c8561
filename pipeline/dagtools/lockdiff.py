"""A rebuild's dvc.lock against the committed one, stage by stage: the class of every stage, on any CPU.

The rule is the same on every host: a stage whose inputs (data and code deps, params, target fingerprint) are the
committed ones must give the committed outputs — `bit-identical`, or `different`, which is a reproducibility bug.
A stage can have other inputs for one of two reasons, each named:

* `host-bound` — it tracks a compiler target's fingerprint and this CPU's differs (the ISA flags are ort-cpu and
  aoti-cpu rebuild keys: another CPU compiles other engines, by design);
* `follows its inputs` — an input it reads differs (downstream of a host-bound stage: validations, registrations).

A stage with the committed inputs but other outputs is `different` — unless this CPU is of another ISA class than
the committed build's and the stage is not portable: it computes on the host's float kernels on purpose or by
nature (debug-precision@ measures this CPU's int8 kernels; gallery@ and the FAISS index follow NumPy's and FAISS's
SIMD width), so it is `host kernels`, named.

The portable stages (`Stage.portable`: datasets, golden references, export and import, program, calibration,
quantization) compute on the same kernels on every x86-64 CPU (pipeline/portable.py), so their inputs never depend
on the host: on another CPU they must still be bit-identical. Stages made of timings are `not reproducible` and say why.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from pipeline.dvcfiles import dvc_files, read_locks
from pipeline.errors import KilnError

# Lock entries a rebuild cannot reproduce, and why (docs/reproducibility.md: "A fresh clone at another path").
# toolchain/dvc.lock is not compared at all: it is the host's fingerprint (its CPU flags, compiler), probed on
# every run.
NOT_REPRODUCIBLE = {
    "toolchain": "the host's fingerprint: its CPU flags, compilers and packages",
    "bench@": "timings of one run",
    "sysbench@": "timings of one run under load (uncached)",
    "match@": "the index choice follows measured latency; its verdict and curve hold timings",
    "register-index@": "depends on the matching verdict's timings",
    "leaderboard": "ranks engines by the bench's timings",
}
CLASSES = ("bit-identical", "host-bound", "follows its inputs", "host kernels", "not reproducible", "different",
           "not in the committed lock")
FINGERPRINTS = "artifacts/toolchain/"
PYTHON = "artifacts/toolchain/python.yaml"


def target_keys(entry: dict) -> dict:
    """A stage's target fingerprints (this host's CPU and compilers), from its params section."""
    return {p: v for p, v in entry.get("params", {}).items() if p.startswith(FINGERPRINTS) and p != PYTHON}


def _deps(entry: dict) -> dict[str, str | None]:
    return {d["path"]: d.get("md5") for d in entry.get("deps", [])}


def isa(lock: dict[str, dict]) -> list | None:
    """The CPU's kernel-selecting ISA flags, as the first target fingerprint that keys on them recorded."""
    for entry in lock.values():
        for fingerprint in target_keys(entry).values():
            if isinstance(fingerprint, dict) and "isa" in fingerprint.get("rebuild_on", {}):
                return fingerprint["rebuild_on"]["isa"]
    return None


def portable_groups() -> set[str]:
    from pipeline.dagtools import catalog

    return {d.name for d in catalog.declared() if catalog.load(d).portable}


def classify(name: str, built: dict, committed: dict | None, other_isa: bool = False,
             portable: frozenset[str] | set[str] = frozenset()) -> tuple[str, str]:
    """(class, why) of one stage's built lock entry against the committed entry (None: not committed); `other_isa`:
    this build's CPU is of another ISA class than the committed build's; `portable`: the portable stage groups."""
    reason = next((why for prefix, why in NOT_REPRODUCIBLE.items() if name.startswith(prefix)), None)
    if reason is not None:
        return "not reproducible", reason
    if committed is None:
        return "not in the committed lock", "commit the lock of this code (kiln dag --write && dvc repro)"
    if built == committed:
        return "bit-identical", ""
    keys, was = target_keys(built), target_keys(committed)
    if keys != was:
        changed = sorted(p.removeprefix(FINGERPRINTS) for p in set(keys) | set(was) if keys.get(p) != was.get(p))
        return "host-bound", f"built for this host's {', '.join(changed)} fingerprint"
    deps, before = _deps(built), _deps(committed)
    other = sorted(p for p in set(deps) | set(before) if deps.get(p) != before.get(p))
    if other or built.get("params", {}) != committed.get("params", {}) or built.get("cmd") != committed.get("cmd"):
        what = other[0] if other else "its params or command"
        more = f" (+{len(other) - 1} more)" if len(other) > 1 else ""
        return "follows its inputs", f"{what}{more} differs"
    outs = sorted(o["path"] for o in built.get("outs", []) if o not in committed.get("outs", []))
    if other_isa and name.split("@")[0] not in portable:
        return "host kernels", f"not portable: computed on this CPU's float kernels ({', '.join(outs) or 'outputs'})"
    if not outs:         # equal inputs and outputs, the entries still differ: its form (a dependency listed twice)
        return "different", (f"same inputs and outputs, another form of entry (a dependency listed twice?): "
                              f"re-record it, dvc repro -f -s {name}")
    return "different", f"same inputs, other outputs: {', '.join(outs)}"


def classify_all(built: dict[str, dict], committed: dict[str, dict],
                 portable: set[str] | None = None) -> dict[str, tuple[str, str]]:
    """Every built stage's (class, why), by stage name."""
    other_isa = isa(built) != isa(committed)
    portable = portable_groups() if portable is None else portable
    return {name: classify(name, entry, committed.get(name), other_isa, portable)
            for name, entry in sorted(built.items())}


def render(classes: dict[str, tuple[str, str]]) -> str:
    """One line per class (its count), then one line per stage that is not bit-identical."""
    lines = []
    for c in CLASSES:
        n = sum(1 for k, _ in classes.values() if k == c)
        if n:
            lines.append(f"{c}: {n}")
    lines += [f"  {name}: {c}{' — ' + why if why else ''}" for name, (c, why) in classes.items()
              if c != "bit-identical"]
    return "\n".join(lines)


def _git(args: list[str], root: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, encoding="utf-8",
                              errors="replace")
    except FileNotFoundError:
        raise KilnError("git not found: the committed dvc.lock files are read from git",
                        "install git, or run this in a clone of the repository") from None


def resolve(rev: str, root: Path = Path(".")) -> str:
    """`rev` as the full SHA of the commit it names in this repository. A user's value never reaches git as an
    option: `--end-of-options` before it (`--against=--output=FILE` is a revision that does not resolve, not
    git's --output), and only the resolved hex SHA is used after."""
    shown = rev if len(rev) <= 80 and rev.isprintable() else repr(rev[:80]) + "…"
    hint = "pass a commit of this repository (a branch, a tag or a SHA; default HEAD)"
    if not rev or "\0" in rev:
        raise KilnError(f"--against {shown or '(empty)'}: not a commit", hint)
    r = _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"], root)
    sha = r.stdout.strip()
    if r.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", sha):
        raise KilnError(f"--against {shown}: not a commit of this repository", hint)
    return sha


def committed_locks(rev: str, root: Path = Path(".")) -> dict[str, dict]:
    """Every stage's lock entry as commit `rev` has it (the project's dvc.lock files read from git)."""
    import yaml

    sha = resolve(rev, root)
    out: dict[str, dict] = {}
    for f in dvc_files(root):
        rel = f.with_name("dvc.lock").relative_to(root).as_posix()
        r = _git(["show", "--end-of-options", f"{sha}:{rel}"], root)
        if r.returncode == 0:
            out.update((yaml.safe_load(r.stdout) or {}).get("stages", {}))
        elif "exists on disk, but not in" not in r.stderr and "does not exist in" not in r.stderr:
            raise KilnError(f"git show {sha[:12]}:{rel}: {r.stderr.strip()[:200]}", "pass a commit of this repository")
    return out


def main(rev: str = "HEAD", root: Path = Path(".")) -> int:
    """`kiln lock-classes`: this workspace's dvc.lock files (after `dvc repro`) against commit `rev`'s; exit 1 when
    a stage with the committed inputs gave other outputs, or a portable stage is not bit-identical."""
    committed = committed_locks(rev, root)
    if not committed:
        raise KilnError(f"{rev}: no dvc.lock committed there", "pass the commit whose build you reproduce")
    built, portable = read_locks(root), portable_groups()
    classes = classify_all(built, committed, portable)
    where = f"this CPU's ISA {isa(built)}, the committed build's {isa(committed)}"
    print(f"lock classes against {rev} ({where}):\n{render(classes)}")
    bad = [n for n, (c, _) in classes.items()
           if c in ("different", "not in the committed lock") or (n.split("@")[0] in portable and c != CLASSES[0])]
    if bad:
        print(f"kiln: gate failed: {len(bad)} stage(s) not reproduced: {', '.join(bad[:8])}")
        return 1
    return 0
