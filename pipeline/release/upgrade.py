"""`kiln upgrade-report`: each engine a toolchain change rebuilt, beside the version production runs, on this host.

After a host image or a lockfile brings another compiler or runtime, `dvc repro` rebuilds exactly the engines whose
target fingerprint changed (artifacts/toolchain/<target>.yaml) and gates each one against the golden reference. What
a release engineer asks next is how the rebuild compares with what production runs. For every engine:

1. **which**: an engine of params.yaml built in this checkout whose registered model has a `production` version
   whose toolchain (the manifest's, as registration logged it) differs from the local build's; `--all` also takes
   the engines whose build differs from production for another reason (code, params, inputs);
2. **production** is downloaded from the registry and proven (files, manifest and verdict against the digests
   logged at registration: pipeline/registry/aliases.py `download_verified`); the **candidate** is the local build.
   Both are verified again as they load (pipeline/engines.py) — loading an engine runs native code;
3. **outputs**: the model's golden feeds through both — the largest |Δ| of any output (also over the largest
   |production output|) and the lowest per-sample cosine between them (pipeline/gates/agreement.py) — and each
   one's face-task gate against the same golden reference, side by side (pipeline/gates/evaluate.py: an
   embedder's cosine, top-1 and verification decisions at its threshold; a detector's box IoU, landmarks and face
   agreement);
4. **latency**: both interleaved in rounds in this one process at each bench batch (pipeline/gates/timing.py
   `measure`, synthetic feeds as bench@ uses), the candidate / production p50 ratio of each round; the rounds'
   spread is the noise band;
5. **a verdict** (`verdict`): `differs` when the outputs are beyond params.yaml `upgrade:` (limits per precision:
   an INT8 rebuild moves by a quantization step) or the candidate fails its gate; else `worse` / `better` when
   every round's ratio is beyond 1 ± upgrade.latency_margin at some batch (a one-sided sign test over the rounds,
   as bench@'s INT8 gate); else `same`. Identical files are `same` whatever
   the clock said — that row is an A/A run, and its spread shows this host's noise band;
6. **the systems** whose production version pins the engine's production version: what the upgrade would touch.

An engine this host cannot run (a build-only target) is listed as not compared, with the reason. Each compared row
is logged by pipeline/registry/upgrades.py, where `kiln promote --system` finds it.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from pipeline import paths, samples, tables, targets
from pipeline.errors import KilnError
from pipeline.manifest import artifact_digest, identity_digest, manifest_path, read_manifest

if TYPE_CHECKING:
    from pipeline.config import Config, OutputLimits

DIFFERS, WORSE, BETTER, SAME = "differs", "worse", "better", "same"
UNCHANGED = ("the production version", "toolchain unchanged")     # skipped: nothing to compare, one summary line


# ---------------------------------------------------------------------------------------------- verdicts (pure)
def toolchain_changes(production: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """'key: old → new' for every toolchain entry (flattened: `target.openvino-cpu.openvino`) that differs."""
    def flat(d: dict[str, Any], head: str = "") -> dict[str, str]:
        out: dict[str, str] = {}
        for k, v in d.items():
            out.update(flat(v, f"{head}{k}.") if isinstance(v, dict) else {f"{head}{k}": str(v)})
        return out

    a, b = flat(production), flat(candidate)
    return [f"{k}: {a.get(k, '(none)')} → {b.get(k, '(none)')}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def latency_verdict(production_rounds: list[float], candidate_rounds: list[float], margin: float) -> dict[str, Any]:
    """One batch: each interleaved round's candidate / production p50 ratio (> 1: the candidate is slower); `worse`
    when every round is ≥ 1 + margin, `better` when every round is ≤ 1 / (1 + margin), else `same` — with ROUNDS = 5
    rounds, all on one side by chance has probability ≤ 1/32 (bench@'s INT8 gate argues the same way)."""
    if len(production_rounds) != len(candidate_rounds) or not candidate_rounds:
        raise ValueError("latency_verdict needs one p50 per round for both engines, the same rounds")
    ratios = [round(c / p, 4) for p, c in zip(production_rounds, candidate_rounds)]
    if min(ratios) >= 1 + margin:
        v = WORSE
    elif max(ratios) <= 1 / (1 + margin):
        v = BETTER
    else:
        v = SAME
    return {"verdict": v, "ratio": round(float(np.median(ratios)), 4), "band": [min(ratios), max(ratios)],
            "rounds": ratios}


def verdict(out: OutputLimits, margin: float, identical: bool, max_rel: float, cosine_min: float,
            gate_failures: list[str], latency: dict[int, dict[str, Any]]) -> tuple[str, list[str]]:
    """The row's verdict and why (module doc, step 5). `out`: the engine precision's output limits."""
    if identical:
        return SAME, ["identical files"]
    why = []
    if not max_rel <= out.max_rel_delta:          # NaN fails too
        why.append(f"max |Δ| {max_rel:.3g} of the output range > {out.max_rel_delta:g}")
    if not cosine_min >= out.cosine_min:
        why.append(f"cosine min {cosine_min:.6f} < {out.cosine_min:g}")
    why += [f"gate: {f}" for f in gate_failures]
    if why:
        return DIFFERS, why
    slower = [f"b{b} {v['ratio']:.3f}×" for b, v in latency.items() if v["verdict"] == WORSE]
    if slower:
        return WORSE, [f"slower in every round by more than {margin:.0%}: " + ", ".join(slower)]
    faster = [f"b{b} {v['ratio']:.3f}×" for b, v in latency.items() if v["verdict"] == BETTER]
    if faster:
        return BETTER, [f"faster in every round by more than {margin:.0%}: " + ", ".join(faster)]
    return SAME, ["outputs within the limits, latency within the noise band"]


# ---------------------------------------------------------------------------------------------- one engine
@dataclass
class Row:
    engine: str
    registered_model: str
    production: int                           # the production version compared against
    candidate: str                            # "v<N>" when this build is registered, else "local build"
    candidate_sha256: str                     # the local build's content digest (what registration keys on)
    candidate_xxh3_128: str                   # its manifest's identity digest
    production_sha256: str
    changed: list[str]                        # toolchain entries that differ
    systems: list[str]                        # production systems pinning the production version
    verdict: str = ""
    why: list[str] = field(default_factory=list)
    identical: bool = False
    max_abs: float = 0.0
    max_rel: float = 0.0                      # max |Δ| over the largest |production output|
    cosine_min: float = 1.0
    gate: dict[str, dict[str, Any]] = field(default_factory=dict)      # production | candidate → verdict, metrics
    latency: dict[int, dict[str, Any]] = field(default_factory=dict)   # batch → both p50s, ratio, band, verdict
    key_metric: str = ""                      # the role's gate key metric (decision_agreement, box_iou_min …)
    not_run: str = ""                         # why this host could not compare it

    def line(self) -> str:
        return (f"{self.engine}: {self.verdict} against production v{self.production} ({'; '.join(self.why)})"
                if not self.not_run else f"{self.engine}: not compared on this host — {self.not_run}")


def compare_engine(cfg: Config, row: Row, production_dir: Path, root: Path, progress: Callable[[str], None]) -> Row:
    """Fill `row` by running production (downloaded, in `production_dir`) and the local build side by side."""
    from pipeline import engines
    from pipeline.gates import agreement, evaluate, timing
    from pipeline.roles.registry import synthetic_feed

    spec = cfg.engine(row.engine)
    mcfg = cfg.model(spec.model)
    candidate_dir = paths.engine(row.engine, root)
    t = targets.get(spec.target)
    for where, d in (("production", production_dir), ("candidate", candidate_dir)):
        ok, why = t.runnable(d)
        if not ok:
            row.not_run, row.verdict = f"{where}: {why}", "not-run"
            return row
    prod = engines.load(spec.target, production_dir, row.engine)
    cand = engines.load(spec.target, candidate_dir, row.engine)
    feeds = samples.feeds(cfg, spec.model, "golden", root)
    reference = [prod.run_all(f) for f in feeds]
    a = agreement.compare(cand.run_all, feeds, reference)
    scale = max((float(np.abs(o).max()) for outs in reference for o in outs if o.size), default=0.0)
    row.max_abs, row.cosine_min = float(a["max_abs"]), float(a["cosine_min"])
    row.max_rel = row.max_abs / scale if scale > 0 else (0.0 if row.max_abs == 0 else float("inf"))
    row.key_metric = samples.role(cfg, spec.model).key_metric
    failures: dict[str, list[str]] = {}
    for side, runner in (("production", prod), ("candidate", cand)):
        metrics, failures[side], _, _ = evaluate.evaluate(cfg, row.engine, runner, root)
        row.gate[side] = {"verdict": "fail" if failures[side] else "pass",
                          "metrics": {k: round(v, 7) if isinstance(v, float) else v for k, v in metrics.items()}}
    bcfg = cfg.bench
    inputs = {b: synthetic_feed(mcfg.samples, mcfg.input_shape, b) for b in bcfg.batches}
    lat = timing.measure({"production": prod.run_all, "candidate": cand.run_all}, inputs, bcfg.warmup, bcfg.min_runs,
                         bcfg.min_seconds, progress=lambda s: progress(f"{row.engine}: {s}"))
    for b in bcfg.batches:
        p, c = timing.summarize({b: lat["production"][b]}), timing.summarize({b: lat["candidate"][b]})
        row.latency[b] = {"production_p50_ms": p[f"b{b}_p50_ms"], "candidate_p50_ms": c[f"b{b}_p50_ms"],
                          **latency_verdict(p[f"b{b}_round_p50_ms"], c[f"b{b}_round_p50_ms"],
                                            cfg.upgrade.latency_margin)}
    row.verdict, row.why = verdict(cfg.upgrade.limits(spec.precision), cfg.upgrade.latency_margin, row.identical,
                                   row.max_rel, row.cosine_min, failures["candidate"], row.latency)
    return row


# ---------------------------------------------------------------------------------------------- the report
@dataclass
class Report:
    rows: list[Row]
    skipped: dict[str, str]                   # engine → why it is not in the table
    host_class: str
    runs: dict[str, str] = field(default_factory=dict)     # engine → the registry run its row was logged as

    def doc(self) -> dict[str, Any]:
        return {"host_class": self.host_class, "rows": [asdict(r) for r in self.rows], "skipped": self.skipped,
                "runs": self.runs}


def _toolchain_params(params: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in params.items() if k.startswith("toolchain.")}


def run(cfg: Config, root: Path = Path("."), only: list[str] | None = None, every: bool = False,
        record: bool = True, progress: Callable[[str], None] = print) -> Report:
    """The report over `only` (engine names; default every engine of params.yaml), logged to the registry."""
    from pipeline import toolchain
    from pipeline.registry import upgrades
    from pipeline.registry.aliases import PARAM, PRODUCTION, download_verified, production_pins
    from pipeline.registry.client import Registry, errors, registered_name
    from pipeline.registry.registration import flat_params

    root = Path(root)
    names = list(only) if only else sorted(cfg.engines)
    for n in names:
        cfg.engine(n)                               # an unknown name: one line naming params.yaml's engines
    reg = Registry(cfg, root)
    rows, skipped = [], {}
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-upgrade-") as tmp:
        pins = production_pins(reg)
        for engine in names:
            mpath = manifest_path(paths.engine(engine, root), engine)
            if not mpath.is_file():
                skipped[engine] = "not built in this checkout"
                continue
            local = read_manifest(mpath)
            sha, ident = artifact_digest(local), identity_digest(local)
            name = registered_name(cfg, engine)
            found = reg.client.search_registered_models(filter_string=f"name = '{name}'")
            current = reg.aliases(name).get(PRODUCTION) if found else None
            if current is None:
                skipped[engine] = "no production version"
                continue
            mv = reg.version(name, current)
            params = dict(reg.client.get_run(mv.run_id).data.params) if mv.run_id else {}
            prod_sha = params.get(PARAM + "sha256", "")
            mine = flat_params("toolchain", local.get("toolchain") or {})
            same_toolchain = _toolchain_params(params) == mine
            if prod_sha == sha and ident == params.get(PARAM + "manifest_xxh3_128"):
                skipped[engine] = f"the production version v{current} is this build"
                continue
            if same_toolchain and not every:
                skipped[engine] = f"toolchain unchanged since production v{current} (--all compares it)"
                continue
            v = download_verified(reg, name, current, Path(tmp) / engine)
            registered = reg.client.search_model_versions(f"name = '{name}' and tags.sha256 = "
                                                          f"'{sha}'")
            row = Row(engine, name, current, f"v{registered[0].version}" if registered else "local build",
                      sha, ident, prod_sha,
                      toolchain_changes(v.manifest.get("toolchain") or {}, local.get("toolchain") or {}),
                      sorted(f"{p.system} v{p.system_version}" for p in pins
                             if p.registered_model == name and p.version == current),
                      identical=prod_sha == sha)
            progress(f"upgrade-report: {engine}: production v{current} against {row.candidate}")
            rows.append(compare_engine(cfg, row, v.directory, root, progress))
        report = Report(rows, skipped, toolchain.host_class())
        if record:
            report.runs = {r.engine: upgrades.log(reg, r, report.host_class) for r in rows if not r.not_run}
    return report


def table(report: Report) -> str:
    """One row per compared engine, both sides of each number; then the verdicts with their reasons."""
    head = ["engine", "prod", "cand", "toolchain change", "max |Δ| (rel)", "cos min", "gate p/c",
            "face task vs golden p/c"]
    batches = sorted({b for r in report.rows for b in r.latency})
    head += [f"b{b} p50 ms p/c (ratio, band)" for b in batches] + ["verdict", "systems"]
    body = []
    for r in report.rows:
        if r.not_run:
            body.append([r.engine, f"v{r.production}", r.candidate, "; ".join(r.changed)[:40], "—", "—", "—", "—",
                         *["—"] * len(batches), "not-run", ", ".join(r.systems) or "—"])
            continue
        key = _key_metric(r)
        lat = [(f"{x['production_p50_ms']:.3f}/{x['candidate_p50_ms']:.3f} ({x['ratio']:.2f}×, "
                f"{x['band'][0]:.2f}–{x['band'][1]:.2f})") if (x := r.latency.get(b)) else "—" for b in batches]
        body.append([r.engine, f"v{r.production}", r.candidate, _short(r.changed), f"{r.max_abs:.3g} ({r.max_rel:.2g})",
                     f"{r.cosine_min:.6f}", f"{r.gate['production']['verdict']}/{r.gate['candidate']['verdict']}",
                     key, *lat, r.verdict, ", ".join(r.systems) or "—"])
    lines = [f"upgrade report on host class {report.host_class}: each rebuilt engine against its production "
             "version, side by side in one run"]
    lines += tables.markdown(head, body).splitlines() if body else ["(no engine to compare)"]
    lines += [f"  {r.line()}" for r in report.rows]
    quiet = [e for e, why in report.skipped.items() if why.startswith(UNCHANGED)]
    lines += [f"  {e}: not in the table — {why}" for e, why in sorted(report.skipped.items()) if e not in quiet]
    if quiet:
        lines.append(f"  {len(quiet)} other engine(s): production runs this build, or its toolchain is unchanged")
    return "\n".join(lines)


def _short(changed: list[str]) -> str:
    """The first toolchain change as `leaf: old → new`, each side cut to 16 characters (--json has them whole)."""
    if not changed:
        return "(none)"
    key, _, values = changed[0].partition(": ")
    old, _, new = values.partition(" → ")
    cut = [v if len(v) <= 16 else v[:15] + "…" for v in (old, new)]
    return f"{key.rsplit('.', 1)[-1]}: {cut[0]} → {cut[1]}" + (f" (+{len(changed) - 1})" if len(changed) > 1 else "")


def _key_metric(r: Row) -> str:
    """The role's key gate metric, and the decisions (an embedder's at its threshold, a detector's faces found),
    production/candidate, each against the golden reference."""
    shown = []
    for k in dict.fromkeys([r.key_metric, "decision_agreement", "face_agreement"]):
        p, c = (r.gate[side]["metrics"].get(k) for side in ("production", "candidate"))
        if isinstance(p, (int, float)) and isinstance(c, (int, float)):
            shown.append(f"{k} {p:.4g}/{c:.4g}")
    return "; ".join(shown) or "—"


def exit_code(report: Report) -> int:
    """1 when an engine differs or is worse: the upgrade needs a look before any promotion."""
    return 1 if any(r.verdict in (DIFFERS, WORSE) for r in report.rows) else 0


__all__ = ["BETTER", "DIFFERS", "Report", "Row", "SAME", "WORSE", "compare_engine", "exit_code", "latency_verdict",
           "run", "table", "toolchain_changes", "verdict"]
