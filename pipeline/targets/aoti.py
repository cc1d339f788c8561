"""`aoti-cpu`: torch AOTInductor on the CPU. The engine is a `.pt2` package (generated C++ + a compiled `.so` +
weights) built from the `torch.export` program (`artifacts/program/<model>`), not from ONNX.

Toolchain: Inductor compiles with the host C++ compiler (`torch._inductor.config.cpp.cxx`, g++ by default) and the
flags `torch._inductor.cpp_builder.CppTorchOptions` assembles — `-O3 … -march=native` plus a `CPU_CAPABILITY_*`
define from the vector ISA Inductor picks (`cpu_vec_isa.pick_vec_isa()`). `-march=native` ties the package to this
CPU's ISA, so the ISA flags are rebuild keys, with the torch and compiler versions and the flags themselves.

Reproducibility: Inductor writes the absolute build path into the package (a "Compile cmd" comment in the
generated C++, the path-derived kernel file name, and the `.so`'s debug info and build-id), and the archive's
top folder is the package file's stem. So every build runs in one fixed absolute directory outside any checkout
(`/tmp/kiln-aoti-build-<uid>`, private to the user, locked, removed afterwards) and the package is always
`model.pt2`: the bytes then depend neither on the checkout's path nor on the temp directory. A compile takes
tens of seconds, so the compile stage does not rebuild to check; the target claims bit-identical builds and
`kiln rebuild-check compile@<engine>` proves it in a fresh process (CI runs it for the embedder).
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
import stat
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator

import numpy as np

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pipeline import toolchain
from pipeline.errors import KilnError
from pipeline.targets.base import CompileOptions, OpSupport, Reproducibility, Toolchain, validate_options

PACKAGE_FILE = "model.pt2"
OPTIONS_FILE = "options.json"
BUILD_ROOT = Path("/tmp")           # fixed on purpose: the absolute build path ends up in the package's bytes
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
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, encoding="utf-8", errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.partition(":")[2].split()))
    except OSError:
        pass
    return ""


def _inductor_flags(cxx: str) -> dict:
    """The vector ISA Inductor picks on this CPU and the compile flags it would use (imports torch: seconds)."""
    try:
        from torch._inductor import cpp_builder, cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError as e:
        return {"error": str(e)}
    with tempfile.TemporaryDirectory(prefix="kiln-aoti-probe-") as tmp, temporary_cache_dir(tmp):
        isa = cpu_vec_isa.pick_vec_isa()  # compiles tiny ISA-check kernels into the cache dir: keep them private
    try:
        opts = cpp_builder.CppTorchOptions(vec_isa=isa, aot_mode=True, compiler=cxx)
        return {"vec_isa": str(isa) or "none", "cflags": opts.get_cflags(),
                "definitions": [d.strip() for d in opts.get_definitions()], "ldflags": opts.get_ldflags(),
                "libraries": opts.get_libraries()}
    except Exception as e:  # private API: say what failed rather than break the probe
        return {"error": f"{type(e).__name__}: {e}"}


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    threads: Annotated[StrictInt, Field(ge=0, le=256)] = 0     # torch.set_num_threads at compile and at load
    inductor: dict[str, object] = {}                          # extra torch._inductor configs for the compile


class AotiCpu:
    name = "aoti-cpu"
    runtime = ("torch",)                 # the package's .so links libtorch: a cold start imports torch
    reproducibility = Reproducibility(
        "bit-identical", checked_at_compile=False, bound=1e-5,
        basis="built in one fixed absolute directory (/tmp/kiln-aoti-build-<uid>); a compile takes tens of seconds, so "
              "`kiln rebuild-check compile@<engine>` proves it on demand rather than on every compile")

    def parse_options(self, raw: dict) -> Options:
        return validate_options(Options, raw, self.name)

    # ------------------------------------------------------------------------------------------ probe
    def probe(self) -> Toolchain:
        """Versions from package metadata and `<cxx> --version`; Inductor's ISA choice and compiler flags (which
        need torch imported and test kernels compiled, seconds) are cached per torch + compiler + CPU flags."""
        torch_version = toolchain.version("torch")
        if torch_version == "absent":
            return Toolchain(self.name, False, "torch is not installed")
        cxx = os.environ.get("CXX") or "g++"      # Inductor's default (torch._inductor.config.cpp.cxx)
        path = shutil.which(cxx)
        if path is None:
            return Toolchain(self.name, False, f"C++ compiler {cxx!r} not found (install g++ or set CXX)")
        cxx_version = _first_line([path, "--version"])
        host = toolchain.cpu()
        derived = toolchain.cached(["aoti-flags", torch_version, cxx, cxx_version, host["machine"], _cpu_flags()],
                          lambda: _inductor_flags(cxx))
        if "error" in derived:
            return Toolchain(self.name, False, f"torch with Inductor not usable: {derived['error']}")
        return Toolchain(
            self.name, True,
            rebuild_on={"torch": torch_version, "cxx_version": cxx_version, "vec_isa": derived["vec_isa"],
                        "cxx_flags": derived["cflags"], "isa": host["isa"], "machine": host["machine"]},
            info={"cpu": host["cpu"], "cxx": cxx, "cxx_path": os.path.realpath(path),
                  "flags_source": "torch._inductor.cpp_builder.CppTorchOptions(vec_isa=pick_vec_isa(), "
                                  "aot_mode=True); cached per torch, compiler and CPU flags",
                  **{k: derived[k] for k in ("definitions", "ldflags", "libraries")}})

    # ------------------------------------------------------------------------------------------ compile
    @staticmethod
    @contextmanager
    def _build_dir() -> Iterator[Path]:
        """The fixed, locked, private build directory: Inductor's cache and every temp file go here, then it goes.

        Fixed (not random, not under the checkout) because Inductor embeds the build path in the package bytes.
        Owned by this user with mode 0700, else refused (another user must not plant files in our build)."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        base = BUILD_ROOT / f"kiln-aoti-build-{os.getuid()}"
        try:
            base.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise KilnError(f"{base}: cannot create the AOTInductor build directory ({e})", "check /tmp") from None
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise KilnError(f"{base}: not a private directory of this user (a link, another owner, or group/other "
                            "access)", f"remove it (rm -rf {base}) and compile again")
        with open(base / "lock", "w", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            build = base / "build"
            shutil.rmtree(build, ignore_errors=True)  # a killed earlier build
            (build / "tmp").mkdir(parents=True)
            saved_tmp, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
            tempfile.tempdir, os.environ["TMPDIR"] = str(build / "tmp"), str(build / "tmp")
            from torch._inductor import codecache, cpp_builder
            from torch.utils import cpp_extension

            saved_headers = codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR
            # fixed at import to <tmp>/torchinductor_<user>/precompiled_headers, ignoring TORCHINDUCTOR_CACHE_DIR
            codecache._HEADER_DIR = str(build / "headers")
            codecache._HEADER_LOCK_DIR = str(build / "headers" / "locks")
            # torch's own directory is in every compile command (-I, -L), and Inductor hashes the commands into
            # the generated sources' names and the package: reach it through a link in the fixed build directory,
            # so the package does not depend on where the virtualenv (inside each checkout) lives
            saved_torch = (cpp_extension._TORCH_PATH, cpp_extension.TORCH_LIB_PATH, cpp_builder._TORCH_PATH,
                           cpp_builder._LINKER_SCRIPT)
            link = build / "torch"
            os.symlink(os.path.realpath(cpp_extension._TORCH_PATH), link)
            cpp_extension._TORCH_PATH = cpp_builder._TORCH_PATH = str(link)
            cpp_extension.TORCH_LIB_PATH = str(link / "lib")
            cpp_builder._LINKER_SCRIPT = str(link / "_inductor" / "script.ld")
            try:
                with temporary_cache_dir(str(build / "cache")):
                    yield build
            finally:
                (cpp_extension._TORCH_PATH, cpp_extension.TORCH_LIB_PATH, cpp_builder._TORCH_PATH,
                 cpp_builder._LINKER_SCRIPT) = saved_torch
                codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = saved_headers
                tempfile.tempdir = saved_tmp
                if saved_env is None:
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = saved_env
                shutil.rmtree(build, ignore_errors=True)

    def compile(self, source: Path, options: CompileOptions, out: Path, workdir: Path) -> list[Path]:
        import torch

        if options.precision not in PRECISIONS:
            raise KilnError(f"{self.name}: precision {options.precision!r} is not supported",
                            f"use {', '.join(PRECISIONS)} for {self.name} (INT8 needs a PT2E-quantized program)")
        threads = options.options.threads
        inductor = {**DEFAULT_INDUCTOR, **options.options.inductor}
        ep = torch.export.load(str(source))
        package = out / PACKAGE_FILE
        saved_threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)  # Inductor sizes its parallel loops for the threads it sees
        try:
            with self._build_dir():
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
        (out / OPTIONS_FILE).write_text(json.dumps(opts, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return [package, out / OPTIONS_FILE]

    def manifest_extras(self, engine_dir: Path) -> dict:
        """What the compile stage records beside the files."""
        src = self.sources(engine_dir)
        meta = json.loads(src["metadata"]) if "metadata" in src else {}
        generated = sum(len(src.get(k, "")) for k in ("wrapper", "kernel"))
        return {"build": {"build_dir": f"{BUILD_ROOT}/kiln-aoti-build-<uid>/build"},
                "results": {"package": {"cpu_isa": meta.get("AOTI_CPU_ISA"), "device": meta.get("AOTI_DEVICE_KEY"),
                                        "generated_cpp_bytes": generated}}}

    def accept_rebuild(self, mine: Path, other: Path, differing: list[str]) -> str | None:
        return None   # a package built in one fixed directory: any byte difference is a real one

    def runnable(self, engine_dir: Path | None) -> tuple[bool, str]:
        return True, ""

    def check_package(self, engine_dir: Path) -> None:
        """Refuse a package whose entries could escape the loader's extraction directory (absolute paths, `..`,
        backslashes, links) before torch's loader extracts it."""
        with zipfile.ZipFile(engine_dir / PACKAGE_FILE) as z:
            for info in z.infolist():
                name = info.filename
                parts = name.replace("\\", "/").split("/")
                is_link = stat.S_ISLNK(info.external_attr >> 16)
                if name.startswith("/") or "\\" in name or ".." in parts or ":" in parts[0] or is_link:
                    raise KilnError(f"{engine_dir / PACKAGE_FILE}: unsafe entry {name!r} in the package",
                                    "do not load it: rebuild the engine (kiln compile <engine>)")

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
    """Runner over an AOTInductor package, with the thread count it was compiled for (process-wide in torch).

    The package is opened with the C++ loader `torch._C._aoti.AOTIModelPackageLoader` — what
    `torch._inductor.aoti_load_package` wraps — because importing `torch._inductor` costs ≈ 1 s and that wrapper's
    pt2-archive path ≈ 1.1 s more, while the loader alone opens a package in ≈ 25 ms (cold start ≈ 3.2 s → ≈ 1.1 s,
    measured by bench@ with pipeline/coldstart.py). Every kiln program takes tensors and returns a tuple of tensors,
    so the flat lists the loader speaks are its whole call spec; outputs are bit-identical
    (tests/targets/test_aoti.py)."""

    def __init__(self, engine_dir: Path) -> None:
        import torch

        opts = json.loads((engine_dir / OPTIONS_FILE).read_text(encoding="utf-8"))
        if opts.get("threads"):
            torch.set_num_threads(int(opts["threads"]))
        self._torch = torch
        # (package, model name, run single-threaded, number of runners, device index -1 = CPU)
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(engine_dir / PACKAGE_FILE), "model", False, 1, -1)

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Inputs in the feed's order (the program's argument order) → every output."""
        torch = self._torch
        with torch.inference_mode():
            out = self._loader.run([torch.from_numpy(np.ascontiguousarray(v, np.float32)) for v in feed.values()])
        return [t.numpy() for t in out]

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.run_all({"input": batch})[0]
