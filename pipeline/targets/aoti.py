"""`aoti-cpu`: torch AOTInductor on the CPU. The engine is a `.pt2` package (generated C++ + a compiled `.so` +
weights) built from the `torch.export` program (`artifacts/program/<model>`), not from ONNX.

Toolchain: Inductor compiles with the host C++ compiler (`torch._inductor.config.cpp.cxx`, g++ by default) and the
flags `torch._inductor.cpp_builder.CppTorchOptions` assembles — `-O3 … -march=native` plus a `CPU_CAPABILITY_*`
define from the vector ISA Inductor picks (`cpu_vec_isa.pick_vec_isa()`). `-march=native` ties the package to this
CPU's ISA, so the ISA flags are rebuild keys, with the torch and compiler versions and the flags themselves.

Reproducibility: Inductor writes the absolute build path into the package (a "Compile cmd" comment in the
generated C++, the path-derived kernel file name, and the `.so`'s debug info and build-id), and the archive's
top folder is the package file's stem; so the build runs in a fixed directory (`artifacts/.aoti-build`, removed
afterwards) rather than a random temp dir, and the package is always `model.pt2`. Measured (torch 2.13, gcc 12):
two compiles in fresh processes at the same path gave identical bytes; at different paths they differ (54 bytes of
C++ comments, kernel names, 5948 bytes of the .so). A compile takes 20–50 s, so the compile stage does not rebuild
to check: the target declares what was measured (`deterministic`, with its basis) in the engine manifest.
Precompiled headers are off (they are written to <tmp>/torchinductor_<user> whatever the cache dir, ~300 MB).

Audit: the package carries the generated C++ wrapper and kernel sources, so the audit reads them: calls to
Inductor-generated kernels (`cpp_fused_*`, whose names list the ATen ops they fuse) versus calls out to ATen through
the C shim (`aoti_torch_cpu_<op>`, here convolution and mm, which run ATen's oneDNN/MKL FP32 kernels) versus ops with
no C shim run through the proxy executor (the true fallback). It cannot see which library kernel ATen picks at run
time (oneDNN vs reference, which ISA), and the op lists come from kernel names, not a node-by-node provenance map.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Toolchain

PACKAGE_FILE = "model.pt2"
OPTIONS_FILE = "options.json"
BUILD_DIR = ".aoti-build"
PRECISIONS = ("fp32",)
# Precompiled headers (~300 MB of .gch) only pay across many builds sharing a cache; ours is private and deleted.
DEFAULT_INDUCTOR = {"aot_inductor.precompile_headers": False}

_KERNEL_CALL = re.compile(r"^\s*(cpp_fused_\w+)\(")
_SHIM_CALL = re.compile(r"\baoti_torch_cpu_(\w+?)\(")
_PROXY_CALL = re.compile(r"\baoti_torch_proxy_executor_call_function\b")
# C-shim calls that are allocation/bookkeeping, not compute
_SHIM_BOOKKEEPING = {"empty_strided"}


def _ops_in_kernel_name(kernel: str) -> list[str]:
    """`cpp_fused_add_avg_pool2d_constant_pad_nd_mul_3` → [add, avg_pool2d, constant_pad_nd, mul]: longest
    underscore-joined runs that name an ATen op (Inductor's descriptive kernel names, `original_aten` style)."""
    import torch

    toks = re.sub(r"_\d+$", "", kernel.removeprefix("cpp_fused_")).split("_")
    ops, i = [], 0
    while i < len(toks):
        for j in range(len(toks), i, -1):
            if hasattr(torch.ops.aten, "_".join(toks[i:j])):
                ops.append("_".join(toks[i:j]))
                i = j
                break
        else:
            ops.append(toks[i])
            i += 1
    return ops


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


class AotiCpu:
    name = "aoti-cpu"
    source_kind = "program"   # compiles artifacts/program/<model>, not an ONNX file
    cheap_rebuild = False     # 20–50 s per compile: the stage does not compile twice to check reproducibility
    deterministic = True      # measured: byte-identical across fresh processes at the same build path (see above)

    # ------------------------------------------------------------------------------------------ probe
    def probe(self) -> Toolchain:
        try:
            import torch
            from torch._inductor import config as ind_config
            from torch._inductor import cpp_builder, cpu_vec_isa
        except ImportError as e:
            return Toolchain(self.name, False, f"torch with Inductor not importable: {e}")
        cxx = cpp_builder.get_cpp_compiler()
        path = shutil.which(cxx)
        if path is None:
            return Toolchain(self.name, False, f"C++ compiler {cxx!r} not found (install g++ or set CXX)")
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        with tempfile.TemporaryDirectory(prefix="kiln-aoti-probe-") as tmp, temporary_cache_dir(tmp):
            isa = cpu_vec_isa.pick_vec_isa()  # compiles tiny ISA-check kernels into the cache dir: keep them private
        try:
            opts = cpp_builder.CppTorchOptions(vec_isa=isa, aot_mode=True, compiler=cxx)
            flags = {"cflags": opts.get_cflags(), "definitions": [d.strip() for d in opts.get_definitions()],
                     "ldflags": opts.get_ldflags(), "libraries": opts.get_libraries()}
        except Exception as e:  # private API: record what failed rather than break the probe
            flags = {"error": f"{type(e).__name__}: {e}"}
        host = toolchain.cpu()
        return Toolchain(
            self.name, True,
            rebuild_on={"torch": str(torch.__version__), "cxx_version": _first_line([path, "--version"]),
                        "vec_isa": str(isa) or "none", "cxx_flags": flags.get("cflags", []),
                        "isa": host["isa"], "machine": host["machine"]},
            info={"cpu": host["cpu"], "cxx": cxx, "cxx_path": os.path.realpath(path),
                  "cxx_config": list(ind_config.cpp.cxx), "march_config": ind_config.cpp.march,
                  "flags_source": "torch._inductor.cpp_builder.CppTorchOptions(vec_isa=pick_vec_isa(), "
                                  "aot_mode=True).get_cflags()/get_definitions()/get_ldflags()/get_libraries()",
                  "definitions": flags.get("definitions", []), "ldflags": flags.get("ldflags", []),
                  "libraries": flags.get("libraries", []), **({"flags_error": flags["error"]} if "error" in flags
                                                               else {}),
                  **toolchain.versions("numpy")})

    # ------------------------------------------------------------------------------------------ compile
    @staticmethod
    @contextmanager
    def _build_dir(artifacts_dir: Path) -> Iterator[Path]:
        """A fixed, locked, private build directory: Inductor's cache and every temp file go here, then it goes.

        Fixed (not random) because Inductor embeds the build path in the package bytes; under artifacts/ but not
        under artifacts/engines, which the bench stage hashes as a dependency.
        """
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        artifacts_dir.mkdir(parents=True, exist_ok=True)
        with open(artifacts_dir / f"{BUILD_DIR}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            build = artifacts_dir / BUILD_DIR
            shutil.rmtree(build, ignore_errors=True)  # a killed earlier build
            (build / "tmp").mkdir(parents=True)
            saved_tmp, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
            tempfile.tempdir, os.environ["TMPDIR"] = str(build / "tmp"), str(build / "tmp")
            from torch._inductor import codecache

            saved_headers = codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR
            # fixed at import to <tmp>/torchinductor_<user>/precompiled_headers, ignoring TORCHINDUCTOR_CACHE_DIR
            codecache._HEADER_DIR = str((build / "headers").resolve())
            codecache._HEADER_LOCK_DIR = str((build / "headers" / "locks").resolve())
            try:
                with temporary_cache_dir(str((build / "cache").resolve())):
                    yield build
            finally:
                codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = saved_headers
                tempfile.tempdir = saved_tmp
                if saved_env is None:
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = saved_env
                shutil.rmtree(build, ignore_errors=True)

    def compile(self, source: Path, options: CompileOptions, out: Path) -> list[Path]:
        import torch

        if options.precision not in PRECISIONS:
            raise KilnError(f"{self.name}: precision {options.precision!r} is not supported",
                            f"use {', '.join(PRECISIONS)} for {self.name} (INT8 needs a PT2E-quantized program)")
        threads = int(options.options.get("threads", 0))
        inductor = {**DEFAULT_INDUCTOR, **options.options.get("inductor", {})}
        ep = torch.export.load(str(source))
        package = out / PACKAGE_FILE
        saved_threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)  # Inductor sizes its parallel loops for the threads it sees
        try:
            with self._build_dir(out.resolve().parent.parent):
                torch._inductor.aoti_compile_and_package(ep, package_path=str(package),
                                                         inductor_configs=inductor)
        except KilnError:
            raise
        except Exception as e:
            raise KilnError(f"{self.name}: AOTInductor compile failed: {str(e).strip().splitlines()[0][:300]}",
                            "check the C++ compiler (kiln targets) and the program (kiln program MODEL)") from None
        finally:
            torch.set_num_threads(saved_threads)
        opts = {"precision": options.precision, "threads": threads, "inductor_configs": inductor,
                "package": PACKAGE_FILE}
        (out / OPTIONS_FILE).write_text(json.dumps(opts, sort_keys=True, indent=1) + "\n")
        return [package, out / OPTIONS_FILE]

    def manifest_extras(self, engine_dir: Path) -> dict:
        """What the compile stage records beside the files (hook in stages/compile.py)."""
        src = self.sources(engine_dir)
        meta = json.loads(src["metadata"]) if "metadata" in src else {}
        return {"build": {"deterministic": self.deterministic,
                          "deterministic_basis": "declared by the target: two compiles in fresh processes at the "
                                                 "same build path gave identical bytes; the absolute build path "
                                                 "is embedded, so another checkout path gives other bytes",
                          "build_dir": f"artifacts/{BUILD_DIR}"},
                "results": {"package": {"cpu_isa": meta.get("AOTI_CPU_ISA"), "device": meta.get("AOTI_DEVICE_KEY"),
                                        "generated_cpp_bytes": sum(len(src.get(k, "")) for k in ("wrapper", "kernel"))}}}

    # ------------------------------------------------------------------------------------------ audit
    @staticmethod
    def sources(engine_dir: Path) -> dict[str, str]:
        """The generated C++ inside the package: {'wrapper': …, 'kernel': …, 'metadata': …}."""
        found: dict[str, str] = {}
        with zipfile.ZipFile(engine_dir / PACKAGE_FILE) as z:
            for name in z.namelist():
                for suffix, key in ((".wrapper.cpp", "wrapper"), (".kernel.cpp", "kernel"),
                                    (".wrapper_metadata.json", "metadata")):
                    if name.endswith(suffix):
                        found[key] = z.read(name).decode("utf-8", "replace")
        return found

    def audit(self, engine_dir: Path, precision: str) -> OpSupport:
        """What the generated wrapper's run function calls: Inductor's own C++ kernels (`cpp_fused_*`), ATen through
        the C shim (`aoti_torch_cpu_<op>`), or the proxy executor (ops without a shim).

        native: `inductor.aten.<op>` — ops fused into generated kernels, one count per kernel call, read from the
        kernel names (Inductor names a kernel after the ATen ops it fuses; an op that also runs through the shim,
        like convolution, appears in a kernel name only for its layout copy and is not counted there);
        `aten.<op>` — shim calls running ATen's own FP32 kernels (oneDNN / MKL). For a precision other than fp32
        the shim calls are float fallbacks. fallback: proxy-executor calls, and (non-fp32) shim compute calls.
        other: allocations, kernel-call and kernel counts, and how many generated kernels use vector code.
        """
        src = self.sources(engine_dir)
        if "wrapper" not in src:
            return OpSupport(precision, {}, [{"node": PACKAGE_FILE, "op": "?", "runs_as": "unknown: the package "
                                              "holds no generated wrapper source"}], {})
        body = src["wrapper"].split("::run_impl(", 1)[-1]
        kernel_calls = [m.group(1) for line in body.splitlines() if (m := _KERNEL_CALL.match(line))]
        shim_calls = _SHIM_CALL.findall(body)
        shim_ops = {op for op in shim_calls if op not in _SHIM_BOOKKEEPING}
        native, fallback, other = Counter(), [], Counter()
        for kernel in kernel_calls:
            for op in _ops_in_kernel_name(kernel):
                if op not in shim_ops:
                    native[f"inductor.aten.{op}"] += 1
        for op in shim_calls:
            if op in _SHIM_BOOKKEEPING:
                other[f"shim.{op}"] += 1
            elif precision == "fp32":
                native[f"aten.{op}"] += 1
            else:
                fallback.append({"node": f"aoti_torch_cpu_{op}", "op": f"aten.{op}", "runs_as": "float32"})
        for _ in _PROXY_CALL.findall(body):
            fallback.append({"node": "proxy_executor", "op": "?", "runs_as": "ATen dispatcher via proxy executor"})
        kernels = re.split(r'extern "C"\s+void\s+cpp_fused_', src.get("kernel", ""))[1:]
        other.update({"generated_kernel_calls": len(kernel_calls), "generated_kernels": len(kernels),
                      "vectorized_kernels": sum("Vectorized<" in k for k in kernels)})
        return OpSupport(precision, dict(sorted(native.items())), fallback, dict(sorted(other.items())))

    # ------------------------------------------------------------------------------------------ load
    def load(self, engine_dir: Path) -> "AotiRunner":
        return AotiRunner(engine_dir)


class AotiRunner:
    """Runner over an AOTInductor package, with the thread count it was compiled for (process-wide in torch)."""

    def __init__(self, engine_dir: Path) -> None:
        import torch

        opts = json.loads((engine_dir / OPTIONS_FILE).read_text())
        if opts.get("threads"):
            torch.set_num_threads(int(opts["threads"]))
        self._torch = torch
        self.model = torch._inductor.aoti_load_package(str(engine_dir / opts.get("package", PACKAGE_FILE)))

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Inputs in the feed's order (the program's argument order) → every output."""
        torch = self._torch
        with torch.inference_mode():
            out = self.model(*(torch.from_numpy(np.ascontiguousarray(v, np.float32)) for v in feed.values()))
        return [t.numpy() for t in (out if isinstance(out, (list, tuple)) else (out,))]

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({"input": batch})[0]
