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
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline import engines, facemetrics, paths, samples, stage, targets
from pipeline.config import ValidateConfig
from pipeline.data import load_set
from pipeline.errors import KilnError
from pipeline.facemetrics import face_metrics
from pipeline.manifest import (atomic_dir, build_manifest, identity_digest, input_ref, manifest_path, read_manifest,
                               read_verified, write_json_atomic, write_manifest)

BATCH = 8
# The gate's key metric per sample kind — (metric, +1 when higher is better): what ranks candidate models that
# all pass or all fail the gate (calibrate@'s choice of method, `kiln mixed`'s sensitivity ranking).
KEY_METRIC = {"chips": ("cosine_min", 1), "aligner": ("pixel_mae", -1), "pnet": ("box_iou_min", 1),
              "rnet": ("box_iou_min", 1), "onet": ("box_iou_min", 1), "retinaface": ("box_iou_min", 1)}


class OnnxRunner:
    """An ONNX file on ONNX Runtime's CPU kernels, with the runner interface `evaluate_model` calls: how a candidate
    model that is not an engine yet (a calibration, a float set) is judged, as the ort-cpu engine would run it."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.session.get_inputs()[0].name: x})[0]

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, feed)


def _deps(cfg, key: str) -> list[str]:
    e = cfg.engine(key)
    return [paths.engine(key).as_posix(), paths.golden(e.model).as_posix(), *samples.deps(cfg, e.model, "golden")]


STAGE = stage.Stage(
    "validate", "pipeline.stages.validate", "face-task gate against the golden reference (exit 1 stops the DAG)",
    keys=lambda cfg: list(cfg.engines), deps=_deps,
    params=lambda cfg, key: ["validate", f"models.{cfg.engine(key).model}",
                             *samples.params(cfg, cfg.engine(key).model)],
    targets=lambda cfg, key: [cfg.engine(key).target],
    dynamic=lambda cfg, key: [targets.module(cfg.engine(key).target)],
    outs=lambda cfg, key: [stage.Out(paths.validation(key).as_posix())])


NOT_RUN = "not-run"


@dataclass(frozen=True)
class Verdict:
    engine: str
    passed: bool
    metrics: dict[str, float]
    failures: list[str]
    verdict: str = "pass"          # pass | fail | not-run
    reason: str = ""               # why not run


def gate(m: dict[str, float], v: ValidateConfig) -> list[str]:
    return facemetrics.gate(m, asdict(v))


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def lfw_crops(size: int, preprocess=None) -> tuple[np.ndarray, np.ndarray]:
    """skimage's lfw_subset (100 faces, then 100 non-faces, 25×25 grey) as RGB net inputs: MTCNN-normalised, or
    by `preprocess` (one RGB image → (1, 3, H, W))."""
    from PIL import Image
    from skimage import data as skdata

    from pipeline.models import mtcnn

    imgs = skdata.lfw_subset()
    rgb = np.stack([np.asarray(Image.fromarray((im * 255).astype(np.uint8)).convert("RGB")
                               .resize((size, size), Image.BILINEAR)) for im in imgs])
    x = mtcnn.preprocess(rgb) if preprocess is None else np.concatenate([preprocess(r) for r in rgb])
    return x, np.r_[np.ones(100, bool), np.zeros(len(imgs) - 100, bool)]


def detector_metrics(cfg, net: str, runner, root: Path) -> dict[str, float]:
    """Swap this net's engine into the reference (PyTorch) cascade: do the same faces come out?"""
    from pipeline.data import list_photos, load_rgb
    from pipeline.models import mtcnn

    nets = mtcnn.load_nets(*(root / w for w in samples.reference_weights(cfg)))
    reference = [mtcnn.torch_runner(n) for n in nets]
    engine = list(reference)
    k = ("pnet", "rnet", "onet").index(net)
    engine[k] = lambda x: tuple(runner.run_all({"input": x}))
    det_cfg = mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)
    ious, errs, count_diff, faces = [], [], 0, 0
    for photo in list_photos(root / cfg.data.photos):
        rgb = load_rgb(photo.path)
        ref, got = mtcnn.detect(rgb, *reference, det_cfg), mtcnn.detect(rgb, *engine, det_cfg)
        count_diff += len(ref) != len(got)
        for f in ref:
            faces += 1
            best = max(got, key=lambda g: _iou(f.box, g.box), default=None)
            ious.append(_iou(f.box, best.box) if best else 0.0)
            if best is not None:
                eye = np.linalg.norm(f.landmarks[0] - f.landmarks[1])
                errs.append(float(np.linalg.norm(best.landmarks - f.landmarks, axis=1).max() / eye))
    m = {"reference_faces": faces, "photos_with_other_face_count": count_diff,
         "box_iou_min": float(min(ious, default=0.0)), "landmark_err_max": float(max(errs, default=1.0)),
         "face_agreement": 1.0}
    if net in ("rnet", "onet"):
        x, _ = lfw_crops(24 if net == "rnet" else 48)
        p_ref = reference[k](x)[-1][:, 1] > det_cfg.thresholds[k]
        p_got = engine[k](x)[-1][:, 1] > det_cfg.thresholds[k]
        m["face_agreement"] = float((p_ref == p_got).mean())
        m["lfw_faces_found"] = int(p_got[:100].sum())
        m["lfw_nonfaces_accepted"] = int(p_got[100:].sum())
    return m


