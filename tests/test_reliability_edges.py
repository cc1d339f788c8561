"""Reliability, issue 44 items 5 and 6: what a user's value can make a subprocess do, what a plan may ask of a host,
and the environment Kiln runs in.

* [option injection] (5) A value that reaches git or qemu is validated for what it must be — a revision resolved by
  `git rev-parse --verify --end-of-options` to its SHA, a CPU model from qemu-x86_64's own list — so
  `--against=--output=FILE` is a revision that does not exist, never git's --output.
* [bounds] (6) sysbench's plan is bounded in params (streams, frames a second offered, batch), refused before any
  work; after the sweep the workers stop and nothing is left for the interpreter's exit to wait on (a queue's
  feeder thread blocked on a pipe no worker read hung the process until killed); a signal during that exit ends it
  quietly with 143 / 130.
* [environment] (6) With PYTHONUTF8=0 and an ASCII locale every command worked no more: every text file Kiln reads or
  writes names its encoding (tests/test_structure.py checks the code for it), and output the terminal cannot show
  is escaped, never a crash.

None needs a built project: each case stops before a stage's work, or runs a stand-in worker for seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, write_params
from reliability import PY, _env, clean_error, kiln
from pipeline import config
from pipeline.dvcfiles import dvc_files
from pipeline.errors import KilnError


# ---------------------------------------------------------------------------------------------- [option injection]
def test_a_revision_is_never_an_option_to_git(tmp_path):
    """`--against=--output=PATH` made `git show` write PATH:<each dvc.lock> (the folders exist here, so git could)."""
    out = tmp_path / "out"
    for f in dvc_files(REPO):
        (tmp_path / f"out:{f.parent.relative_to(REPO).as_posix()}").mkdir(parents=True, exist_ok=True)
    for against in (f"--output={out}", "--no-such-option", "no-such-rev"):
        clean_error(kiln(REPO, "lock-classes", f"--against={against}", timeout=120), 2, "not a commit")
    assert not [p for p in tmp_path.rglob("*") if not p.is_dir()], sorted(tmp_path.rglob("*"))


def test_a_revision_resolves_to_its_commit():
    from pipeline.dagtools.lockdiff import resolve

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    assert resolve("HEAD", REPO) == head.decode().strip()
    for bad in ("--output=x", "HEAD\n", "", "HEAD:params.yaml"):
        with pytest.raises(KilnError, match="not a commit"):
            resolve(bad, REPO)


@pytest.mark.parametrize("cpu, needle", [("--foo", "not a CPU model name"), ("-d", "not a CPU model name"),
                                         ("EPYC-Rome,+avx512f", "not a CPU model name"),
                                         ("Pentium-9000", "not a CPU model qemu-x86_64 knows")])
def test_a_cpu_model_comes_from_the_emulators_own_list(cpu, needle):
    """Checked before anything else (this checkout has not built dataset@golden: the CPU is refused first)."""
    if needle.endswith("knows") and not any(os.access(os.path.join(d, "qemu-x86_64"), os.X_OK)
                                            for d in os.environ.get("PATH", "").split(os.pathsep)):
        needle = "qemu-x86_64 not found"
    clean_error(kiln(REPO, "rebuild-check", f"--cpu={cpu}", "dataset@golden", timeout=120), 2, needle)


# ---------------------------------------------------------------------------------------------- [bounds]
@pytest.mark.parametrize("change, needle", [
    ({"streams": [100000]}, "100000 streams: more than any host can serve (at most 1024"),
    ({"streams": [1, 100], "fps": 240}, "100 streams × 240 fps = 24000 frames/s"),
    ({"max_batch": 1000}, "sysbench.max_batch: 1000 frames a batch"),
])
def test_a_sysbench_plan_no_host_could_run_is_refused_with_the_params(tmp_path, change, needle):
    with pytest.raises(KilnError, match="sysbench") as e:
        config.load(write_params(tmp_path, lambda raw: raw["sysbench"].update(change)))
    assert needle in e.value.message and e.value.hint, e.value


FAKE_WORKERS = '''
import os, time
def stalled(maker, kwargs, threads, frames, budget_ms, max_batch, current, jobs, results):
    results.put(("ready", os.getpid(), {}))
    time.sleep(600)                 # a worker stuck in one batch: it reads no job again
def dies(*args):
    os._exit(9)                     # killed while loading (the OS, out of memory): it says nothing
'''

SWEEP = '''
import sys, time
from types import SimpleNamespace as NS
import numpy as np
sys.path.insert(0, sys.argv[1])
import fakeworker
from kiln_runtime import loadtest
from pipeline.sysbench import load
from pipeline.stage import report_errors
loadtest._worker, loadtest.WARMUP_S, loadtest.STOP_TIMEOUT_S = getattr(fakeworker, sys.argv[2]), 0.1, 1.0
cfg = NS(source="p", sysbench=NS(streams=(40,), fps=240.0, seconds=0.1, p99_budget_ms=100.0, max_batch=8, workers=1))
def go():
    r = load.sweep(cfg, "stub", {}, [np.zeros((4, 4, 3), np.uint8)], progress=lambda m: None)
    print("swept", r["points"][0]["frames"], r["streams_at_budget"], flush=True)
    return 0
raise SystemExit(report_errors(go))
'''


def test_the_sweep_exits_when_it_is_done(tmp_path):
    """40 streams × 240 fps for 0.2 s queue ~2 000 jobs, more than a pipe holds, for one worker that reads none: the
    old stop waited 10 s, terminated it, returned — and the process then hung at exit on the queue's feeder thread."""
    (tmp_path / "fakeworker.py").write_text(FAKE_WORKERS, encoding="utf-8")
    t0 = time.monotonic()
    try:
        r = subprocess.run([PY, "-c", SWEEP, str(tmp_path), "stalled"], cwd=REPO, env=_env(), capture_output=True,
                           text=True, encoding="utf-8", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit after the sweep (hung at exit)")
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    assert r.stdout.split() == ["swept", "960", "0"], r.stdout     # 40 streams × 24 frames measured, none decided
    assert time.monotonic() - t0 < 30


def test_a_worker_that_dies_while_loading_is_one_line_at_once(tmp_path):
    """It used to leave the parent waiting READY_TIMEOUT_S (300 s) for a message that never came."""
    (tmp_path / "fakeworker.py").write_text(FAKE_WORKERS, encoding="utf-8")
    r = subprocess.run([PY, "-c", SWEEP, str(tmp_path), "dies"], cwd=REPO, env=_env(), capture_output=True,
                       text=True, encoding="utf-8", timeout=60)
    clean_error(r, 2, "a worker exited (code 9) while loading the system")


def test_a_signal_while_the_process_exits_ends_it_quietly():
    """SIGTERM during the interpreter's exit (after the command's work) used to print a traceback."""
    code = textwrap.dedent('''
        import atexit, os, signal, time
        from pipeline.stage import report_errors
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30)))   # killed while exiting
        raise SystemExit(report_errors(lambda: print("done") or 0))
    ''')
    r = subprocess.run([PY, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (143, "done\n", ""), (r.returncode, r.stdout, r.stderr[-3000:])


# ---------------------------------------------------------------------------------------------- [environment]
@pytest.mark.parametrize("args", [["--help"], ["targets"], ["deps", "compile@embedder-ort-cpu-fp32"], ["dag"]])
def test_commands_work_in_an_ascii_locale(args):
    """PYTHONUTF8=0 LC_ALL=C: `kiln --help` died with a UnicodeDecodeError reading the stage catalog; these read
    params.yaml, the dvc.yaml files and the code, and print text with `—`, `×` and `→` (escaped: ASCII only)."""
    env = {k: v for k, v in _env({"PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C"}).items()
           if k not in ("PYTHONIOENCODING", "LANGUAGE", "PYTHONCOERCECLOCALE")}
    r = subprocess.run([PY, "-m", "pipeline.cli", *args], cwd=REPO, env=env, capture_output=True, timeout=120)
    r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode("ascii"), r.stderr.decode("ascii"))
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.strip(), r.stderr[-3000:]
