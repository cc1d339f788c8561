"""`kiln report`: one self-contained HTML page — tables, plots (inline SVG) and the provenance graph; no scripts, no
fonts, no network.

Two scopes, one renderer:
* the workspace (`kiln report`): every engine's latency p50/p99 at batch 1 and 8, speed-up over PyTorch eager,
  accuracy and verdict, fallback count (the leaderboard's rows + the bench's tails), the matrix engine × host class
  (the registry's per-host-class bench rows of each engine's version, plus this workspace's bench: per host class
  the winner, by how much, and which INT8 engines are not faster there), an accuracy-vs-latency plot per model,
  each gallery's recall/latency curve, each face system under sustained load (pipeline/report/systems.py: the
  sweep, the stage split as a stacked bar, a roofline per system), the runtimes a user would run instead on the
  same frames (bench/peers.py's record, when it ran), and the provenance graph of every built engine (walked and
  verified: a broken node is drawn red);
* a release (`kiln release` puts `report.html` in the signed tree): the same page built from the release's own
  files only (its registered bench, verdict, manifest and chain), so it is as deterministic as the archive.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import paths
from pipeline.errors import KilnError
from pipeline.manifest import SUFFIX, atomic_path, read_manifest
from pipeline.report import systems as report_systems

if TYPE_CHECKING:
    from pipeline.config import Config

VERDICT_COLOR = {"pass": "#1a7f37", "fail": "#cf222e", "not-run": "#9a6700", "missing": "#6e7781"}
KIND_COLOR = {"assets": "#ddf4ff", "dataset": "#fff8c5", "golden": "#fbefff", "onnx": "#dafbe1",
              "calibration": "#ffebe9", "program": "#dafbe1", "engine": "#b6e3ff"}


@dataclass
class Report:
    title: str
    subtitle: str
    rows: list[dict[str, Any]]                       # one per engine (leaderboard row + p99s)
    curves: dict[str, list[dict[str, Any]]] = field(default_factory=dict)   # gallery → index points
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)      # provenance graph: path → manifest
    broken: set[str] = field(default_factory=set)    # manifest paths whose files or links did not verify
    notes: list[str] = field(default_factory=list)
    matrix: list[dict[str, Any]] = field(default_factory=list)   # one cell per (engine, host class): host_matrix
    systems: dict[str, dict[str, Any]] | None = None   # system → its sysbench@ + bottleneck (None: not in scope)
    production: list[dict[str, Any]] = field(default_factory=list)   # each face system's production version
    peers: dict[str, Any] | None = None              # bench/peers.py's record (artifacts/reports/peers.json)


# ---------------------------------------------------------------------------------------------- collecting
def for_workspace(cfg: Config, root: Path = Path(".")) -> Report:
    from pipeline.release import provenance
    from pipeline.report import leaderboard

    root = Path(root)
    rows, _ = leaderboard.rows(cfg, root)
    for r in rows:
        bench = _read(paths.bench(r["model"], root) / paths.BENCH_FILE) or {}
        t = (bench.get("engines") or {}).get(r["engine"], {})
        r["b1_p99_ms"], r["b8_p99_ms"] = t.get("b1_p99_ms"), t.get("b8_p99_ms")
    curves = {}
    for size in cfg.matching.gallery_sizes:
        if (c := _read(paths.curve(size, root))) is not None:
            curves[paths.gallery_name(size)] = c
    built = [m for e in cfg.engines if (m := paths.engine(e, root) / f"{e}{SUFFIX}").is_file()]
    chains = provenance.walk_many(built, root)
    manifests = {}
    for m in (m for c in chains for m in c.manifests):
        try:
            manifests[m] = read_manifest(root / m)
        except KilnError:
            continue
    broken = set().union(*(c.broken for c in chains)) if chains else set()
    for m in sorted(broken - manifests.keys()):     # a changed input is not walked past: still draw it, red
        try:
            manifests[m] = read_manifest(root / m)
        except KilnError:
            continue
    notes = [f"{len(built)} of {len(cfg.engines)} configured engines built; "
             + ("every provenance link verified" if not broken else f"{len(broken)} artifact(s) failed verification")]
    matrix, where = host_matrix(cfg, rows, root)
    notes.append(where)
    return Report("Kiln build report", f"workspace {root.resolve().name}: {len(rows)} engines, "
                  f"{len(curves)} galleries", rows, curves, manifests, broken, notes, matrix,
                  report_systems.collect(cfg, root), production_systems(cfg, root),
                  _read(paths.reports(root) / "peers.json"))


def _registry_here(cfg: Config, root: Path) -> bool:
    """Whether a registry is configured or exists here (the report never creates one)."""
    import os

    from pipeline.registry.client import sqlite_path, tracking_uri

    uri = tracking_uri(cfg, root)
    return "MLFLOW_TRACKING_URI" in os.environ or (sqlite_path(uri) or Path("/nonexistent")).is_file()


def production_systems(cfg: Config, root: Path = Path(".")) -> list[dict[str, Any]]:
    """Each registered face system's production version, its verdict and its parts, as the version's run recorded
    them (what `kiln identify --release` runs and `kiln release --system` ships); [] without a registry."""
    if not _registry_here(cfg, root):
        return []
    from pipeline.registry.client import Registry, errors
    from pipeline.registry.aliases import PARAM, pins, production_pins

    out = []
    try:
        reg = Registry(cfg, root)
        with errors(reg.uri):
            for name in sorted({p.system for p in production_pins(reg)}):
                version = reg.aliases(name)["production"]
                mv = reg.version(name, version)
                params = reg.client.get_run(mv.run_id).data.params if mv.run_id else {}
                out.append({"system": name, "version": version, "verdict": params.get(PARAM + "verdict", "-"),
                            "parts": [f"{p.model}={p.registered_model}:v{p.version}"
                                      for p in pins(reg, name, version)]})
    except KilnError:
        return []
    return out


NOT_FASTER = "not-faster-here"           # = gates/benchgate.NOT_FASTER


def _registry_cells(cfg: Config, rows: list[dict], root: Path) -> tuple[list[dict], str]:
    """The registry's per-host-class bench rows of each engine's version — the one with this workspace's content,
    else its newest — as cells; never creates a registry that does not exist."""
    import os

    from pipeline.manifest import artifact_digest
    from pipeline.registry.client import sqlite_path, tracking_uri

    uri = tracking_uri(cfg, root)
    if "MLFLOW_TRACKING_URI" not in os.environ and not (sqlite_path(uri) or Path("/nonexistent")).is_file():
        return [], "no registry here: the host-class matrix holds this workspace's bench only"
    from pipeline.registry import registration as reg_mod
    from pipeline.registry.client import Registry, errors, registered_name
    from pipeline.registry.aliases import PARAM

    cells = []
    try:
        registry = Registry(cfg, root)
        with errors(registry.uri):
            for r in rows:
                name = registered_name(cfg, r["engine"])
                versions = registry.client.search_model_versions(f"name = '{name}'")
                if not versions:
                    continue
                digest = None
                mfile = paths.engine(r["engine"], root) / f"{r['engine']}{SUFFIX}"
                if mfile.is_file():
                    try:
                        digest = artifact_digest(read_manifest(mfile))
                    except KilnError:
                        digest = None
                runs = {v.version: registry.client.get_run(v.run_id).data.params if v.run_id else {}
                        for v in versions}          # each version's record: immutable, unlike its tags
                mine = [v for v in versions if runs[v.version].get(PARAM + "sha256") == digest]
                v = (mine or sorted(versions, key=lambda v: int(v.version)))[-1]
                params, at = runs[v.version], r.get("ranked_at", 1)
                for hc, row in sorted(reg_mod.recorded_bench(params).items()):
                    p50, fp32 = row.get(f"b{at}_p50_ms"), row.get(f"b{at}_speedup_vs_fp32")
                    cells.append({"model": r["model"], "engine": r["engine"], "target": r["target"],
                                  "precision": r["precision"], "host_class": hc, "at": at, "p50_ms": p50,
                                  "vs_fp32": fp32, "bench_gate": row["verdict"],
                                  "validation": params.get(PARAM + "verdict"), "source": f"{name} v{v.version}"})
    except KilnError as e:
        return [], f"registry not read ({e}): the host-class matrix holds this workspace's bench only"
    return cells, f"host-class matrix: {len(cells)} registry row(s) from {redact_uri(uri)}, plus this workspace's bench"


def redact_uri(uri: str) -> str:
    from pipeline.registry.client import redact

    return redact(uri)


def host_matrix(cfg: Config, rows: list[dict], root: Path = Path(".")) -> tuple[list[dict], str]:
    """One cell per (engine, host class) at the batch the engine is ranked at: the registry's rows, and this
    workspace's bench for a host class the registry has no row of; per (model, host class) the fastest cell that
    passed its validation and is not `not-faster-here` is marked `best`, with `wins_by` over the next."""
    cells, where = _registry_cells(cfg, rows, root)
    have = {(c["engine"], c["host_class"]) for c in cells}
    for r in rows:
        hc, at = r.get("host_class"), r.get("ranked_at", 1)
        if hc and (r["engine"], hc) not in have and r.get(f"b{at}_p50_ms") is not None:
            cells.append({"model": r["model"], "engine": r["engine"], "target": r["target"],
                          "precision": r["precision"], "host_class": hc, "at": at, "p50_ms": r[f"b{at}_p50_ms"],
                          "vs_fp32": r.get(f"b{at}_speedup_vs_fp32"), "bench_gate": r.get("bench_gate"),
                          "validation": r["verdict"], "source": "this workspace's bench"})
    for c in cells:
        c.update(best=False, wins_by=None, runner_up=None)
    for key in sorted({(c["model"], c["host_class"]) for c in cells}):
        ok = sorted((c for c in cells if (c["model"], c["host_class"]) == key and c["p50_ms"] is not None
                     and c["validation"] == "pass" and c["bench_gate"] != NOT_FASTER), key=lambda c: c["p50_ms"])
        if ok:
            ok[0]["best"] = True
            if len(ok) > 1:
                ok[0]["wins_by"] = round(ok[1]["p50_ms"] / ok[0]["p50_ms"], 3)
                ok[0]["runner_up"] = f"{ok[1]['target']}/{ok[1]['precision']}"
    return cells, where


def matrix_html(cells: list[dict]) -> str:
    """Per model: engines × host classes (p50 at the ranked batch, × its FP32 sibling), the winner per host class
    in bold, and a line per host class: who wins and by how much, which INT8 engines are not faster there."""
    if not cells:
        return '<p class="empty">no bench rows with a host class</p>'
    out = []
    for model in dict.fromkeys(c["model"] for c in cells):
        mine = [c for c in cells if c["model"] == model]
        classes = sorted({c["host_class"] for c in mine})
        engines = list(dict.fromkeys(c["engine"] for c in mine))
        at = mine[0]["at"]
        out.append(f"<h3>{_e(model)} (p50 ms at batch {at})</h3><table class=\"matrix\"><tr><th class=\"l\">engine"
                   "</th>" + "".join(f"<th>{_e(h)}</th>" for h in classes) + "</tr>")
        for name in engines:
            row = [f'<td class="l">{_e(name)}</td>']
            for h in classes:
                c = next((c for c in mine if c["engine"] == name and c["host_class"] == h), None)
                if c is None:
                    row.append("<td>–</td>")
                    continue
                text = _f(c["p50_ms"], ".3f") + (f" ({c['vs_fp32']:.2f}× FP32)" if c.get("vs_fp32") else "")
                if c["bench_gate"] == NOT_FASTER:
                    text += " not faster here"
                win = ' class="win"' if c["best"] else ""
                row.append(f'<td title="{_e(c["source"])}"{win}>{_e(text)}</td>')
            out.append("<tr>" + "".join(row) + "</tr>")
        out.append("</table><ul>")
        for h in classes:
            best = next((c for c in mine if c["host_class"] == h and c["best"]), None)
            line = f"{h}: " + (f"{best['target']}/{best['precision']} wins" + (
                f", {best['wins_by']:.2f}× the next ({best['runner_up']})" if best["wins_by"] else "")
                if best else "no engine passed")
            slow = [c for c in mine if c["host_class"] == h and c["bench_gate"] == NOT_FASTER]
            if slow:
                line += "; not faster here: " + ", ".join(
                    f"{c['engine']}" + (f" ({c['vs_fp32']:.2f}× its FP32 sibling)" if c.get("vs_fp32") else "")
                    for c in slow)
            out.append(f"<li>{_e(line)}</li>")
        out.append("</ul>")
    return "\n".join(out)


def for_release(cfg: Config, tree: Path) -> Report:
    """From a release tree only (release.json, engine/, chain/): deterministic like the archive itself."""
    from pipeline.roles import registry as roles

    doc = json.loads((tree / "release.json").read_text(encoding="utf-8"))
    manifest = read_manifest(tree / doc["manifest"])
    verdict = _read(tree / "engine" / "kiln" / paths.VALIDATION_FILE) or {}
    bench_doc = _read(tree / "engine" / "kiln" / paths.BENCH_FILE) or {}
    bench, benched_on = bench_doc.get("metrics") or {}, bench_doc.get("host_class")
    model = manifest.get("model")
    if doc.get("kind") == "index":
        metric, label = "recall@1", "recall@1"
    else:
        try:
            role = roles.get(cfg.model(model).samples)
            metric, label = role.key_metric, role.accuracy_label
        except Exception:  # noqa: BLE001 — a model this params.yaml no longer has: the verdict's first metric
            metric = next(iter(verdict.get("metrics") or {"accuracy": None}))
            label = metric
    audit = (manifest.get("results") or {}).get("audit") or {}
    row = {"model": model, "target": manifest.get("target"), "precision": manifest.get("precision"),
           "recipe": (manifest.get("build") or {}).get("recipe"), "engine": doc["artifact"],
           "accuracy_metric": label, "accuracy": (verdict.get("metrics") or {}).get(metric),
           "verdict": verdict.get("verdict", "missing"), "fallback_nodes": audit.get("fallback_nodes"),
           "best": False, "note": f"{doc['registered_model']} v{doc['version']}"
                                  + (f", benched on host class {benched_on}" if benched_on else ""),
           **{k: bench.get(k) for k in ("b1_p50_ms", "b1_p99_ms", "b8_p50_ms", "b8_p99_ms",
                                        "b1_speedup_vs_eager", "b8_speedup_vs_eager")}}
    manifests = {m.relative_to(tree / "chain").as_posix(): read_manifest(m)
                 for m in sorted((tree / "chain").rglob(f"*{SUFFIX}"))}
    return Report(f"Kiln release {doc['registered_model']} v{doc['version']}",
                  f"{doc['artifact']}: sha256 of its files {doc['artifact_sha256'][:16]}…, verdict {row['verdict']}",
                  [row], {}, manifests, set(),
                  ["Timings are the bench record registered with this version (its build host), not a new run.",
                   "No gallery index in this release: the matching curve is in the gallery's own release."])


def _read(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- SVG
def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], int]:
    """Round tick values in [lo, hi] and the decimals that tell them apart."""
    if hi <= lo:
        return [lo], 6
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 12) for i in range(int((hi - start) / step) + 1)], \
        max(0, -math.floor(math.log10(step)))


def scatter(points: list[dict[str, Any]], x: str, y: str, xlabel: str, ylabel: str, title: str,
            logx: bool = False) -> str:
    """A small SVG scatter plot of points {x, y, label, color}; `logx`: a log10 x axis with decade ticks."""
    pts = [p for p in points if _finite(p.get(x)) and _finite(p.get(y)) and (not logx or p[x] > 0)]
    if logx:
        pts = [{**p, "_x": p[x], x: math.log10(p[x])} for p in pts]
    w, h, ml, mr, mt, mb = 600, 300, 80, 110, 30, 45
    if not pts:
        return f'<p class="empty">{_e(title)}: nothing measured</p>'
    xs, ys = [p[x] for p in pts], [p[y] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    padx, pady = (x1 - x0) * 0.08 or abs(x0) * 0.1 or 1, (y1 - y0) * 0.1 or abs(y0) * 0.001 or 1e-6
    x0, x1, y0, y1 = x0 - padx, x1 + padx, y0 - pady, y1 + pady

    def px(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * (w - ml - mr)

    def py(v: float) -> float:
        return h - mb - (v - y0) / (y1 - y0) * (h - mt - mb)

    out = [f'<svg class="plot" role="img" aria-label="{_e(title)}" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
           'xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{w / 2}" y="18" text-anchor="middle" class="t">{_e(title)}</text>',
           f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" class="ax"/>',
           f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" class="ax"/>']
    xt, xd = ([float(k) for k in range(math.ceil(x0), math.floor(x1) + 1)], 0) if logx else _ticks(x0, x1)
    for t in xt:
        label = f"{10 ** t:g}" if logx else f"{t:.{xd}f}"
        out.append(f'<text x="{px(t):.1f}" y="{h - mb + 15}" text-anchor="middle" class="k">{label}</text>')
    yt, yd = _ticks(y0, y1)
    for t in yt:
        out.append(f'<text x="{ml - 5}" y="{py(t) + 4:.1f}" text-anchor="end" class="k">{t:.{yd}f}</text>')
        out.append(f'<line x1="{ml}" y1="{py(t):.1f}" x2="{w - mr}" y2="{py(t):.1f}" class="g"/>')
    out.append(f'<text x="{(ml + w - mr) / 2}" y="{h - 8}" text-anchor="middle" class="k">{_e(xlabel)}</text>')
    out.append(f'<text x="14" y="{(mt + h - mb) / 2}" text-anchor="middle" class="k" '
               f'transform="rotate(-90 14 {(mt + h - mb) / 2})">{_e(ylabel)}</text>')
    for p in pts:
        out.append(f'<circle cx="{px(p[x]):.1f}" cy="{py(p[y]):.1f}" r="5" fill="{p.get("color", "#0969da")}">'
                   f'<title>{_e(p.get("label", ""))}: {_e(xlabel)} {p.get("_x", p[x]):.4g}, {_e(ylabel)} '
                   f'{p[y]:.6g}</title></circle>')
        out.append(f'<text x="{px(p[x]) + 7:.1f}" y="{py(p[y]) - 6:.1f}" class="pl">{_e(p.get("label", ""))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def graph(manifests: dict[str, dict[str, Any]], broken: set[str]) -> str:
    """The provenance DAG as layered SVG: sources (assets) on the left, engines on the right."""
    if not manifests:
        return '<p class="empty">no provenance chain</p>'
    edges: set[tuple[str, str]] = set()
    for path, m in manifests.items():
        for ref in m.get("inputs", []):
            if ref.get("manifest") in manifests:
                edges.add((ref["manifest"], path))
            elif "path" in ref and (owner := _owner_of(ref["path"], manifests)):
                edges.add((owner, path))
    depth: dict[str, int] = {}

    def d(n: str, stack: tuple = ()) -> int:
        if n not in depth:
            ups = [a for a, b in edges if b == n and a not in stack]
            depth[n] = 1 + max((d(a, stack + (n,)) for a in ups), default=-1)
        return depth[n]

    layers: dict[int, list[str]] = {}
    for n in sorted(manifests):
        layers.setdefault(d(n), []).append(n)
    bw, bh, gx, gy = 200, 34, 60, 12
    pos = {n: (20 + lx * (bw + gx), 20 + i * (bh + gy)) for lx, ns in layers.items() for i, n in enumerate(ns)}
    w = 40 + len(layers) * (bw + gx)
    h = 40 + max(len(ns) for ns in layers.values()) * (bh + gy)
    out = [f'<svg class="graph" role="img" aria-label="provenance graph" viewBox="0 0 {w} {h}" width="{w}" '
           f'height="{h}" xmlns="http://www.w3.org/2000/svg">']
    for a, b in sorted(edges):
        (ax, ay), (bx, by) = pos[a], pos[b]
        out.append(f'<path d="M{ax + bw},{ay + bh / 2} C{ax + bw + gx / 2},{ay + bh / 2} {bx - gx / 2},{by + bh / 2} '
                   f'{bx},{by + bh / 2}" class="edge"/>')
    for n, (x, y) in sorted(pos.items()):
        m = manifests[n]
        fill = "#ffcecb" if n in broken else KIND_COLOR.get(m.get("kind"), "#f6f8fa")
        label = f"{m.get('kind')}: {m.get('name')}"
        out.append(f'<g><title>{_e(n)}</title><rect x="{x}" y="{y}" width="{bw}" height="{bh}" rx="5" '
                   f'fill="{fill}" class="node"/><text x="{x + 8}" y="{y + 21}" class="nl">'
                   f'{_e(label if len(label) <= 30 else label[:29] + "…")}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def _owner_of(file_path: str, manifests: dict[str, dict[str, Any]]) -> str | None:
    for path, m in manifests.items():
        base = path.rsplit("/", 1)[0] + "/"
        if file_path.startswith(base) and any(f.get("path") == file_path[len(base):] for f in m.get("files", [])):
            return path
    return None


# ---------------------------------------------------------------------------------------------- HTML
CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1f2328;max-width:1500px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:right}
th{background:#f6f8fa}td.l,th.l{text-align:left}tr.best td{font-weight:600;background:#dafbe1}
td.win{font-weight:600;background:#dafbe1}
.v-pass{color:#1a7f37}.v-fail{color:#cf222e}.v-not-run{color:#9a6700}.sub{color:#656d76}.empty{color:#656d76}
svg text{font:11px system-ui,sans-serif}svg .t{font-size:13px;font-weight:600}svg .ax{stroke:#1f2328}
svg .g{stroke:#eaeef2}svg .ln{fill:none;stroke:#8c959f}svg .pl{fill:#424a53}svg .edge{fill:none;stroke:#8c959f}
svg .node{stroke:#57606a}svg .nl{font-size:11px}.plots{display:flex;flex-wrap:wrap;gap:16px}
.graphbox{overflow-x:auto;border:1px solid #d0d7de}"""


