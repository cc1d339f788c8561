"""system@<name>: a face system (params.yaml `systems:`) gated end to end, like validate@ gates one engine.

Each graph's engine is resolved as `kiln identify` resolves it (pipeline/e2e.py `resolve`): pinned by name
(`systems.<name>.engines`), else the system's `target` in its `precision`, else that target's FP32 engine — never
"the fastest" (that would make the system depend on this host's timings). Each engine must have passed its own gate
(validate@); it is loaded only after its files verify. The system then runs on the pinned photos beside the
reference system (the same graphs as PyTorch modules, or an ONNX-delivered model's original file) and is judged on
faces, identities and same/different decisions (pipeline/gates/system.py; limits `systems.<name>.gate`).

Writes artifacts/systems/<name>/: system.json (each engine's name and identity digest, matching, thresholds,
preprocessing, detector settings) and verdict.json (metrics, limits, failures, verdict), with a manifest (kind
"system") whose inputs are the engines' and their validations' manifests, the photos, the reference's source files
and the enrolment set — so `kiln verify` covers it. The verdict is written either way; a failing gate then exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import models, paths, samples, stage, targets
from pipeline.dvcfiles import address
from pipeline.e2e import System, graphs, resolve
from pipeline.errors import GateFailed, KilnError
from pipeline.gates import system as gate
from pipeline.gates.reference import source_inputs
from pipeline.manifest import (atomic_dir, build_manifest, input_ref, manifest_path, read_verified, write_json_atomic,
                               write_manifest)
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config


def _enrolment(cfg: Config, key: str, root: Path = Path(".")) -> Path:
    return paths.data_set(samples.chip_set(cfg, cfg.system(key).embedder, "golden"), root)


def _deps(cfg: Config, key: str) -> list[str]:
    engines = resolve(cfg, key).values()
    return [*(paths.engine(e).as_posix() for e in engines), *(paths.validation(e).as_posix() for e in engines),
            *samples.photo_deps(cfg), *(w for m in graphs(cfg, key) for w in models.weight_deps(cfg.model(m))),
            _enrolment(cfg, key).as_posix()]


STAGE = stage.Stage(
    "system", "pipeline.stages.system",
    "a face system's engines against the reference system on the photos: faces, identities, decisions (exit 1)",
    keys=lambda cfg: list(cfg.systems), deps=_deps,
    params=lambda cfg, key: [f"systems.{key}", "data.photos", "data.chip_size", "data.template",
                             "data.min_face_size", *(f"models.{m}" for m in graphs(cfg, key)),
                             *(f"engines.{e}" for e in resolve(cfg, key).values())],
    dynamic=lambda cfg, key: sorted({*(targets.module(cfg.engine(e).target) for e in resolve(cfg, key).values()),
                                     *(m for g in graphs(cfg, key) for m in models.factory_modules(cfg.model(g))),
                                     *(m for g in graphs(cfg, key) for m in roles.modules(cfg.model(g).samples))}),
    outs=lambda cfg, key: [stage.Out(paths.system(key).as_posix())],
    help="gate a face system end to end against the reference system (exit 1 = fail)")


def _refs(cfg: Config, picks: dict[str, str], root: Path) -> dict[str, dict]:
    """Each engine's and its validation's manifest refs; an engine that did not pass its own gate is refused."""
    out = {}
    for model, e in picks.items():
        v_man = manifest_path(paths.validation(e, root), e)
        if not v_man.is_file():
            raise KilnError(f"system: engine {e} has no validation", f"run it first: dvc repro "
                            f"{address(f'validate@{e}')}")
        verdict = read_verified(v_man, fast=True)["results"]["verdict"]
        if verdict != "pass":
            raise KilnError(f"system: engine {e} did not pass its own gate (validate@{e}: {verdict})",
                            "pin another engine in systems.<name>.engines, or fix that one")
        out[model] = {"engine": input_ref(f"engine:{model}", manifest_path(paths.engine(e, root), e), root),
                      "validation": input_ref(f"validation:{model}", v_man, root)}
    return out


def run(cfg: Config, name: str, root: Path = Path(".")) -> dict:
    """Gate system `name`; write system.json + verdict.json + manifest; return the verdict (GateFailed on fail)."""
    root = Path(root)
    picks = resolve(cfg, name)
    refs = _refs(cfg, picks, root)
    enrol = _enrolment(cfg, name, root)
    enrol_ref = input_ref("enrolment", manifest_path(enrol, enrol.name), root)
    runs = {}
    for label, make in (("reference", lambda: System.eager(cfg, root, name)),
                        ("system", lambda: System.from_picks(cfg, name, picks, root, system=name))):
        s = make()
        s.enroll(root)
        runs[label] = gate.run_photos(s, cfg, root)
    emb = cfg.model(cfg.system(name).embedder)
    metrics, decisions = gate.compare(runs["reference"], runs["system"], emb.verify_threshold, emb.metric)
    limits = cfg.system(name).gate
    failures = gate.gate(metrics, limits)
    verdict = "fail" if failures else "pass"
    described = {**gate.describe(cfg, name, picks, refs), "enrolment_xxh3_128": enrol_ref["xxh3_128"]}
    report = {"system": name, "verdict": verdict, "failures": failures, "metrics": metrics,
              "limits": described["gate"], "decisions": decisions}
    with atomic_dir(paths.system(name, root)) as d:
        write_json_atomic(d / paths.SYSTEM_FILE, described)
        write_json_atomic(d / paths.VERDICT_FILE, report)
        inputs = [r[k] for r in refs.values() for k in ("engine", "validation")] + [enrol_ref]
        inputs += samples.photo_inputs(cfg, root)
        inputs += [i for m in graphs(cfg, name) for i in source_inputs(cfg.model(m), root)]
        write_manifest(d, build_manifest(
            kind="system", name=name, directory=d, files=[d / paths.SYSTEM_FILE, d / paths.VERDICT_FILE],
            inputs=inputs, build={"gate": "end to end vs the reference system", "resolution": "pinned, else "
                                  "target/precision with FP32 fallback (no leaderboard: no host timings)"},
            results={"verdict": verdict, "failures": failures, "engines": picks}, **STAGE.identity(cfg, name, root)))
    if failures:
        raise GateFailed(f"system@{name}: " + "; ".join(failures),
                         f"the system's engines do not behave as the reference system on the photos; see "
                         f"{paths.system(name) / paths.VERDICT_FILE}")
    return report


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        r = run(args.cfg, args.key)
        m = r["metrics"]
        keys = ("faces_found", "box_iou_min", "identity_agreement", "decision_agreement", "decision_flips",
                "embedding_cosine_min", "pair_margin_min")
        print(f"system@{args.key}: PASS  " + "  ".join(f"{k} {m[k]:.7g}" for k in keys) +
              f"  ({m['pairs']} pairs; engines: {', '.join(sorted(set(resolve(args.cfg, args.key).values())))})")
        return 0

    return stage.main(STAGE, body, argv, key_help="system name from params.yaml `systems:`")


if __name__ == "__main__":
    sys.exit(main())
