"""Float kernels that give the same bytes on every x86-64 CPU, for the stages whose outputs every host shares.

PyTorch, oneDNN and MKL pick their kernels by the CPU they run on (AVX2, AVX-512, AMX): the same model on the same
input gives other last bits on a Zen 2 than on a Zen 4, and a dataset, golden reference or calibration made on one
would not be the bytes another host makes. The portable stages (datasets, golden references, export, program,
calibration, quantization: `Stage.portable`) therefore compute on kernels every x86-64 CPU runs the same way:

* ATen without CPU-capability dispatch (`ATEN_CPU_CAPABILITY=default`: its baseline loops, no AVX2/AVX-512 paths);
* oneDNN capped at SSE4.1 (`ONEDNN_MAX_CPU_ISA`; PyTorch's convolutions and matmuls);
* MKL in conditional-numerical-reproducibility mode (`MKL_CBWR=COMPATIBLE`: the same code on Intel and AMD);
* NumPy's SIMD dispatch off above its x86-64-v2 baseline (`NPY_DISABLE_CPU_FEATURES`) and its OpenBLAS on one
  fixed kernel set (`OPENBLAS_CORETYPE=Nehalem`: SSE4.2, what every x86-64-v2 CPU runs).

ONNX Runtime has no such switch; the portable stages run it with graph optimizations at `basic` (no NCHWc layouts,
whose channel blocking follows the vector width) and judge quantized models as QDQ arithmetic in float, not on the
int8 kernels (which differ with VNNI). Checked with `kiln rebuild-check --cpu EPYC-Rome <stage>`, which rebuilds a
stage under qemu-user with a Zen 2's CPUID (AVX2, no AVX-512) — docs/reproducibility.md has what it found.

NumPy and OpenBLAS read their settings when they load, so a stage process that starts without them starts again
with them (`pin`: one exec, before any work). `python -m pipeline.stages.<portable stage>` (how dvc.yaml runs them)
execs from `pipeline/__init__.py` before the stage module's imports (`relaunch_early`): the first process would
otherwise load PyTorch only to throw it away, ≈ 1.5 s of each of these stages on a 2-core host. Used as a library in
a process that did not start that way (a test calling `run()`), a stage computes on the host's kernels, and its
manifest says so (`kernels()`). The cost is speed — these stages run on small sets (≈ 1–10 s each).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.errors import KilnError

ENV = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE",
       "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR", "OPENBLAS_CORETYPE": "Nehalem"}
PORTABLE = "portable: ATen default, oneDNN ≤ SSE4.1, MKL CBWR compatible, NumPy x86-64-v2, OpenBLAS Nehalem"
# The modules of the portable stages under pipeline/stages/ (`Stage.portable`; a test checks this against the
# declarations): known here, by name, so that `relaunch_early` can exec before a stage module is imported.
STAGE_PACKAGE = "pipeline.stages"
MODULES = frozenset({"dataset", "golden", "export", "program", "import_", "calibrate", "quantize"})


def _run_module() -> str | None:
    """The module this interpreter was started to run (`python [options] -m <module>`), else None."""
    argv = sys.orig_argv[1:]
    for i, a in enumerate(argv[:-1]):
        if a == "-m":
            return argv[i + 1]
        if a == "-c" or not a.startswith("-") and (i == 0 or argv[i - 1] not in ("-X", "-W")):
            return None                 # a command or a script comes first
    return None


def _launched_as(module: str) -> bool:
    """Whether this process is the stage's own program (`python -m <module>` or the `kiln` command), not a library
    user such as pytest."""
    argv = sys.orig_argv[1:]
    return _run_module() == module or (bool(argv) and Path(argv[0]).name == "kiln")


def _pinned_env() -> bool:
    return all(os.environ.get(k) == v for k, v in ENV.items())


def _relaunch() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **ENV})


def relaunch_early() -> None:
    """Called by `pipeline/__init__.py`: a process started as `python -m <a portable stage's module>` without `ENV`
    starts again with it at once, before the stage module (and PyTorch) load. Anything else: nothing happens."""
    package, _, name = (_run_module() or "").rpartition(".")
    if package == STAGE_PACKAGE and name in MODULES and not _pinned_env():
        _relaunch()


def pin(module: str) -> None:
    """Make this stage process compute on the portable kernels: start it again with `ENV` unless it has it (the
    exec happens before any work: nothing is written twice). A library user keeps the host's kernels."""
    if not _pinned_env() and _launched_as(module):
        _relaunch()


def kernels() -> str:
    """What the float kernels of this process are: the portable set, or the host's (named by its capability).
    PyTorch is asked only when this process loaded it (a stage that never ran a PyTorch kernel has none to name);
    with `ENV` set and PyTorch still dispatching on the CPU's ISA, the settings did not take: an error."""
    cap = "DEFAULT"
    if "torch" in sys.modules:
        cap = sys.modules["torch"].backends.cpu.get_cpu_capability()
    if not _pinned_env():
        return f"host: ATen {cap}" if "torch" in sys.modules else "host: float kernels of this CPU"
    if cap != "DEFAULT":
        raise KilnError("the portable kernel settings did not take (PyTorch still dispatches on this CPU's ISA "
                        f"{cap})", "unset ATEN_CPU_CAPABILITY overrides, then rerun the stage")
    return PORTABLE


def ort_session(model):
    """An ONNX Runtime CPU session as the portable stages run one: graph optimizations at `basic` (constant folding
    and the like; no NCHWc layout or QDQ fusion, whose kernels follow the CPU), so a QDQ model computes as its
    quantize/dequantize arithmetic in float. `model`: a path or the serialized bytes."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")   # idle threads sleep: no busy-wait
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so,
                                providers=["CPUExecutionProvider"])
