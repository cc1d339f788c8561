"""register@<engine> and register-index@<size>: log an artifact and its verdict to MLflow, once per content digest.

An engine (or a gallery's chosen FAISS index, registered as what it is: kind "index") is logged as an MLflow
LoggedModel holding its files, its manifest, its verdict (validation.json + manifest) and, when present, its bench
metrics and the record of its build (git commit, host), and registered as a version of `kiln-<name>`.

* Idempotent by content: a version whose `sha256` equals the artifact's content digest is reused; nothing new is
  logged. The check and the write run under the model's registry lock (pipeline/registry/client.py), so eight
  concurrent registrations of one engine make one version, on SQLite and on a tracking server alike.
* The digests a version will be checked against (content, manifest, verdict manifest) are logged as run
  parameters, which MLflow never lets anyone change; tags are conveniences for search and display (the digest
  tags must agree with those parameters: pipeline/registry/aliases.py).
* Bench results are per host class (pipeline/toolchain.py `host_class`): a version carries the tag `kiln.host_class`
  (the class of the host that benched it first), `kiln.host_classes` (every class with rows), and per class its rows:
  version tags and run metrics `bench.<host class>.<metric>` (b1_p50_ms, b8_speedup_vs_fp32, …) plus the tag
  `bench.<host class>.verdict`, whose immutable copy is the run parameter `kiln.bench.<host class>.verdict` (promote
  reads that one). Registering the same content again from another host class ADDS that class's rows to the existing
  version (still idempotent by content: no new version); a class that has rows keeps them — a rerun from the same
  class changes nothing, and no class's rows ever replace another's.
* A registration killed half-way converges on the next `register` / `kiln registry sync`: its RUNNING runs are
  marked KILLED, and a version created without its alias gets it, recorded (`complete_registration`).
* Only a passing verdict makes a `candidate`. A `not-run` verdict (a build-only engine: no runtime on the build
  host) registers with alias `built`. A failed artifact is refused unless `allow_failed`, and is then registered
  without an alias, its verdict tag `fail`, with a warning.
* The receipt (pipeline/registry/receipts.py) names what was registered by content only; the version number and
  tracking URI belong to one registry and go to the stage's record.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline import paths
from pipeline.dvcfiles import address
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import (artifact_digest, canonical_json, identity_digest, manifest_path, read_manifest,
                               verify_manifest, write_json_atomic)
from pipeline.registry.client import Registry, errors, redact, registered_name
from pipeline.registry.aliases import (BUILT, CANDIDATE, KILN_DIR, PARAM, AliasMove, actor_name, move_alias, moves,
                                       now, settle)

if TYPE_CHECKING:
    from pipeline.config import Config

BENCH_FILE = "bench.json"
RECORD_FILE = "build-record.json"


@dataclass(frozen=True)
class Receipt:
    name: str                 # registered model
    version: int
    sha256: str
    tracking_uri: str         # redacted
    new: bool
    verdict: str
    manifest_xxh3_128: str
    validation_manifest_xxh3_128: str
    repaired: bool = False    # an interrupted registration of this version was completed (its alias, its record)
    host_class_added: str | None = None   # an existing version got this host class's bench rows

    def content(self) -> dict[str, str]:
        """What was registered, by content only: identical in every registry and every clone."""
        return {"registered_model": self.name, "sha256": self.sha256, "manifest_xxh3_128": self.manifest_xxh3_128,
                "validation_manifest_xxh3_128": self.validation_manifest_xxh3_128, "verdict": self.verdict}


@dataclass(frozen=True)
class Registrable:
    """What gets registered: an artifact directory (files + manifest) and its verdict directory."""

    kind: str                 # engine | index
    name: str                 # engine name, or gallery-<size>
    directory: Path
    verdict_dir: Path
    tags: dict[str, str]      # descriptive: model/target/precision/recipe, or spec/size
    metrics: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] | None = None     # the build's record (commit, host), when this host built it
    host_class: str | None = None            # the host class `metrics` were benched on (None: not benched)

    @property
    def manifest_file(self) -> Path:
        return manifest_path(self.directory, self.name)

    @property
    def verdict_manifest(self) -> Path:
        return manifest_path(self.verdict_dir, self.name)


def _metric_key(name: str) -> str:
    """MLflow accepts only alphanumerics, _ - . / space (and : off Windows) in metric names."""
    return re.sub(r"[^/\w.\- ]", "_", name)


def numeric_metrics(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    return {_metric_key(f"{prefix}.{k}"): float(v) for k, v in values.items()
            if not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)}


def flat_params(prefix: str, value: Any) -> dict[str, str]:
    """Nested dict → {"a.b.c": str}; lists and other non-strings as canonical JSON (truncated to MLflow's limits)."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in sorted(value.items()):
            out.update(flat_params(f"{prefix}.{k}" if prefix else str(k), v))
        return out
    return {prefix: (value if isinstance(value, str) else canonical_json(value).decode())[:5000]}


# ---------------------------------------------------------------------------------------------- what to register
def engine_registrable(cfg: Config, engine_name: str, root: Path = Path("."),
                       host_class: str | None = None) -> Registrable:
    """An engine as registration sees it, with its bench row when its model was benched. `host_class`: the class the
    bench belongs to; default the one the bench report names (the host that benched it), else the class of the ISA
    list it recorded (a report from before host classes)."""
    from pipeline import toolchain
    from pipeline.records import read_record

    spec = cfg.engine(engine_name)
    bench, doc = {}, {}
    bench_file = paths.bench(spec.model, root) / paths.BENCH_FILE
    if bench_file.is_file():
        try:
            doc = json.loads(bench_file.read_text(encoding="utf-8"))
            bench = (doc.get("engines") or {}).get(engine_name) or {}
        except (ValueError, AttributeError):
            raise KilnError(f"{bench_file}: not valid bench results",
                            f"rerun dvc repro -f {address(f'bench@{spec.model}')}") from None
    if bench and host_class is None:
        host_class = doc.get("host_class") or (toolchain.host_class(
            {"machine": toolchain.cpu()["machine"], "isa": doc["isa"]}) if doc.get("isa") else toolchain.host_class())
    tags = {"engine": engine_name, "model": spec.model, "target": spec.target, "precision": spec.precision}
    if spec.recipe:
        tags["recipe"] = spec.recipe
    return Registrable("engine", engine_name, paths.engine(engine_name, root), paths.validation(engine_name, root),
                       tags, bench, read_record(f"compile@{engine_name}", root),
                       host_class if bench else None)


def index_registrable(cfg: Config, size: int, root: Path = Path(".")) -> Registrable:
    from pipeline.records import read_record

    cfg.matching.check_size(size)
    name = paths.gallery_name(size)
    gate = paths.matching(size, root) / paths.VALIDATION_FILE
    metrics = {}
    if gate.is_file():
        metrics = {k: v for k, v in (json.loads(gate.read_text(encoding="utf-8")).get("metrics") or {}).items()
                   if k.startswith(("p50", "p99", "build", "bytes", "recall"))}
    return Registrable("index", name, paths.index(size, root), paths.matching(size, root),
                       {"gallery": name, "size": str(size), "model": "embedder", "target": "faiss-cpu"}, metrics,
                       read_record(f"match@{size}", root))


def _check(art: Registrable, root: Path) -> tuple[dict, dict, dict]:
    """(manifest, verdict manifest, validation.json) of a local artifact, everything verified and consistent."""
    stage = "compile@" + art.name if art.kind == "engine" else "match@" + art.name.removeprefix("gallery-")
    manifest = read_manifest(art.manifest_file)
    if manifest.get("kind") != art.kind or manifest.get("name") != art.name:
        raise KilnError(f"{art.manifest_file}: describes {manifest.get('kind')} {manifest.get('name')!r}, not "
                        f"{art.kind} {art.name!r}", f"rebuild it (dvc repro -f {address(stage)})")
    for key in ("model", "target", "precision"):
        if key in art.tags and manifest.get(key) != art.tags[key]:
            raise KilnError(f"{art.manifest_file}: {key} is {manifest.get(key)!r}, params.yaml says {art.tags[key]!r}",
                            f"the artifact is stale; rebuild it (dvc repro {address(stage)})")
    # Only the artifact's own files: its inputs may legitimately be absent on a runner that pulled just the engine.
    if problems := verify_manifest(art.manifest_file):
        raise GateFailed(f"{art.name}: files do not match their manifest: " + "; ".join(problems),
                         f"rebuild it (dvc repro -f {address(stage)}) or restore it (dvc checkout)")
    vfile = art.verdict_dir / paths.VALIDATION_FILE
    if not art.verdict_manifest.is_file():
        raise KilnError(f"{art.verdict_manifest}: missing; {art.name} has no verdict to register",
                        "validate it first (dvc repro "
                        f"{address('validate@' + art.name if art.kind == 'engine' else stage)})")
    vmanifest = read_manifest(art.verdict_manifest)
    if problems := verify_manifest(art.verdict_manifest):
        raise GateFailed(f"{art.name}: its verdict does not match its manifest (edited?): " + "; ".join(problems),
                         "validate it again (kiln validate <engine>)")
    verdict = json.loads(vfile.read_text(encoding="utf-8"))
    ident = identity_digest(manifest)
    refs = [r.get("xxh3_128") for r in vmanifest.get("inputs", []) if r.get("role") in ("engine", "index")]
    if verdict.get("engine_manifest_xxh3_128") != ident or ident not in refs:
        raise KilnError(f"{vfile}: validated a different build of {art.name}",
                        f"the artifact changed since its validation; rerun it (dvc repro {address(stage)})")
    if verdict.get("verdict") not in ("pass", "fail", "not-run"):
        raise KilnError(f"{vfile}: no pass / fail / not-run verdict", "validate it again")
    return manifest, vmanifest, verdict


# ---------------------------------------------------------------------------------------------- register
def register(cfg: Config, art: Registrable, root: Path = Path("."), allow_failed: bool = False) -> Receipt:
    """Register `art` once per content digest. A failed verdict is refused unless allowed."""
    root = Path(root)
    manifest, vmanifest, verdict = _check(art, root)
    if verdict["verdict"] == "fail" and not allow_failed:
        raise GateFailed(f"{art.name}: its validation failed ({'; '.join(verdict.get('failures') or [])[:300]}); "
                         "not registered", "fix it, or register it deliberately with --allow-failed (no alias)")
    name, digest = registered_name(cfg, art.name), artifact_digest(manifest)
    reg = Registry(cfg, root)
    with errors(reg.uri):
        with reg.lock(name):
            settle(reg, name)
            end_killed_runs(reg, cfg, art)
            existing = reg.client.search_model_versions(f"name = '{name}' and tags.sha256 = '{digest}'")
            repaired, added = False, None
            if existing:
                version, new = min(int(v.version) for v in existing), False
                repaired = complete_registration(reg, name, art, version)
                added = art.host_class if _add_host_rows(reg, name, version, art) else None
            else:
                version, new = _log_and_register(reg, cfg, art, name, manifest, vmanifest, verdict, digest), True
    if new and verdict["verdict"] == "fail":
        print(f"kiln: WARNING: {name} v{version} registered with a FAILED validation (--allow-failed); it has no "
              "alias and `kiln promote` will refuse it", file=sys.stderr)
    elif new and art.tags.get("bench_gate") == "fail":
        print(f"kiln: WARNING: {name} v{version} registered with a FAILED bench gate (--allow-failed); it has no "
              "alias", file=sys.stderr)
    return Receipt(name, version, digest, redact(reg.uri), new, verdict["verdict"], identity_digest(manifest),
                   identity_digest(vmanifest), repaired, added)


# ---------------------------------------------------------------------------------------------- host classes
def bench_verdict_param(host_class: str) -> str:
    """The run parameter holding a host class's bench verdict on a version (immutable, unlike the tags)."""
    return f"{PARAM}bench.{host_class}.verdict"


def _host_rows(art: Registrable) -> tuple[dict[str, str], dict[str, float], dict[str, str]]:
    """(version tags, run metrics, run parameters) of `art`'s bench on its host class: `bench.<class>.<metric>` and
    its verdict. The parameters (`kiln.bench.<class>.*`, immutable) are the record; tags and metrics display it."""
    hc = art.host_class
    values = numeric_metrics(f"bench.{hc}", art.metrics)
    tags = {k: format(v, "g") for k, v in values.items()}
    tags[f"bench.{hc}.verdict"] = art.tags.get("bench_gate") or "not benched here"
    return tags, values, {PARAM + k: v for k, v in tags.items()}


def host_classes(tags: dict[str, str]) -> list[str]:
    """The host classes a version's tags claim bench rows for (its `kiln.host_classes` tag): display only."""
    return sorted(c for c in (tags.get("kiln.host_classes") or "").split(",") if c)


def recorded_bench(params: dict[str, str]) -> dict[str, dict[str, Any]]:
    """host class → its bench row {"verdict", metric: value …} as the version's run recorded it (parameters
    `kiln.bench.<class>.*`, which no one can change afterwards). A class whose verdict parameter is missing has no
    row: the verdict is written last, so rows half-written by a killed registration do not count."""
    head = PARAM + "bench."
    rows: dict[str, dict[str, Any]] = {k[len(head):-len(".verdict")]: {"verdict": v} for k, v in params.items()
                                       if k.startswith(head) and k.endswith(".verdict")}
    for hc, row in rows.items():
        for k, v in params.items():
            if k.startswith(f"{head}{hc}.") and not k.endswith(".verdict"):
                try:
                    row[k[len(f"{head}{hc}."):]] = float(v)
                except ValueError:
                    continue
    return rows


def bench_disagreements(name: str, version: int, tags: dict[str, str], rows: dict[str, dict[str, Any]]
                        ) -> list[str]:
    """Where a version's bench tags say other than its recorded rows (a tag edited through the registry)."""
    out = []
    for hc in sorted(set(host_classes(tags)) - set(rows)):
        out.append(f"{name} v{version}: its tags claim a bench on host class {hc}, which its run never recorded")
    for hc, row in sorted(rows.items()):
        for k, v in sorted(row.items()):
            shown = v if k == "verdict" else format(v, "g")
            tag = tags.get(f"bench.{hc}.{k}")
            if tag is not None and tag != shown:
                out.append(f"{name} v{version}: tag bench.{hc}.{k} says {tag!r}, its run recorded {shown!r}")
    return out


def bench_rows(cfg: Config, name: str, root: Path = Path(".")) -> tuple[list[dict[str, Any]], list[str]]:
    """Every version's bench rows of registered model `name` (or engine name), one per (version, host class), as
    each version's run recorded them — what `kiln history` shows per host class — and every tag that says
    otherwise (shown as a warning, never as a row)."""
    name = registered_name(cfg, name)
    reg = Registry(cfg, root)
    out, forged = [], []
    with errors(reg.uri):
        for v in sorted(reg.client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
            params = reg.client.get_run(v.run_id).data.params if v.run_id else {}
            rows = recorded_bench(params)
            forged += bench_disagreements(name, int(v.version), v.tags or {}, rows)
            first = params.get(PARAM + "host_class")
            for hc, row in sorted(rows.items()):
                out.append({**row, "version": int(v.version), "host_class": hc,
                            "first": first == hc if first else (v.tags or {}).get("kiln.host_class") == hc})
    return out, forged


def _add_host_rows(reg: Registry, name: str, version: int, art: Registrable) -> bool:
    """Add `art`'s host-class bench rows to an existing version of the same content, unless that class has rows:
    tags and metrics first, the immutable verdict parameter last (the mark that the rows are complete), so a kill
    half-way is completed by the next registration. Another class's rows are never touched."""
    from mlflow.entities import Metric, Param

    hc = art.host_class
    if art.kind != "engine" or not hc:
        return False
    mv = reg.version(name, version)
    key = bench_verdict_param(hc)
    recorded = reg.client.get_run(mv.run_id).data.params if mv.run_id else {}
    if not mv.run_id or key in recorded:
        return False
    tags, values, immutable = _host_rows(art)
    old = mv.tags or {}
    tags["kiln.host_classes"] = ",".join(sorted({*host_classes(old), hc}))
    if "kiln.host_class" not in old:        # a version registered before host classes, or unbenched then
        tags["kiln.host_class"] = hc
    for k, v in sorted(tags.items()):
        reg.client.set_model_version_tag(name, str(version), k, v)
    ts, model_id = int(time.time() * 1000), (mv.source or "").removeprefix("models:/") or None
    reg.client.log_batch(mv.run_id, metrics=[Metric(k, v, ts, 0, model_id=model_id, run_id=mv.run_id)
                                             for k, v in sorted(values.items())],
                         params=[Param(k, v) for k, v in sorted(immutable.items()) if k != key and k not in recorded])
    reg.client.log_batch(mv.run_id, params=[Param(key, immutable[key])])      # last: the row is complete
    return True


def _alias_for(verdict: str, bench_gate: str | None) -> str | None:
    """The alias registration gives a new version: candidate if it passed, built if it could not run here."""
    return None if bench_gate == "fail" else {"pass": CANDIDATE, "not-run": BUILT}.get(verdict)


def end_killed_runs(reg: Registry, cfg: Config, art: Registrable) -> None:
    """Registration runs of `art` still RUNNING belong to a killed kiln (registrations of one model hold its lock):
    mark them KILLED, so the experiment shows no registration in progress."""
    eid = reg.experiment_id(cfg.register.experiment)
    quoted = art.name.replace("'", "\\'")
    for run in reg.client.search_runs([eid], filter_string=f"attributes.run_name = '{quoted}' and "
                                                           "attributes.status = 'RUNNING'", max_results=1000):
        reg.client.set_terminated(run.info.run_id, "KILLED")


def complete_registration(reg: Registry, name: str, art: Registrable, version: int) -> bool:
    """A version whose registration was killed after it was created has no alias and no record of getting it: give
    it the alias its registration would have (unless a newer version holds it already) and record it."""
    mv = reg.version(name, version)
    params = reg.client.get_run(mv.run_id).data.params if mv.run_id else {}
    alias = _alias_for(params.get(PARAM + "verdict", ""), (mv.tags or {}).get("bench_gate"))
    if alias is None:
        return False
    recorded = [m for m in moves(reg, name) if m.alias == alias]
    if any(m.action == "register" and m.to_version == version for m in recorded):
        return False
    current = reg.aliases(name).get(alias)
    if current is not None and current > version:
        return False
    previous = current if current != version else (recorded[-1].to_version if recorded else None)
    move_alias(reg, AliasMove(name, alias, previous, version, "register", actor_name(), now(),
                              f"registered {art.name} sha256 {str((mv.tags or {}).get('sha256'))[:12]}: completes an "
                              "interrupted registration"))
    return True


def _log_and_register(reg: Registry, cfg: Config, art: Registrable, name: str, manifest: dict, vmanifest: dict,
                      verdict: dict, digest: str) -> int:
    client = reg.client
    eid = reg.experiment_id(cfg.register.experiment)
    ident, vident = identity_digest(manifest), identity_digest(vmanifest)
    record = art.record or {}
    tags = {**art.tags, "kind": art.kind, "sha256": digest, "xxh3_128": ident, "validation": verdict["verdict"],
            "git_commit": str((record.get("git") or {}).get("commit", "unrecorded (restored from a cache)")),
            "dirty": str((record.get("git") or {}).get("dirty", "unknown")).lower(),
            **flat_params("toolchain", manifest.get("toolchain") or {})}
    immutable = {PARAM + "artifact": art.name, PARAM + "kind": art.kind, PARAM + "sha256": digest,
                 PARAM + "manifest_xxh3_128": ident, PARAM + "validation_manifest_xxh3_128": vident,
                 PARAM + "verdict": verdict["verdict"], PARAM + "params_sha256": (manifest.get("params") or {}).get(
                     "sha256", "")}
    benched = art.kind == "engine" and art.host_class
    row_tags, row_metrics, row_params = _host_rows(art) if benched else ({}, {}, {})
    if benched:
        tags |= {"kiln.host_class": art.host_class, "kiln.host_classes": art.host_class}
        immutable |= row_params | {PARAM + "host_class": art.host_class}
    params = {**immutable, **flat_params("build", manifest.get("build") or {})}
    for ref in manifest.get("inputs") or []:
        params[f"input.{ref.get('role', 'input')}"] = str(ref.get("xxh3_128", ""))
    run_tags = dict(tags)
    if dvc_stage := os.environ.get("DVC_STAGE"):
        run_tags["dvc_stage"] = dvc_stage

    def stage(staged: Path) -> None:
        for entry in manifest["files"]:
            _link_or_copy(art.directory / entry["path"], staged / entry["path"])
        _link_or_copy(art.manifest_file, staged / art.manifest_file.name)
        _link_or_copy(art.verdict_dir / paths.VALIDATION_FILE, staged / KILN_DIR / paths.VALIDATION_FILE)
        _link_or_copy(art.verdict_manifest, staged / KILN_DIR / art.verdict_manifest.name)
        if art.metrics:
            write_json_atomic(staged / KILN_DIR / BENCH_FILE, {"artifact": art.name, "metrics": art.metrics,
                                                               "host_class": art.host_class})
        if art.record:
            write_json_atomic(staged / KILN_DIR / RECORD_FILE, art.record)

    metrics = {**numeric_metrics("validation", verdict.get("metrics") or {}), **numeric_metrics("bench", art.metrics),
               **row_metrics}
    run_id, model_id = log_model(client, eid, art.name, run_tags, tags, params, f"kiln-{art.kind}", stage, metrics)
    ensure_registered_model(client, name, {k: art.tags[k] for k in art.tags if k in
                                            ("model", "target", "precision", "gallery")} | {"kind": art.kind},
                             f"Kiln {art.kind} {art.name}")
    # = mlflow.register_model(f"models:/{model_id}", name, tags=tags), minus its global client and its chatter
    mv = client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id, tags=tags | row_tags,
                                     model_id=model_id)
    version = int(mv.version)
    if alias := _alias_for(verdict["verdict"], art.tags.get("bench_gate")):  # a failed bench gate: no alias either
        move_alias(reg, AliasMove(name, alias, reg.aliases(name).get(alias), version, "register", actor_name(), now(),
                                  f"registered {art.name} sha256 {digest[:12]} (validation {verdict['verdict']})"))
    return version


def log_model(client, eid: str, name: str, run_tags: dict, tags: dict, params: dict, model_type: str,
               stage: Callable[[Path], None], metrics: dict[str, float]) -> tuple[str, str]:
    """One MLflow run that logs one model named `name`: its params, the files `stage(folder)` puts into a fresh
    staging folder, its metrics. The run ends FINISHED and the model READY — or, if anything raises, both FAILED
    and the error goes on. Returns (run_id, model_id)."""
    from mlflow.entities import LoggedModelOutput, Metric, Param
    from mlflow.exceptions import MlflowException

    run_id, model_id = client.create_run(eid, run_name=name, tags=run_tags).info.run_id, None
    try:
        client.log_batch(run_id, params=[Param(k, v) for k, v in sorted(params.items())])
        model_id = client.create_logged_model(eid, name=name, source_run_id=run_id, tags=tags, params=params,
                                              model_type=model_type).model_id
        with tempfile.TemporaryDirectory(prefix="kiln-register-") as tmp:
            stage(Path(tmp))
            client.log_model_artifacts(model_id, tmp)
        client.finalize_logged_model(model_id, "READY")
        if metrics:
            ts = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(k, v, ts, 0, model_id=model_id, run_id=run_id)
                                              for k, v in sorted(metrics.items())])
        client.log_outputs(run_id, [LoggedModelOutput(model_id, step=0)])
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        try:
            if model_id:
                client.finalize_logged_model(model_id, "FAILED")
            client.set_terminated(run_id, "FAILED")
        except MlflowException:
            pass
        raise
    return run_id, model_id


def ensure_registered_model(client, name: str, tags: dict, description: str) -> None:
    """Create the registered model `name` unless it exists (a second registration, or a concurrent one)."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, tags=tags, description=description)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