LFW_RETINAFACE = 128       # lfw_subset's 25×25 crops upscaled to this (RetinaFace's smallest anchor is 16 px)


def _match(ref: list, got: list, ious: list, errs: list, score_d: list) -> None:
    """Every reference face matched with the engine face of best IoU: its IoU, landmark error, score change."""
    for f in ref:
        best = max(got, key=lambda g: _iou(f.box, g.box), default=None)
        ious.append(_iou(f.box, best.box) if best else 0.0)
        if best is not None:
            eye = np.linalg.norm(f.landmarks[0] - f.landmarks[1])
            errs.append(float(np.linalg.norm(best.landmarks - f.landmarks, axis=1).max() / eye))
            score_d.append(abs(best.score - f.score))


def retinaface_metrics(cfg, model: str, runner, root: Path) -> dict[str, float]:
    """A single-shot detector: the engine's decoded faces vs the reference's (golden@: ORT on the original) on
    every photo, and face / non-face decisions on skimage's lfw_subset against the reference run on the same."""
    from pipeline import onnx_import
    from pipeline.models import retinaface
    from pipeline.stages.golden import load_reference

    mcfg = cfg.model(model)          # config.py: a retinaface model has an ONNX source (its reference is ORT)
    dcfg = retinaface.DecodeConfig(**asdict(mcfg.decode)) if mcfg.decode else retinaface.DecodeConfig()
    _, reference = load_reference(paths.golden(model, root))
    ious, errs, score_d, count_diff, faces = [], [], [], 0, 0
    for feed, ref in zip(samples.feeds(cfg, model, "golden", root), reference):
        h, w = feed["input"].shape[2:]
        f_ref = retinaface.decode(*(r[0] for r in ref[:3]), h, w, dcfg)
        f_got = retinaface.decode(*(g[0] for g in list(runner.run_all(feed))[:3]), h, w, dcfg)
        count_diff += len(f_ref) != len(f_got)
        faces += len(f_ref)
        _match(f_ref, f_got, ious, errs, score_d)
    x, _ = lfw_crops(LFW_RETINAFACE, retinaface.preprocess)
    run_ref, _ = onnx_import.reference_session(onnx_import.load_source(mcfg, root), mcfg.layout)
    p_ref = run_ref({"input": x})[1][:, :, 1].max(1) > dcfg.score_threshold
    p_got = np.asarray(list(runner.run_all({"input": x}))[1])[:, :, 1].max(1) > dcfg.score_threshold
    return {"reference_faces": faces, "photos_with_other_face_count": count_diff,
            "box_iou_min": float(min(ious, default=0.0)), "landmark_err_max": float(max(errs, default=1.0)),
            "score_delta_max": float(max(score_d, default=1.0)), "face_agreement": float((p_ref == p_got).mean()),
            "lfw_faces_found": int(p_got[:100].sum()), "lfw_nonfaces_accepted": int(p_got[100:].sum())}


def aligner_metrics(cfg, model: str, runner, root: Path) -> dict[str, float]:
    from pipeline.stages.golden import load_reference

    _, reference = load_reference(paths.golden(model, root))
    diffs = [np.abs(runner.run_all(feed)[0] - ref[0]) for feed, ref in
             zip(samples.feeds(cfg, model, "golden", root), reference)]
    return {"pixel_mae": float(np.mean([d.mean() for d in diffs])), "pixel_max_abs": float(max(d.max() for d in diffs)),
            "chips": int(sum(len(d) for d in diffs))}


def gate_other(kind: str, m: dict[str, float], v: ValidateConfig) -> list[str]:
    if kind == "aligner":
        return facemetrics.check(m, [("pixel_mae", "<=", "pixel_mae_max"), ("pixel_max_abs", "<=", "pixel_max_abs_max")],
                                 asdict(v.aligner))
    return facemetrics.check(m, [("box_iou_min", ">=", "box_iou_min"), ("landmark_err_max", "<=", "landmark_err_max"),
                                 ("face_agreement", ">=", "face_agreement_min"),
                                 ("photos_with_other_face_count", "<=", "none")], {**asdict(v.detector), "none": 0})


def evaluate(cfg, engine_name: str, runner, root: Path = Path(".")) -> tuple[dict, list[str], dict, dict]:
    """(metrics, failures, limits, extra) of one engine's runner on its model's face-task gate."""
    return evaluate_model(cfg, cfg.engine(engine_name).model, runner, root)


