"""Which runtime may run an engine: the requirement a release states for each of its engines, against this host.

An engine was gated with one runtime build: validate@ and system@ measured what ONNX Runtime 1.32.0 (say) computes
with it. Another runtime version may run other kernels, or, for a graph ONNX Runtime optimized offline, refuse or
misread it (its docs tie such a graph to the version and hardware that optimized it); a TensorRT plan loads only on
the TensorRT version that built it. So `kiln release --system` writes, for each part, the runtime it requires
(`of_engine`: from the engine manifest's own toolchain fingerprint, which the release signs too):

    {"target": "ort-cpu", "package": "onnxruntime", "version": "1.32.0", "allowed": "==1.32.0",
     "host_class": "x86-64-avx512-vnni"}

`allowed` is the target's rule (RULES): `exact` (the same release), `minor` (the same major.minor: a patch release
of the line is accepted). `host_class` is set for host-bound targets, whose engines hold code or layouts chosen for
the build host's CPU (ONNX Runtime's offline-optimized graph, AOTInductor's and TVM's machine code, TensorRT's
GPU plans); null where the runtime compiles for the host at load (OpenVINO's IR).

`drifts(requirement)` says what differs on this host, one line each. kiln-run refuses such an engine (verify, serve,
identify, bench) unless `--allow-runtime-drift`, which first re-runs the release's golden check on this host
(kiln_runtime/golden.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from kiln_runtime.host import cpu, host_class


@dataclass(frozen=True)
class Rule:
    package: str               # the distribution that runs the engine (importlib.metadata name)
    key: str                   # its version's key in the target's fingerprint (`rebuild_on`)
    match: str                 # exact | minor
    host_bound: bool           # the engine holds code or layouts for the build host's CPU / GPU
    why: str


RULES: dict[str, Rule] = {
    "ort-cpu": Rule("onnxruntime", "onnxruntime", "exact", True,
                    "an offline-optimized ONNX Runtime graph: tied to the version and hardware that optimized it"),
    "openvino-cpu": Rule("openvino", "openvino", "minor", False,
                         "OpenVINO IR, compiled for this CPU at load: a patch release of the same line reads it"),
    "aoti-cpu": Rule("torch", "torch", "exact", True, "AOTInductor machine code built against one libtorch"),
    "executorch-xnnpack": Rule("executorch", "executorch", "exact", False, "a .pte program of one ExecuTorch schema"),
    "litert": Rule("ai-edge-litert", "ai-edge-litert", "minor", False, "a .tflite flatbuffer"),
    "xla": Rule("jaxlib", "jaxlib", "exact", False, "a StableHLO artifact serialized by one jaxlib"),
    "tvm": Rule("apache-tvm", "apache-tvm", "exact", True, "TVM machine code for the build host's CPU"),
    "tensorrt": Rule("tensorrt", "tensorrt", "exact", True,
                     "a TensorRT plan loads only on the TensorRT version and GPU that built it"),
    "tensorrt-rtx": Rule("tensorrt-rtx", "tensorrt_rtx", "exact", True,
                         "a TensorRT-RTX plan loads only on the TensorRT-RTX version that built it"),
}
_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def normalized(version: str) -> str:
    """A version as a distribution reports it: OpenVINO's build string `2026.4.1-22982-e213…` → `2026.4.1`."""
    return str(version).split("-")[0].strip()


def allowed(version: str, match: str) -> str:
    """The range a rule allows around `version`: `==1.32.0` (exact) or `==2026.4.*` (minor)."""
    m = _RELEASE.match(version)
    if match == "minor" and m:
        return f"=={m.group(1)}.{m.group(2)}.*"
    return f"=={version}"


def satisfies(version: str, spec: str) -> bool:
    want = spec.removeprefix("==")
    if want.endswith(".*"):
        return version == want[:-2] or version.startswith(want[:-1])
    return version == want


def of_engine(manifest: dict[str, Any]) -> dict[str, Any]:
    """The runtime requirement of an engine, from its manifest (target + its toolchain fingerprint)."""
    target = str(manifest.get("target"))
    rule = RULES.get(target)
    fingerprint = (manifest.get("toolchain") or {}).get(f"target.{target}") or {}
    if rule is None or not isinstance(fingerprint, dict) or not fingerprint.get(rule.key):
        return {"target": target, "package": rule.package if rule else None, "version": None, "allowed": None,
                "host_class": None}
    version = normalized(fingerprint[rule.key])
    cls = host_class({"machine": fingerprint.get("machine"), "isa": fingerprint.get("isa") or []}) \
        if rule.host_bound else None
    return {"target": target, "package": rule.package, "version": version, "allowed": allowed(version, rule.match),
            "host_class": cls}


def installed(package: str) -> str | None:
    try:
        return normalized(metadata.version(package))
    except metadata.PackageNotFoundError:
        return None


def drifts(req: dict[str, Any]) -> list[str]:
    """What on this host is outside an engine's requirement: one line each (empty: none)."""
    out = []
    package, spec = req.get("package"), req.get("allowed")
    if package and spec:
        have = installed(package)
        if have is None:
            out.append(f"{package} is not installed here (gated with {package} {req.get('version')})")
        elif not satisfies(have, spec):
            out.append(f"gated with {package} {req.get('version')} (the release allows {spec}), this host has "
                       f"{package} {have}")
    if req.get("host_class") and req["host_class"] != (here := host_class(cpu())):
        out.append(f"built for host class {req['host_class']}, this host is {here}")
    return out
