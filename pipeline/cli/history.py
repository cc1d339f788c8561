"""`kiln history`: show the recorded alias moves (register, promote, rollback) of a model"""

from __future__ import annotations

import argparse

from pipeline.cli.common import MAX_REASON, is_system, load_cfg, warn_forged

NAME = "history"
HELP = ("show the recorded alias moves (register, promote, rollback) of a model")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="registered model (kiln-<engine>), engine name, or with --system a system name")
    p.add_argument("--alias", help="only this alias (e.g. production)")
    p.add_argument("--system", action="store_true", help="NAME is a face system: its moves and its versions' parts")


def run(args) -> int:
    from pipeline import registry, tables
    from pipeline.registry.registration import bench_rows

    cfg = load_cfg(args)
    if is_system(args):
        from pipeline.registry import systems

        args.name = systems.registered(args.name)
    moves = registry.history(cfg, args.name, alias=args.alias, gaps=True)     # moves made outside kiln marked
    if not moves:
        print(f"history: no alias moves recorded for {tables.shown(args.name)}")
    else:       # every cell escaped and bounded by the table printer: a reason is a user's, the rest a registry's
        print(tables.markdown(["at (UTC)", "alias", "action", "from", "to", "actor", "reason"],
                              [(m.at, m.alias, m.action, "-" if m.from_version is None else f"v{m.from_version}",
                                "-" if m.to_version is None else f"v{m.to_version}", m.actor, m.reason)
                               for m in moves], max_cell=MAX_REASON + 300))
    if is_system(args):
        from pipeline.registry import systems

        found, forged = systems.versions(cfg, args.name)
        print("\nversions (as each version's run recorded them; * production):")
        print(tables.markdown(["version", "system gate", "embedder", "gallery", "parts"],
                              [(f"v{v['version']}" + (" *" if v["production"] else ""), v["verdict"], v["embedder"],
                                v["gallery_compat"], v["parts"]) for v in found]))
        warn_forged(forged)
        return 0
    rows, forged = bench_rows(cfg, args.name)
    warn_forged(forged)
    if rows:   # what each host class measured, one row per (version, host class): a second host adds its own
        speed = sorted({k for r in rows for k in r if k.endswith(("_p50_ms", "_speedup_vs_fp32"))})
        print("\nbench per host class:")
        print(tables.markdown(["version", "host class", "bench verdict", *speed],
                              [(f"v{r['version']}", r["host_class"], r["verdict"] or "-",
                                *(r.get(k, "-") for k in speed)) for r in rows]))
    return 0
