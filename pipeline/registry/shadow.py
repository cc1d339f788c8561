"""A shadow report with a system promotion (`kiln promote --system NAME V --shadow-report LOG`): the summary of a
shadow rollout (kiln_runtime/shadow.py) recorded with the move, after checking it compared THIS version, by its
content digest, with the production version it replaces. Recorded, not gated: the agreement a release engineer
accepts depends on what changed (another embedder precision moves a few decisions by design); the record says what
was seen on live traffic and `kiln history` shows it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kiln_runtime import shadow as sh
from kiln_runtime.release import system_content
from pipeline.errors import KilnError
from pipeline.registry.aliases import PARAM

HEAD = PARAM + "shadow."


def load(log: Path) -> dict[str, Any]:
    """The log's summary, with the log's own sha256 (what the record points at)."""
    header, records = sh.read_log(log)
    s = sh.summarize(header, records)
    s["log_sha256"] = hashlib.sha256(Path(log).read_bytes()).hexdigest()
    return s


def check(s: dict[str, Any], name: str, version: int, v, current: int | None) -> None:
    """The shadow ran this version (`v`: the proven VerifiedSystem) beside the current production version."""
    cand, prod = s["candidate"], s["production"]
    digest = system_content(v.system, v.manifest, v.parts)
    if cand.get("name") != name or cand.get("system_sha256") != digest:
        raise KilnError(f"the shadow report is of {cand.get('name')} v{cand.get('version')} (system "
                        f"{str(cand.get('system_sha256'))[:12]}), not of {name} v{version} ({digest[:12]})",
                        f"shadow {name} v{version}'s own release: kiln-run serve PROD --shadow CANDIDATE")
    if current is not None and (prod.get("name"), prod.get("version")) != (name, current):
        raise KilnError(f"the shadow report ran beside {prod.get('name')} v{prod.get('version')}, not beside the "
                        f"production version v{current}", "shadow the candidate beside what production runs")
    if not s["frames"]["compared"]:
        raise KilnError("the shadow report compared no frame", "let the shadow see traffic first (kiln-run "
                        "shadow-report LOG shows what it has)")


def record(s: dict[str, Any]) -> dict[str, str]:
    """The move's run parameters (immutable): the line, the counts, both p99s, the log's digest."""
    fields = {"summary": sh.verdict_line(s), "log_sha256": s["log_sha256"],
              "frames": json.dumps(s["frames"], sort_keys=True),
              "agreement": json.dumps(s["agreement"], sort_keys=True),
              "ms": json.dumps(s["ms"], sort_keys=True), "production": f"{s['production']['name']} "
              f"v{s['production']['version']}", "candidate_gallery": str(s.get("candidate_gallery"))}
    return {HEAD + k: v for k, v in fields.items()}


__all__ = ["check", "load", "record"]