def _f(v: Any, fmt: str) -> str:
    if v is None:
        return "–"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt) if math.isfinite(v) or "d" not in fmt else str(v)
    return str(v)


def render(r: Report) -> str:
    parts = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
             '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'; '
             'img-src data:">', f"<title>{_e(r.title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{_e(r.title)}</h1><p class=\"sub\">{_e(r.subtitle)}</p>"]
    parts += [f"<p class=\"sub\">{_e(n)}</p>" for n in r.notes]
    models = list(dict.fromkeys(row["model"] for row in r.rows))
    parts.append('<h2 id="engines">Engines: latency, speed-up, accuracy, verdict, fallbacks</h2>')
    head = ["target", "precision", "b1 p50 ms", "b1 p99 ms", "b8 p50 ms", "b8 p99 ms", "b1 × eager", "b8 × eager",
            "accuracy", "verdict", "fallbacks"]
    for model in models:
        rows = [x for x in r.rows if x["model"] == model]
        parts.append(f"<h3>{_e(model)}</h3><table class=\"engines\"><tr>"
                     + "".join(f'<th class="{"l" if i < 2 else ""}">{_e(h)}</th>' for i, h in enumerate(head))
                     + "</tr>")
        for x in rows:
            prec = f"{x.get('precision')}" + (f" ({x['recipe']})" if x.get("recipe") else "")
            cells = [x["target"], prec, _f(x.get("b1_p50_ms"), ".3f"), _f(x.get("b1_p99_ms"), ".3f"),
                     _f(x.get("b8_p50_ms"), ".3f"), _f(x.get("b8_p99_ms"), ".3f"),
                     _f(x.get("b1_speedup_vs_eager"), ".2f"), _f(x.get("b8_speedup_vs_eager"), ".2f"),
                     f"{x['accuracy_metric']} {_f(x.get('accuracy'), '.6g')}"]
            parts.append(f'<tr class="{"best" if x.get("best") else ""}">'
                         + "".join(f'<td class="{"l" if i < 2 else ""}">{_e(c)}</td>' for i, c in enumerate(cells))
                         + f'<td class="l v-{_e(x["verdict"])}">{_e(x["verdict"])}</td>'
                         + f'<td>{_e(_f(x.get("fallback_nodes"), "d"))}</td></tr>')
        parts.append("</table>")
    parts.append('<h2 id="host-classes">Per host class: engine × host class</h2><p class="sub">Each host class '
                 "(the CPU's ISA tier) keeps its own bench rows in the registry; bold: the fastest engine there that "
                 "passed its gate. An INT8 engine that does not beat its FP32 sibling by the bench margin with "
                 "confidence on a host class is marked not faster here and never wins there.</p>")
    parts.append(matrix_html(r.matrix))
    parts.append('<h2 id="accuracy-latency">Accuracy vs latency (batch 1, p50)</h2><div class="plots">')
    for model in models:
        pts = [{"x": x.get("b1_p50_ms"), "y": x.get("accuracy"), "label": f"{x.get('target')}/{x.get('precision')}",
                "color": VERDICT_COLOR.get(x["verdict"], "#6e7781")} for x in r.rows if x["model"] == model]
        metric = next(x["accuracy_metric"] for x in r.rows if x["model"] == model)
        parts.append(scatter(pts, "x", "y", "b1 p50 latency (ms)", metric, f"{model}: {metric} vs latency"))
    parts.append("</div>")
    parts.append('<h2 id="matching">Matching: recall vs latency per index</h2>')
    if not r.curves:
        parts.append('<p class="empty">no matching curve in this scope</p>')
    parts.append('<div class="plots">')
    for gallery, pts in r.curves.items():
        plot = [{"x": p.get("p50_ms_b1"), "y": p.get("recall@1"), "label": p.get("index", "") + (
            " (chosen)" if p.get("chosen") else ""), "color": "#1a7f37" if p.get("chosen") else "#0969da"}
            for p in pts]
        parts.append(scatter(plot, "x", "y", "b1 p50 latency (ms, log)", "recall@1",
                             f"{gallery}: recall@1 vs latency", logx=True))
    parts.append("</div>")
    if r.systems is not None:
        parts += report_systems.section(r.systems)
        parts += report_systems.peers_section(r.peers)
    if r.production:
        parts.append('<h2 id="production">In production (the registry)</h2><p class="sub">Each face system\'s '
                     "production version as its registered run recorded it: what a release of it ships.</p>"
                     '<table class="production"><tr><th class="l">system</th><th>version</th><th class="l">system '
                     'gate</th><th class="l">parts</th></tr>')
        parts += [f'<tr><td class="l">{_e(x["system"])}</td><td>v{_e(x["version"])}</td><td class="l">'
                  f'{_e(x["verdict"])}</td><td class="l">{_e(", ".join(x["parts"]))}</td></tr>' for x in r.production]
        parts.append("</table>")
    parts.append(f'<h2 id="provenance">Provenance ({len(r.manifests)} artifacts)</h2>'
                 '<p class="sub">Each box is an artifact with a manifest; an arrow runs from an input to what was '
                 'built from it. Red: its files or links did not verify.</p>')
    parts.append(f'<div class="graphbox">{graph(r.manifests, r.broken)}</div>')
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write(r: Report, dest: Path) -> Path:
    with atomic_path(Path(dest)) as tmp:
        tmp.write_text(render(r), encoding="utf-8")
    return Path(dest)


__all__ = ["Report", "for_release", "for_workspace", "graph", "render", "scatter", "write"]
