"""validate@<engine>: a face-task gate against the golden embeddings, not a tensor tolerance.

Per-sample cosine (min/mean) and L2 (max) against the FP32 PyTorch reference; identity top-1 through the golden
gallery (the un-augmented chip of each photo) compared with the reference's top-1; same/different decisions at the
model's verification threshold for every pair of golden chips, and the change in true- and false-accept rates.
The verdict and every number are written either way, with a manifest (kind "validation") that binds them to the
engine's identity digest, so `kiln verify` covers the verdict and promotion can check it; a failing gate then exits
non-zero so the DAG stops. The engine is loaded only after its files verify (pipeline/engines.py).

An engine this host cannot run (a build-only target: tensorrt-rtx builds RTX-GPU plans on a CPU) gets the verdict
`not-run` with the reason — neither pass nor fail — and the stage succeeds; promotion then needs a passing
validation from a host with the runtime (`kiln validate-release`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, samples, stage, targets
from pipeline.gates.evaluate import NOT_RUN, Verdict
from pipeline.gates.verdict import judge
from pipeline.manifest import identity_digest, manifest_path, read_manifest
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config


def _deps(cfg: Config, key: str) -> list[str]:
    e = cfg.engine(key)
    return [paths.engine(key).as_posix(), paths.golden(e.model).as_posix(), *samples.deps(cfg, e.model, "golden")]


STAGE = stage.Stage(
    "validate", "pipeline.stages.validate", "face-task gate against the golden reference (exit 1 stops the DAG)",
    keys=lambda cfg: list(cfg.engines), deps=_deps,
    params=lambda cfg, key: ["validate", f"models.{cfg.engine(key).model}",
                             *samples.params(cfg, cfg.engine(key).model)],
    targets=lambda cfg, key: [cfg.engine(key).target],
    dynamic=lambda cfg, key: [targets.module(cfg.engine(key).target),
                              *roles.modules(cfg.model(cfg.engine(key).model).samples, gate=True)],
    outs=lambda cfg, key: [stage.Out(paths.validation(key).as_posix())],
    help="gate an engine on the face task against the golden reference (exit 1 = fail)")


def run(cfg: Config, engine_name: str, root: Path = Path(".")) -> Verdict:
    engine_dir = paths.engine(engine_name, root)
    mpath = manifest_path(engine_dir, engine_name)
    # its files are verified when it is loaded (a private copy, engines.py), or before a not-run verdict
    engine = {"role": "engine", "manifest": Path(os.path.relpath(mpath, root)).as_posix(),
              "xxh3_128": identity_digest(read_manifest(mpath))}
    return judge(cfg, engine_name, engine_dir, engine, paths.validation(engine_name, root), root, declaration=STAGE)


def main(argv: list[str] | None = None) -> int:
    from pipeline.errors import GateFailed

    def body(args, run_) -> int:
        v = run(args.cfg, args.key)
        if v.verdict == NOT_RUN:
            print(f"validate@{args.key}: NOT RUN — {v.reason}; registered as built-only until a host with the "
                  "runtime validates it (kiln validate-release)")
            return 0
        m = v.metrics
        keys = [k for k in ("cosine_min", "cosine_mean", "l2_max", "top1_agreement", "decision_agreement",
                            "tar_delta", "far_delta", "box_iou_min", "landmark_err_max", "face_agreement",
                            "pixel_mae", "pixel_max_abs") if k in m]
        print(f"validate@{args.key}: {'PASS' if v.passed else 'FAIL'}  " +
              "  ".join(f"{k} {m[k]:.5g}" for k in keys))
        if not v.passed:
            raise GateFailed(f"validate@{args.key}: " + "; ".join(v.failures),
                             "the engine is not equivalent to the reference on the face task; see validation.json")
        return 0

    return stage.main(STAGE, body, argv, key_help="engine name from params.yaml `engines:`")


if __name__ == "__main__":
    sys.exit(main())
