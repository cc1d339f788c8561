"""Detector gate metrics: an engine's faces against the reference's — MTCNN nets swapped into the PyTorch cascade,
a single-shot detector (RetinaFace, or any declared head) decoded beside its ORT reference — and face / non-face
decisions on skimage's lfw_subset."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln_runtime.mtcnn import box_iou  # noqa: F401 — the one pairing rule (system@, the shadow rollout)
from pipeline import paths
from pipeline.roles import inputs

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.roles.mtcnn import MtcnnNet
    from pipeline.roles.retinaface import RetinaFace
    from pipeline.roles.singleshot import SingleShot


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


def detector_metrics(cfg: Config, net: str, runner, root: Path, role: MtcnnNet) -> dict[str, float]:
    """Swap this net's engine into the reference (PyTorch) cascade: do the same faces come out? `role`: the net's
    (pipeline/roles/mtcnn.py): its place in the cascade and its crop size."""
    from pipeline.data import list_photos, load_rgb
    from pipeline.models import mtcnn

    nets = mtcnn.load_nets(*(root / w for w in inputs.reference_weights(cfg)))
    reference = [mtcnn.torch_runner(n) for n in nets]
    engine = list(reference)
    k = role.index
    engine[k] = lambda x: tuple(runner.run_all({"input": x}))
    det_cfg = mtcnn.DetectorConfig(min_face_size=cfg.data.min_face_size)
    ious, errs, count_diff, faces = [], [], 0, 0
    for photo in list_photos(root / cfg.data.photos):
        rgb = load_rgb(photo.path)
        ref, got = mtcnn.detect(rgb, *reference, det_cfg), mtcnn.detect(rgb, *engine, det_cfg)
        count_diff += len(ref) != len(got)
        for f in ref:
            faces += 1
            best = max(got, key=lambda g: box_iou(f.box, g.box), default=None)
            ious.append(box_iou(f.box, best.box) if best else 0.0)
            if best is not None:
                eye = np.linalg.norm(f.landmarks[0] - f.landmarks[1])
                errs.append(float(np.linalg.norm(best.landmarks - f.landmarks, axis=1).max() / eye))
    m = {"reference_faces": faces, "photos_with_other_face_count": count_diff,
         "box_iou_min": float(min(ious, default=0.0)), "landmark_err_max": float(max(errs, default=1.0)),
         "face_agreement": 1.0}
    if role.crop_fed:
        x, _ = lfw_crops(role.crop)
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
        best = max(got, key=lambda g: box_iou(f.box, g.box), default=None)
        ious.append(box_iou(f.box, best.box) if best else 0.0)
        if best is not None:
            eye = np.linalg.norm(f.landmarks[0] - f.landmarks[1])
            errs.append(float(np.linalg.norm(best.landmarks - f.landmarks, axis=1).max() / eye))
            score_d.append(abs(best.score - f.score))


def retinaface_metrics(cfg: Config, model: str, runner, root: Path, role: RetinaFace) -> dict[str, float]:
    """A single-shot detector: the engine's decoded faces vs the reference's (golden@: ORT on the original) on
    every photo, and face / non-face decisions on skimage's lfw_subset against the reference run on the same."""
    from pipeline import onnx_import
    from kiln_runtime import retinaface
    from pipeline.gates.reference import load_reference

    mcfg = cfg.model(model)          # config.py: a retinaface model has an ONNX source (its reference is ORT)
    d = mcfg.decode           # RetinaFace's own decode: its thresholds only
    dcfg = retinaface.DecodeConfig() if d is None else \
        retinaface.DecodeConfig(score_threshold=d.score_threshold, nms_threshold=d.nms_threshold)
    _, reference = load_reference(paths.golden(model, root))
    ious, errs, score_d, count_diff, faces = [], [], [], 0, 0
    for feed, ref in zip(role.feeds(cfg, model, "golden", root, inputs.CHIP_BATCH), reference):
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


def singleshot_metrics(cfg: Config, model: str, runner, root: Path, role: SingleShot) -> dict[str, float]:
    """A declared single-shot detector (kiln_runtime/singleshot.py): as `retinaface_metrics`, its outputs read by
    name (golden@'s reference names, the engine runner's `output_names`); lfw crops at LFW_RETINAFACE px, decided by
    the best prior's score against the declared threshold."""
    from pipeline import onnx_import
    from pipeline.gates.reference import load_reference
    from kiln_runtime import singleshot

    mcfg = cfg.model(model)
    d = mcfg.decode.runtime()
    names, reference = load_reference(paths.golden(model, root))
    got_names = list(getattr(runner, "output_names", None) or names)
    ious, errs, score_d, count_diff, faces = [], [], [], 0, 0
    for feed, ref in zip(role.feeds(cfg, model, "golden", root, inputs.CHIP_BATCH), reference):
        h, w = feed["input"].shape[2:]
        f_ref = singleshot.decode(dict(zip(names, ref)), h, w, d)
        f_got = singleshot.decode(dict(zip(got_names, runner.run_all(feed))), h, w, d)
        count_diff += len(f_ref) != len(f_got)
        faces += len(f_ref)
        _match(f_ref, f_got, ious, errs, score_d)
    x, _ = lfw_crops(LFW_RETINAFACE, lambda rgb: singleshot.preprocess(rgb, d)[0])
    run_ref, ref_names = onnx_import.reference_session(onnx_import.load_source(mcfg, root), mcfg.layout,
                                                       mcfg.dynamic.get("input", ()))
    p_ref = singleshot.scores(dict(zip(ref_names, run_ref({"input": x}))), d).max(1) > d.score_threshold
    p_got = np.concatenate([singleshot.scores(dict(zip(got_names, runner.run_all({"input": x[i:i + 1]}))), d)
                            for i in range(len(x))]).max(1) > d.score_threshold
    return {"reference_faces": faces, "photos_with_other_face_count": count_diff,
            "box_iou_min": float(min(ious, default=0.0)), "landmark_err_max": float(max(errs, default=1.0)),
            "score_delta_max": float(max(score_d, default=1.0)), "face_agreement": float((p_ref == p_got).mean()),
            "lfw_faces_found": int(p_got[:100].sum()), "lfw_nonfaces_accepted": int(p_got[100:].sum())}