def evaluate_model(cfg, model: str, runner, root: Path = Path(".")) -> tuple[dict, list[str], dict, dict]:
    """(metrics, failures, limits, extra) of a runner of `model` on the model's face-task gate."""
    mcfg = cfg.model(model)
    extra = {}
    if mcfg.samples == "chips":
        gset = load_set(paths.data_set(samples.chip_set(cfg, model, "golden"), root))
        ref = np.load(paths.golden(model, root) / "embeddings.npy", allow_pickle=False)
        x = samples.chip_input(mcfg, gset.chips)
        got = np.concatenate([runner.run(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
        gallery = np.array([s["augmentation"] is None for s in gset.index["samples"]])
        metrics = face_metrics(got, ref, gset.labels, np.flatnonzero(gallery), mcfg.verify_threshold, mcfg.metric)
        failures = gate(metrics, cfg.validate)
        limits = {k: v for k, v in cfg.section("validate").items() if k not in ("detector", "aligner")}
        extra["golden_set_xxh3_128"] = gset.content_hash
    elif mcfg.samples == "retinaface":
        metrics = retinaface_metrics(cfg, model, runner, root)
        failures, limits = gate_other("detector", metrics, cfg.validate), cfg.section("validate", "detector")
    elif mcfg.samples == "aligner":
        metrics = aligner_metrics(cfg, model, runner, root)
        failures, limits = gate_other("aligner", metrics, cfg.validate), cfg.section("validate", "aligner")
    else:
        metrics = detector_metrics(cfg, mcfg.samples, runner, root)
        failures, limits = gate_other("detector", metrics, cfg.validate), cfg.section("validate", "detector")
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not np.isfinite(v)]
    if bad:
        failures = failures + [f"{k} is not finite" for k in bad]
    return metrics, failures, limits, extra


def run(cfg, engine_name: str, root: Path = Path(".")) -> Verdict:
    engine_dir = paths.engine(engine_name, root)
    mpath = manifest_path(engine_dir, engine_name)
    # its files are verified when it is loaded (a private copy, engines.py), or before a not-run verdict
    engine = {"role": "engine", "manifest": Path(os.path.relpath(mpath, root)).as_posix(),
              "xxh3_128": identity_digest(read_manifest(mpath))}
    return judge(cfg, engine_name, engine_dir, engine, paths.validation(engine_name, root), root)


def judge(cfg, engine_name: str, engine_dir: Path, engine_ref: dict, out: Path, root: Path = Path(".")) -> Verdict:
    """Gate the engine in `engine_dir` (verified before it is loaded) and write validation.json + its manifest to
    `out`, atomically. `engine_ref` is how the manifest names the engine (a path here; a registry version when
    `kiln validate-release` judges a downloaded one). An engine this host cannot run gets `not-run`."""
    spec = cfg.engine(engine_name)
    golden_manifest = manifest_path(paths.golden(spec.model, root), spec.model)
    read_verified(golden_manifest, fast=True)
    mpath = manifest_path(engine_dir, engine_name)
    if identity_digest(read_manifest(mpath)) != engine_ref["xxh3_128"]:
        raise KilnError(f"{engine_dir}: not the engine {engine_ref.get('manifest')} names", "validate it again")
    runnable, why = targets.get(spec.target).runnable(engine_dir)
    if runnable:
        runner = engines.load(spec.target, engine_dir, engine_name)        # verifies the files it loads
        metrics, failures, limits, extra = evaluate(cfg, engine_name, runner, root)
        verdict = "fail" if failures else "pass"
    else:
        read_verified(mpath, fast=True)          # not loaded, but a not-run verdict is still about these bytes
        metrics, failures, limits, extra, verdict = {}, [], {}, {"not_run": why}, NOT_RUN
    metrics = {k: round(v, 7) if isinstance(v, float) else v for k, v in metrics.items()}
    report = {"engine": engine_name, "verdict": verdict, "failures": failures,
              "metrics": metrics, "limits": limits, "engine_manifest_xxh3_128": engine_ref["xxh3_128"], **extra}
    with atomic_dir(out) as d:
        write_json_atomic(d / paths.VALIDATION_FILE, report)
        inputs = [engine_ref, input_ref("golden", golden_manifest, root)]
        if cfg.model(spec.model).samples == "chips":
            inputs += samples.inputs(cfg, spec.model, "golden", root)
        write_manifest(d, build_manifest(
            kind="validation", name=engine_name, model=spec.model, target=spec.target, precision=spec.precision,
            directory=d, files=[d / paths.VALIDATION_FILE], inputs=inputs, build={"gate": "face-task"},
            results={"verdict": verdict, "failures": failures, **extra},
            **STAGE.identity(cfg, engine_name, root)))
    return Verdict(engine_name, verdict == "pass", metrics, failures, verdict, extra.get("not_run", ""))


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
