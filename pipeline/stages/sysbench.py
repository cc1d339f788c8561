"""sysbench@<name>: a gated face system under sustained load — streams per machine at the p99 budget, and where
its frame time goes.

Runs the system@<name> that passed its gate (the engines its manifest names, each loaded verified) on N concurrent
streams of frames from the deterministic frame source (pipeline/sysbench/frames.py), sweeping params
`sysbench.streams` until a point misses the budget (pipeline/sysbench/load.py), then counts each graph's FLOPs and
bytes at the shapes it was fed and puts them on this host's measured roof (pipeline/sysbench/roofline.py).

Writes artifacts/sysbench/<name>/sysbench.json (the sweep: per stream count frame latency p50/p95/p99, achieved
frames/s, dropped and late frames, CPU-seconds per frame, per-stage ms, batching; the headline streams at budget;
workers and threads picked) and bottleneck.json (shares, roofline points, Amdahl headroom). Both are one run's
timings on one host class — DVC outputs with `cache: false`, never restored from a cache — and the headline also
goes in the stage's run record. Not a gate: a host that holds fewer streams is a fact about the host.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, samples, stage, targets, toolchain
from pipeline.dvcfiles import address
from pipeline.e2e import System, graphs, resolve
from pipeline.errors import KilnError
from pipeline.manifest import input_ref, manifest_path, read_verified, write_json_atomic
from pipeline.roles import registry as roles
from pipeline.sysbench import frames, load, roofline

if TYPE_CHECKING:
    from pipeline.config import Config


def _deps(cfg: Config, key: str) -> list[str]:
    enrolment = paths.data_set(samples.chip_set(cfg, cfg.system(key).embedder, "golden"))
    return [paths.system(key).as_posix(), *(paths.engine(e).as_posix() for e in resolve(cfg, key).values()),
            *samples.photo_deps(cfg), enrolment.as_posix(),
            *((paths.export(m) / paths.ONNX_FILE).as_posix() for m in graphs(cfg, key))]


STAGE = stage.Stage(
    "sysbench", "pipeline.stages.sysbench",
    "a gated face system under sustained load: streams at the p99 budget, per-stage shares, roofline (uncached)",
    keys=lambda cfg: list(cfg.systems), deps=_deps,
    params=lambda cfg, key: ["sysbench", f"systems.{key}", "data.photos", "data.min_face_size",
                             *(f"models.{m}" for m in graphs(cfg, key)),
                             *(f"engines.{e}" for e in resolve(cfg, key).values())],
    dynamic=lambda cfg, key: sorted({*(targets.module(cfg.engine(e).target) for e in resolve(cfg, key).values()),
                                     *(m for g in graphs(cfg, key) for m in roles.modules(cfg.model(g).samples))}),
    outs=lambda cfg, key: [stage.Out((paths.sysbench(key) / "sysbench.json").as_posix(), cache=False, kind="metrics"),
                           stage.Out((paths.sysbench(key) / "bottleneck.json").as_posix(), cache=False)],
    help="benchmark a face system under sustained load (streams per machine at the p99 budget)")


def _gated(name: str, root: Path) -> tuple[dict[str, str], dict]:
    """The engines system@<name> gated, from its verified manifest; refused unless that gate passed."""
    man = manifest_path(paths.system(name, root), name)
    if not man.is_file():
        raise KilnError(f"sysbench@{name}: {paths.system(name, root)} has no gated system",
                        f"gate it first: dvc repro {address(f'system@{name}')}")
    doc = read_verified(man, fast=True)
    if doc["results"]["verdict"] != "pass":
        raise KilnError(f"sysbench@{name}: system@{name} did not pass its gate ({doc['results']['verdict']})",
                        "benchmark only a system that behaves like its reference: fix it, then dvc repro")
    return dict(doc["results"]["engines"]), input_ref("system", man, root)


def run(cfg: Config, name: str, root: Path = Path("."), params: Path = Path("params.yaml"), progress=print) -> dict:
    """Sweep, count, write sysbench.json + bottleneck.json; return the sweep's report."""
    root = Path(root)
    picks, system_ref = _gated(name, root)
    feed = frames.load(cfg, root)
    sweep = load.sweep(cfg, name, picks, feed, root, params, progress)
    plan = load.plan(cfg)
    probe = System.from_picks(cfg, name, picks, root, system=name, threads=plan.threads)
    probe.enroll(root)
    calls = roofline.capture_shapes(probe, feed)
    roof = roofline.host_roof(plan.threads)
    where = roofline.bottleneck(cfg, name, picks, calls, len(feed), sweep, roof, root)
    host = {"host_class": toolchain.host_class(), "cpu": toolchain.cpu()["cpu"]}
    sb = cfg.sysbench
    report = {"system": name, **host, "system_xxh3_128": system_ref["xxh3_128"], "engines": picks,
              "frames": {"distinct": len(feed), "resolution": list(sb.resolution), "fps": sb.fps,
                         "sha256": frames.digest(feed)},
              "budget": {"p99_ms": sb.p99_budget_ms, "rule": "p99 ≤ budget and no frame dropped"}, **sweep}
    d = paths.sysbench(name, root)
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / "bottleneck.json", {**host, **where})
    write_json_atomic(d / "sysbench.json", report)
    return {**report, "bottleneck": where}


def main(argv: list[str] | None = None) -> int:
    from pipeline import tables

    def body(args, run_) -> int:
        r = run(args.cfg, args.key, params=args.params)
        rows = [[p["streams"], p["offered_fps"], p["achieved_fps"], p["latency_ms"]["p50"], p["latency_ms"]["p95"],
                 p["latency_ms"]["p99"], p["dropped"], p["late"], p["cpu_s_per_frame"], p["mean_batch"],
                 "yes" if p["within_budget"] else "no"] for p in r["points"]]
        print(tables.markdown(["streams", "offered fps", "fps", "p50 ms", "p95 ms", "p99 ms", "dropped", "late",
                               "CPU s/frame", "batch", "in budget"], rows))
        b, plan = r["bottleneck"], r["plan"]
        print(f"streams at p99 ≤ {r['budget']['p99_ms']:g} ms, {r['frames']['fps']:g} fps "
              f"{r['frames']['resolution'][0]}×{r['frames']['resolution'][1]}: {r['streams_at_budget']}  "
              f"(host class {r['host_class']}; {plan['workers']} workers × {plan['threads']} thread(s) per engine)")
        if b.get("bottleneck"):
            top = sorted(b["stages"].items(), key=lambda kv: -kv[1])[:4]
            print(f"at {b['at_streams']} stream(s): " + ", ".join(f"{s} {v:.0%}" for s, v in top) +
                  f"; 2× on {b['bottleneck']} saves {b['amdahl_2x'][b['bottleneck']]:.0%} of frame latency")
        run_.record.update({"host_class": r["host_class"], "streams_at_budget": r["streams_at_budget"],
                            "points": r["points"], "plan": plan})
        return 0

    return stage.main(STAGE, body, argv, key_help="system name from params.yaml `systems:`")


if __name__ == "__main__":
    sys.exit(main())
