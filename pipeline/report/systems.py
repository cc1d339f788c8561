"""The report's systems section: each face system under sustained load (sysbench@), where its frame time goes and
each graph on this host's roofline (inline SVG, like the rest of `kiln report`)."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import paths

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE_COLORS = {"queue_wait": "#d0d7de", "pnet": "#0969da", "rnet": "#54aeff", "onet": "#80ccff",
                "detect_glue": "#cf222e", "align": "#bf8700", "embed": "#1a7f37", "match": "#8250df"}
BOUND_COLORS = {"compute": "#1a7f37", "memory": "#0969da", "overhead": "#cf222e"}


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def collect(cfg: Config, root: Path = Path(".")) -> dict[str, dict]:
    """system name → {"sysbench": …, "bottleneck": …} for each system whose sysbench@ ran here."""
    out = {}
    for name in cfg.systems:
        d = paths.sysbench(name, root)
        try:
            sb = json.loads((d / "sysbench.json").read_text(encoding="utf-8"))
            out[name] = {"sysbench": sb, "bottleneck": json.loads((d / "bottleneck.json").read_text(encoding="utf-8"))}
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        # each engine's target from params (an engine no longer in params.yaml: named as it was run)
        out[name]["targets"] = sorted({cfg.engines[e].target if e in cfg.engines else e
                                       for e in sb["engines"].values()})
    return out


def stacked_bars(systems: dict[str, dict]) -> str:
    """One horizontal bar per system: its frame latency at the load point it held, split by stage."""
    rows = [(n, s["bottleneck"]) for n, s in systems.items() if s["bottleneck"].get("stages")]
    if not rows:
        return '<p class="empty">no system benchmarked under load</p>'
    w, lm, rm, bh, gap, top = 900, 170, 60, 22, 10, 30
    longest = max(b["frame_ms"] for _, b in rows)
    scale = (w - lm - rm) / longest
    h = top + len(rows) * (bh + gap) + 60
    out = [f'<svg class="plot" role="img" aria-label="frame latency by stage" viewBox="0 0 {w} {h}" width="{w}" '
           f'height="{h}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{w / 2}" y="18" text-anchor="middle" class="t">mean frame latency by stage, at the most '
           'streams held within budget (ms)</text>']
    for i, (name, b) in enumerate(rows):
        y, x = top + i * (bh + gap), lm
        out.append(f'<text x="{lm - 6}" y="{y + bh - 6}" text-anchor="end" class="k">{_e(name)} '
                   f'({b["at_streams"]} str.)</text>')
        for stage, share in sorted(b["stages"].items(), key=lambda kv: -kv[1]):
            seg = share * b["frame_ms"] * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{seg:.1f}" height="{bh}" '
                       f'fill="{STAGE_COLORS.get(stage, "#6e7781")}"><title>{_e(stage)}: '
                       f'{share * b["frame_ms"]:.1f} ms ({share:.0%})</title></rect>')
            x += seg
        out.append(f'<text x="{x + 4:.1f}" y="{y + bh - 6}" class="k">{b["frame_ms"]:.1f}</text>')
    ly = top + len(rows) * (bh + gap) + 15
    for j, (stage, color) in enumerate(STAGE_COLORS.items()):
        lx = lm + j * 88
        out.append(f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="{ly + 9}" class="pl">{_e(stage)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def roofline_plot(name: str, b: dict) -> str:
    """Log-log roofline: this host's roof (bandwidth slope, then the float32 peak) and one point per graph."""
    roof, pts = b["roof"], [(m, g["roofline"]) for m, g in b["graphs"].items() if g.get("roofline")]
    pts = [(m, r) for m, r in pts if r["intensity"] > 0 and r["achieved_gflops"] > 0]
    prec = {m: g.get("precision", "") for m, g in b["graphs"].items()}
    if not pts:
        return f'<p class="empty">{_e(name)}: no graph counted</p>'
    peak, bw = roof["peak_flops"] / 1e9, roof["bandwidth_bytes_s"] / 1e9
    xs = [r["intensity"] for _, r in pts] + [roof["ridge_flops_per_byte"]]
    ys = [r["achieved_gflops"] for _, r in pts] + [peak]
    x0, x1 = math.floor(math.log10(min(xs) / 2)), math.ceil(math.log10(max(xs) * 2))
    y0, y1 = math.floor(math.log10(min(ys) / 2)), math.ceil(math.log10(max(ys) * 2))
    w, h, ml, mr, mt, mb = 600, 330, 70, 120, 42, 45

    def px(v: float) -> float:
        return ml + (math.log10(v) - x0) / (x1 - x0) * (w - ml - mr)

    def py(v: float) -> float:
        return h - mb - (math.log10(v) - y0) / (y1 - y0) * (h - mt - mb)
    out = [f'<svg class="plot" role="img" aria-label="{_e(name)} roofline" viewBox="0 0 {w} {h}" width="{w}" '
           f'height="{h}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{w / 2}" y="16" text-anchor="middle" class="t">{_e(name)}: roofline</text>',   # two lines:
           f'<text x="{w / 2}" y="32" text-anchor="middle" class="k">{roof["threads"]} thread(s); float32 peak '
           f'{peak:.0f} GFLOP/s, {bw:.1f} GB/s; INT8 can pass it</text>',                      # a long name fits
           f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" class="ax"/>',
           f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" class="ax"/>']
    for k in range(x0, x1 + 1):
        out.append(f'<text x="{px(10 ** k):.1f}" y="{h - mb + 15}" text-anchor="middle" class="k">{10 ** k:g}</text>')
    for k in range(y0, y1 + 1):
        out.append(f'<text x="{ml - 5}" y="{py(10 ** k) + 4:.1f}" text-anchor="end" class="k">{10 ** k:g}</text>')
        out.append(f'<line x1="{ml}" y1="{py(10 ** k):.1f}" x2="{w - mr}" y2="{py(10 ** k):.1f}" class="g"/>')
    lo, ridge, hi = 10 ** x0, roof["ridge_flops_per_byte"], 10 ** x1
    start = max(lo, 10 ** y0 / bw)
    out.append(f'<polyline fill="none" stroke="#24292f" stroke-width="2" points="{px(start):.1f},'
               f'{py(start * bw):.1f} {px(ridge):.1f},{py(peak):.1f} {px(hi):.1f},{py(peak):.1f}"/>')
    out.append(f'<text x="{(ml + w - mr) / 2}" y="{h - 8}" text-anchor="middle" class="k">arithmetic intensity '
               '(FLOP / byte)</text>')
    out.append(f'<text x="14" y="{(mt + h - mb) / 2}" text-anchor="middle" class="k" '
               f'transform="rotate(-90 14 {(mt + h - mb) / 2})">achieved GFLOP/s</text>')
    placed: list[tuple[float, float]] = []                   # labels so far: a label near one moves down a line
    for m, r in sorted(pts, key=lambda mr: -mr[1]["achieved_gflops"]):
        x, y = px(r["intensity"]), py(r["achieved_gflops"])
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" '
                   f'fill="{BOUND_COLORS[r["bound"]]}"><title>{_e(m)}: {r["achieved_gflops"]:.3g} GFLOP/s at '
                   f'{r["intensity"]:.3g} FLOP/B, {r["of_attainable"]:.0%} of the roof there ({_e(r["bound"])})'
                   '</title></circle>')
        ly = y - 6
        while any(abs(ly - py_) < 11 and abs(x - px_) < 110 for px_, py_ in placed):
            ly += 11
        placed.append((x, ly))
        out.append(f'<text x="{x + 7:.1f}" y="{ly:.1f}" class="pl">{_e(m)} {_e(prec[m])} ({_e(r["bound"])})</text>')
    out.append("</svg>")
    return "\n".join(out)


