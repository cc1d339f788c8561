"""Upgrade reports in the registry: each row of `kiln upgrade-report` (pipeline/release/upgrade.py) is a run of the
experiment `kiln-upgrades`, its digests and verdict as run parameters (immutable), so that `kiln promote --system`
shows the verdict of each part it moves that a report compared with production — found by the part's content
digest (the sha256 registration keys a version on), whichever version number the rebuild was registered as.

Recorded, not gated: the report exits 1 on `differs` or `worse`, where a release engineer looks; a promotion then
carries what the report said into the system's history (`kiln history --system`)."""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING

from pipeline.registry.aliases import PARAM, MAX_RECORD, actor_name, now

if TYPE_CHECKING:
    from pipeline.registry.client import Registry

UPGRADES_EXPERIMENT = "kiln-upgrades"
HEAD = PARAM + "upgrade."


def log(reg: Registry, row, host_class: str) -> str:
    """Log one compared row (an upgrade.Row) as a finished run; its id."""
    from mlflow.entities import Metric, Param

    eid = reg.experiment_id(UPGRADES_EXPERIMENT)
    tags = {"engine": row.engine, "model": row.registered_model, "verdict": row.verdict, "host_class": host_class,
            "host": socket.gethostname(), "actor": actor_name(), "at": now()}
    run = reg.client.create_run(eid, run_name=f"upgrade {row.engine}: production v{row.production} vs {row.candidate}",
                                tags=tags)
    rid = run.info.run_id
    params = {"engine": row.engine, "registered_model": row.registered_model, "production_version": str(row.production),
              "production_sha256": row.production_sha256, "candidate_sha256": row.candidate_sha256,
              "candidate_xxh3_128": row.candidate_xxh3_128, "verdict": row.verdict, "host_class": host_class,
              "summary": row.line()[:MAX_RECORD], "changed": json.dumps(row.changed)[:MAX_RECORD],
              "latency": json.dumps({str(b): {k: v for k, v in x.items() if k != "rounds"}
                                     for b, x in row.latency.items()}, sort_keys=True)[:MAX_RECORD]}
    metrics = {"max_abs": row.max_abs, "cosine_min": row.cosine_min,
               **{f"b{b}_ratio": x["ratio"] for b, x in row.latency.items()}}
    try:
        reg.client.log_batch(rid, params=[Param(HEAD + k, v) for k, v in sorted(params.items())],
                             metrics=[Metric(k, float(v), 0, 0) for k, v in sorted(metrics.items())
                                      if v == v and abs(v) != float("inf")])
    except BaseException:
        reg.client.set_terminated(rid, "FAILED")
        raise
    reg.client.set_terminated(rid, "FINISHED")
    return rid


def found(reg: Registry, parts, production: dict[str, int]) -> dict[str, dict[str, str]]:
    """For each part (kiln_runtime.release.Part) whose registered model's production version is another (in
    `production`: registered model → version), the latest report comparing that very build (its content digest)
    with the version production runs: {part's registered model: {summary, verdict, run}}."""
    exp = reg.client.get_experiment_by_name(UPGRADES_EXPERIMENT)
    if exp is None:
        return {}
    out: dict[str, dict[str, str]] = {}
    for p in parts:
        current = production.get(p.registered_model)
        if current is None or current == p.version:
            continue
        runs = reg.client.search_runs([exp.experiment_id], filter_string=f"tags.model = '{p.registered_model}'",
                                      order_by=["attributes.start_time DESC"], max_results=200)
        for r in runs:
            q = r.data.params
            if r.info.status == "FINISHED" and q.get(HEAD + "candidate_sha256") == p.sha256 \
                    and q.get(HEAD + "production_version") == str(current):
                out[p.registered_model] = {"summary": q.get(HEAD + "summary", ""), "verdict": q.get(HEAD + "verdict",
                                                                                                    ""),
                                           "run": r.info.run_id}
                break
    return out


def record(reports: dict[str, dict[str, str]]) -> dict[str, str]:
    """A move's run parameters: per part, the report's verdict line and its run."""
    return {f"{HEAD}{model}": f"{x['summary']} (run {x['run']})"[:MAX_RECORD] for model, x in sorted(reports.items())}


def lines(reports: dict[str, dict[str, str]]) -> list[str]:
    return [f"upgrade report: {x['summary']}" for _, x in sorted(reports.items())]


__all__ = ["UPGRADES_EXPERIMENT", "found", "lines", "log", "record"]
