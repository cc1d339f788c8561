"""The lock classes (pipeline/dagtools/lockdiff.py) on hand-made lock entries, and the portable kernels' edge: a library
user of a portable stage keeps the host's kernels and its manifest says so."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO
from pipeline import portable
from pipeline.dagtools.lockdiff import classify, classify_all, isa, render

FP = "artifacts/toolchain/ort-cpu.yaml"


def entry(dep="a1", out="o1", isa=("avx2",), cmd="python -m pipeline.stages.compile e") -> dict:
    return {"cmd": cmd, "deps": [{"path": "artifacts/export/e", "md5": dep}, {"path": "pipeline/x.py", "md5": "c"}],
            "params": {"params.yaml": {"engines.e": {"target": "ort-cpu"}},
                       FP: {"rebuild_on": {"isa": list(isa)}}},
            "outs": [{"path": "artifacts/engines/e", "md5": out}]}


def test_each_class_from_hand_made_entries():
    base = entry()
    assert classify("compile@e", entry(), base) == ("bit-identical", "")
    assert classify("compile@e", entry(isa=("avx512f",), out="o2"), base) == \
        ("host-bound", "built for this host's ort-cpu.yaml fingerprint")
    assert classify("validate@e", entry(dep="a2", out="o2"), base) == \
        ("follows its inputs", "artifacts/export/e differs")
    assert classify("validate@e", entry(cmd="python -m other"), base)[0] == "follows its inputs"
    assert classify("compile@e", entry(out="o2"), base) == \
        ("different", "same inputs, other outputs: artifacts/engines/e")
    twice = entry()
    twice["deps"].insert(0, dict(twice["deps"][0]))       # a stale entry: a dependency listed twice, same values
    assert classify("import@e", twice, base) == ("different", "same inputs and outputs, another form of entry (a "
                                                 "dependency listed twice?): re-record it, dvc repro -f -s import@e")
    assert classify("bench@embedder", entry(out="o2"), base) == ("not reproducible", "timings of one run")
    assert classify("compile@new", entry(), None)[0] == "not in the committed lock"


def test_on_another_isa_only_a_portable_stage_must_still_match():
    """Same inputs, other outputs: a bug on the committed build's ISA class; on another class a stage that computes on
    the host's float kernels (not portable) is `host kernels`, while a portable one stays `different`."""
    other = entry(out="o2")
    assert classify("gallery@10000", other, entry(), other_isa=True, portable={"golden"})[0] == "host kernels"
    assert classify("golden@pnet", other, entry(), other_isa=True, portable={"golden"})[0] == "different"
    assert classify("gallery@10000", other, entry(), other_isa=False, portable={"golden"})[0] == "different"
    built, was = {"compile@e": entry(isa=("avx2",))}, {"compile@e": entry(isa=("avx512f",))}
    assert isa(built) == ["avx2"] and isa(was) == ["avx512f"] and isa({}) is None
    assert classify_all({**built, "gallery@1": other}, {**was, "gallery@1": entry()}, portable=set())[
        "gallery@1"][0] == "host kernels"


def test_render_counts_every_class_and_names_each_exception():
    classes = classify_all({"a": entry(), "b": entry(out="o2"), "bench@m": entry()},
                           {"a": entry(), "b": entry(), "bench@m": entry()}, portable=set())
    text = render(classes)
    assert text.splitlines()[:3] == ["bit-identical: 1", "not reproducible: 1", "different: 1"], text
    assert "  b: different — same inputs, other outputs: artifacts/engines/e" in text and "  a:" not in text


def test_a_library_user_keeps_the_host_kernels_and_is_told_so():
    """pin() relaunches only the stage's own program; imported by another program (pytest, a notebook) it leaves
    the process alone, and kernels() names the host's capability instead of claiming portability."""
    probe = ("import os; from pipeline import portable; portable.pin('pipeline.stages.golden'); "
             "print(os.environ.get('ATEN_CPU_CAPABILITY'), portable.kernels().split(':')[0])")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "host"], r.stdout


def test_the_portable_modules_list_is_the_declarations():
    """pipeline/__init__.py relaunches a portable stage by its module's name before importing it, from
    `portable.MODULES`: a portable stage missing there would still be pinned (by `pin`), one kernel load later."""
    from pipeline import portable
    from pipeline.dagtools import catalog

    declared = {catalog.load(d).module for d in catalog.declared() if catalog.load(d).portable}
    assert declared == {f"{portable.STAGE_PACKAGE}.{m}" for m in portable.MODULES}


def test_a_portable_stage_relaunches_before_it_imports_pytorch():
    """`python -m pipeline.stages.golden` execs with the portable settings before the stage module (and PyTorch)
    load: the first process imports only `pipeline` (≈ 1.5 s of PyTorch per portable stage otherwise). Read from
    `-X importtime`, which both processes write: each ends its start-up with the `site` import's line."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipeline.stages.golden", "--help"],
                       capture_output=True, text=True, cwd=REPO, env={k: v for k, v in os.environ.items()
                                                                      if k not in portable.ENV})
    assert r.returncode == 0, r.stderr[-2000:]
    processes = [[]]
    for line in r.stderr.splitlines():
        processes[-1].append(line)
        if line.rstrip().endswith("| site"):
            processes.append([])
    processes = processes[1:]           # what each process imported after its start-up
    assert len(processes) == 2, f"{len(processes)} processes"
    first = " ".join(processes[0])
    assert "pipeline.portable" in first and "torch" not in first and "pipeline.stages" not in first
    assert "torch" in " ".join(processes[1])
