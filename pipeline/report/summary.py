"""The build's summary: what the default DAG made and whether each gate let it through, on one page.

One row per engine (its validation verdict, its target and precision, and the toolchain it was compiled with: the
target's fingerprint digest, so engines built by one toolchain share a value and a toolchain change shows as a new
one), per quantized model's precision report (the first layer below the SNR limit) and per face system (its
end-to-end gate). Read from cached outputs only — what `dvc repro --pull` can fetch on any host — by params: a
file that is not there is an error naming the stage that writes it. Registrations and load figures are this host's
(uncached: receipts, sysbench) and stay in their own reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from pipeline import paths, tables
from pipeline.dvcfiles import address
from pipeline.errors import KilnError
from pipeline.manifest import manifest_path
from pipeline.quant.qdq import pairs

if TYPE_CHECKING:
    from pipeline.config import Config

def precision_file(key: str, root: Path = Path(".")) -> Path:
    return manifest_path(paths.precision(key, root), key)


def inputs(cfg: Config) -> list[str]:
    """Every file or folder the summary reads (each a cached output, by its own path): the stage's deps."""
    return [*(paths.validation(e).as_posix() for e in cfg.engines),
            *(paths.engine(e).as_posix() for e in cfg.engines),
            *(precision_file(k).as_posix() for k in pairs(cfg)),
            *(paths.system(s).as_posix() for s in cfg.systems)]


def _read(path: Path, stage: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KilnError(f"{path}: missing (written by {stage})", f"run it first: dvc repro {address(stage)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not JSON ({e})", f"rebuild it: dvc repro -f {address(stage)}") from None


def fingerprint_digest(fingerprint: Any) -> str:
    """A short, stable name for a target's toolchain fingerprint (what `rebuild_on` tracks)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(fingerprint, sort_keys=True).encode())[:8]


def collect(cfg: Config, root: Path = Path(".")) -> dict[str, list[dict]]:
    """The summary's sections as rows (summary.json)."""
    engines = []
    for e, spec in cfg.engines.items():
        v = _read(manifest_path(paths.validation(e, root), e), f"validate@{e}")
        man = _read(manifest_path(paths.engine(e, root), e), f"compile@{e}")
        chain = man.get("toolchain", {}).get(f"target.{spec.target}")
        engines.append({"engine": e, "model": spec.model, "target": spec.target, "precision": spec.precision,
                        "verdict": (v.get("results") or {}).get("verdict"),
                        "toolchain": fingerprint_digest(chain) if chain else None})
    precision = []
    for key, (model, recipe) in pairs(cfg).items():
        res = _read(precision_file(key, root), f"debug-precision@{key}").get("results", {})
        worst = (res.get("worst") or [{}])[0]
        first = res.get("first_bad") or {}
        precision.append({"quantized": key, "model": model, "recipe": recipe,
                          "first_bad_layer": first.get("name") if isinstance(first, dict) else first,
                          "worst_layer": worst.get("name"), "worst_snr_db": worst.get("snr_db")})
    systems = []
    for name in cfg.systems:
        v = _read(paths.system(name, root) / paths.VERDICT_FILE, f"system@{name}")
        systems.append({"system": name, "verdict": v.get("verdict")})
    return {"engines": engines, "precision": precision, "systems": systems}


def problems(doc: dict[str, list[dict]]) -> list[str]:
    """What a release engineer must look at: any engine or system whose gate did not pass."""
    out = [f"engine {r['engine']}: {r['verdict']}" for r in doc["engines"] if r["verdict"] != "pass"]
    out += [f"system {r['system']}: {r['verdict']}" for r in doc["systems"] if r["verdict"] != "pass"]
    return out


def markdown(doc: dict[str, list[dict]]) -> str:
    e, p, s = doc["engines"], doc["precision"], doc["systems"]
    passed = sum(r["verdict"] == "pass" for r in e)
    bad = problems(doc)
    lines = ["# Build summary", "",
             f"{len(e)} engines ({passed} passed their gates), {len(s)} face systems. "
             + ("Every gate passed." if not bad else f"Not passed: {'; '.join(bad)}."),
             "", "## Engines", "",
             tables.markdown(["engine", "model", "target", "precision", "gate", "toolchain"],
                             [[r["engine"], r["model"], r["target"], r["precision"], r["verdict"], r["toolchain"]]
                              for r in e]),
             "", "`toolchain`: the digest of the target's fingerprint the engine was compiled with (`rebuild_on` in "
             "artifacts/toolchain/<target>.yaml): a toolchain change gives its engines a new one. Registrations: "
             "artifacts/registry/ and `kiln history`; load: artifacts/sysbench/ (this host's).", ""]
    if p:
        lines += ["## INT8 precision (layer-wise, on the golden feed)", "",
                  tables.markdown(["quantized", "first layer below the SNR limit", "worst layer", "its SNR dB"],
                                  [[r["quantized"], r["first_bad_layer"] or "none", r["worst_layer"],
                                    r["worst_snr_db"]] for r in p]), ""]
    if s:
        lines += ["## Face systems", "",
                  tables.markdown(["system", "end-to-end gate"], [[r["system"], r["verdict"]] for r in s]), ""]
    return "\n".join(lines)