def cost_rows(systems: dict[str, dict]) -> list[list[Any]]:
    """One row per system, the buyer's comparison: its targets, streams held at the budget on this machine, cores per
    stream (the machine's cores over the streams held) and the CPU a stream measurably used (CPU-s a frame × fps, at
    the largest stream count held), and the stage that owned most of the frame there."""
    rows = []
    for name, s in systems.items():
        sb, b = s["sysbench"], s["bottleneck"]
        held = [p for p in sb["points"] if p["within_budget"]]
        at = max(held, key=lambda p: p["streams"]) if held else None
        cores, n = sb["plan"]["cores"], sb["streams_at_budget"]
        used = at["cpu_s_per_frame"] * sb["frames"]["fps"] if at and at["cpu_s_per_frame"] is not None else None
        rows.append([name, ", ".join(s["targets"]), n, round(cores / n, 2) if n else "—",
                     round(used, 3) if used is not None else "—", b.get("bottleneck") or "—"])
    return rows


def section(systems: dict[str, dict]) -> list[str]:
    """The systems section's HTML parts."""
    parts = ['<h2 id="systems">Systems under sustained load</h2><p class="sub">Each gated system (system@) run by '
             "sysbench@ on N concurrent streams from the pinned-photo frame source; a stream count is held when its "
             "p99 frame latency (arrival → match decision) is within the budget and no frame is dropped. Timings "
             "are one run on the host class named.</p>"]
    if not systems:
        return [*parts, '<p class="empty">no sysbench@ result in this workspace (dvc repro runs it)</p>']
    parts.append('<table class="engines costs"><tr>' + "".join(f"<th>{_e(h)}</th>" for h in (
        "system", "targets", "streams at the budget", "cores per stream", "CPU cores a stream used",
        "bottleneck")) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in cost_rows(systems)]
    parts.append("</table>")
    head = ["streams", "offered fps", "achieved fps", "p50 ms", "p95 ms", "p99 ms", "dropped", "late", "CPU s/frame",
            "mean batch", "held"]
    for name, s in systems.items():
        sb = s["sysbench"]
        plan = sb["plan"]
        parts.append(f"<h3>{_e(name)}: {sb['streams_at_budget']} stream(s) at p99 ≤ {sb['budget']['p99_ms']:g} ms, "
                     f"{sb['frames']['fps']:g} fps {sb['frames']['resolution'][0]}×{sb['frames']['resolution'][1]}"
                     f"</h3><p class=\"sub\">host class {_e(sb['host_class'])}; {plan['workers']} worker(s) × "
                     f"{plan['threads']} thread(s) per engine; batched: "
                     + _e("; ".join(f"{k} {v}" for k, v in sb["batched"].items())) + "</p>")
        parts.append('<table class="engines"><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
        for p in sb["points"]:
            lat = p["latency_ms"]
            cells = [p["streams"], p["offered_fps"], p["achieved_fps"], lat["p50"], lat["p95"], lat["p99"],
                     p["dropped"], p["late"], p["cpu_s_per_frame"], p["mean_batch"],
                     "yes" if p["within_budget"] else "no"]
            parts.append("<tr>" + "".join(f"<td>{_e('—' if c is None else c)}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
        b = s["bottleneck"]
        if b.get("bottleneck"):
            amdahl = ", ".join(f"{st} {v:.0%}" for st, v in sorted(b["amdahl_2x"].items(), key=lambda kv: -kv[1]))
            parts.append(f'<p class="sub">Bottleneck at {b["at_streams"]} stream(s): {_e(b["bottleneck"])}. '
                         f"2× faster on a stage saves (share of frame latency): {_e(amdahl)}.</p>")
    parts.append(stacked_bars(systems))
    parts.append('<div class="plots">')
    parts += [roofline_plot(name, s["bottleneck"]) for name, s in systems.items()]
    parts.append("</div>")
    return parts


def peers_section(peers: dict | None) -> list[str]:
    """bench/peers.py's record: the runtimes a user would run instead, on the same frames, beside Kiln's systems."""
    parts = ['<h2 id="peers">Against what a user runs instead</h2><p class="sub">bench/peers.py: OpenCV\'s own '
             "FaceDetectorYN + FaceRecognizerSF on the same YuNet and SFace files, and dlib's own pipeline as "
             "face_recognition runs it on the same ResNet weights, beside Kiln's systems on the sysbench@ frames and a "
             "portrait, one frame at a time; ms per frame is the p50 of interleaved rounds. Agreement: frames on "
             "which the peer names the same identities as the Kiln system running the same weights.</p>"]
    if not peers:
        return [*parts, '<p class="empty">no peers record in this workspace (run .venv/bin/python bench/peers.py)</p>']
    parts.append(f'<p class="sub">host class {_e(peers.get("host_class"))}; {_e(peers.get("rounds"))} rounds; '
                 + _e("; ".join(f"{n}: threads {p.get('threads')}" for n, p in peers.get("peers", {}).items()))
                 + "</p>")
    for set_name, st in peers.get("sets", {}).items():
        parts.append(f"<h3>{_e(set_name)}: {_e(st.get('frames'))} frame(s)</h3>")
        parts.append('<table class="engines peers"><tr>' + "".join(f"<th>{_e(h)}</th>" for h in (
            "runner", "ms/frame p50", "faces", "peer ms ÷ Kiln ms", "agreement with Kiln")) + "</tr>")
        for name, r in st.get("rows", {}).items():
            cells = [name, r.get("ms_per_frame_p50"), r.get("faces"),
                     ", ".join(f"{k}: {v:.2f}×" for k, v in r.get("vs_peer", {}).items()) or "—",
                     ", ".join(f"{k}: {v}" for k, v in r.get("agreement", {}).items()) or "—"]
            parts.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    return parts
