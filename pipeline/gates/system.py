"""system@'s gate: a face system (params.yaml `systems:`) run end to end on its built engines, against the same system
made of the reference graphs (`System.eager`: PyTorch modules, or an ONNX-delivered model's original file on ONNX
Runtime), on the pinned photos (data.photos, what golden@ reads).

Per photo both systems detect, align, embed and match against their own enrolment of the golden set's un-augmented
chips; each reference face is paired with the system face of best box IoU (a pair needs IoU ≥ MATCH_IOU). Then:

* faces: `box_iou_min` over the paired faces, `faces_missed` (reference faces without a pair), `faces_extra`;
* identities: the name or `unknown` each paired face gets, equal to the reference's — with the whole gallery, and
  leave-one-out (the photo's own enrolment left out, so a one-photo identity must come out `unknown`):
  `identity_agreement` is the lower of the two;
* decisions: same/different at the embedder's verify_threshold for every pair of paired faces, across photos
  (`decision_agreement`, `decision_flips`), with each pair's two distances, unrounded (verdict.json `decisions`).

The limits are `systems.<name>.gate` (pipeline/config.py SystemGate). The metrics are rounded to 7 digits; the
verdict is a function of the engines, the reference and the photos, never of the host's timings.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import paths, samples
from pipeline.data import list_photos, load_rgb, load_set
from pipeline.gates.detection import box_iou
from pipeline.gates.facemetrics import check
from pipeline.vectors import as_l2

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.e2e import System

MATCH_IOU = 0.5         # a system face is the reference face's when their boxes overlap at least this much
CHECKS = (("box_iou_min", ">=", "box_iou_min"), ("faces_missed", "<=", "faces_missed_max"),
          ("faces_extra", "<=", "faces_extra_max"), ("identity_agreement", ">=", "identity_agreement_min"),
          ("decision_agreement", ">=", "decision_agreement_min"))


def run_photos(system: System, cfg: Config, root: Path) -> list[tuple[str, list, list]]:
    """(photo, matches with the whole gallery, matches leave-one-out) per pinned photo; `system` is enrolled."""
    gset = load_set(paths.data_set(samples.chip_set(cfg, cfg.system(system.system).embedder, "golden"), root))
    enrolled = [s["photo"] for s in gset.index["samples"] if s["augmentation"] is None]
    photos_root = root / cfg.data.photos
    out = []
    for p in list_photos(photos_root):
        rel = p.path.relative_to(photos_root).as_posix()
        rgb = load_rgb(p.path)
        own = enrolled.index(rel) if rel in enrolled else None
        out.append((rel, system.identify(rgb), system.identify(rgb, exclude=own) if own is not None else None))
    return out


def _pair(ref: list, got: list) -> list[tuple[int, int | None, float]]:
    """Each reference face (best first) → the unpaired system face of best IoU, if ≥ MATCH_IOU."""
    used: set[int] = set()
    pairs = []
    for i, r in enumerate(ref):
        cands = [(box_iou(r.box, g.box), j) for j, g in enumerate(got) if j not in used]
        iou, j = max(cands, default=(0.0, None))
        if j is not None and iou >= MATCH_IOU:
            used.add(j)
            pairs.append((i, j, iou))
        else:
            pairs.append((i, None, iou))
    return pairs


def compare(ref_runs: list, got_runs: list, threshold: float, metric: str) -> tuple[dict, list[dict]]:
    """The metrics of a system's runs against the reference's, and every face pair's decisions."""
    ious, missed, extra, faces = [], 0, 0, []
    agree, agree_loo, loo_n, unknown_ref, unknown_got = 0, 0, 0, 0, 0
    for (photo, ref, ref_loo), (_, got, got_loo) in zip(ref_runs, got_runs):
        pairs = _pair(ref, got)
        missed += sum(j is None for _, j, _ in pairs)
        extra += len(got) - sum(j is not None for _, j, _ in pairs)
        for i, j, iou in pairs:
            if j is None:
                continue
            ious.append(iou)
            agree += ref[i].identity == got[j].identity
            faces.append((f"{photo}#{i}", ref[i].embedding, got[j].embedding))
            if ref_loo is not None and got_loo is not None:     # the same detector run: the same face order
                loo_n += 1
                agree_loo += ref_loo[i].identity == got_loo[j].identity
                unknown_ref += ref_loo[i].identity == "unknown"
                unknown_got += got_loo[j].identity == "unknown"
    n_ref = sum(len(r[1]) for r in ref_runs)
    decisions = []
    if faces:
        e_ref, thr = as_l2(np.stack([f[1] for f in faces]), threshold, metric)
        e_got, _ = as_l2(np.stack([f[2] for f in faces]), threshold, metric)
        cos = np.sum(e_ref * e_got, 1) / (np.linalg.norm(e_ref, axis=1) * np.linalg.norm(e_got, axis=1))
        for a in range(len(faces)):
            for b in range(a + 1, len(faces)):
                d_ref = float(np.linalg.norm(e_ref[a] - e_ref[b]))
                d_got = float(np.linalg.norm(e_got[a] - e_got[b]))
                decisions.append({"a": faces[a][0], "b": faces[b][0], "distance_ref": d_ref, "distance": d_got,
                                  "same_ref": bool(d_ref < thr), "same": bool(d_got < thr)})
    flips = sum(d["same_ref"] != d["same"] for d in decisions)
    full = agree / n_ref if n_ref else 0.0
    loo = agree_loo / loo_n if loo_n else full
    m = {"reference_faces": n_ref, "faces_found": sum(len(g[1]) for g in got_runs), "faces_missed": missed,
         "faces_extra": extra, "box_iou_min": min(ious, default=0.0),
         "identity_agreement": min(full, loo), "identity_agreement_full": full, "identity_agreement_loo": loo,
         "unknown_ref_loo": unknown_ref, "unknown_loo": unknown_got, "pairs": len(decisions),
         "decision_agreement": 1.0 - flips / len(decisions) if decisions else 1.0, "decision_flips": flips,
         "embedding_cosine_min": float(cos.min()) if faces else 0.0,
         "pair_distance_delta_max": max((abs(d["distance"] - d["distance_ref"]) for d in decisions), default=0.0),
         "pair_margin_min": min((abs(d["distance_ref"] - thr) for d in decisions), default=0.0)}
    return {k: round(v, 7) if isinstance(v, float) else v for k, v in m.items()}, decisions


def gate(metrics: dict, limits) -> list[str]:
    """Failure lines against `systems.<name>.gate` (a SystemGate)."""
    return check(metrics, CHECKS, asdict(limits))


def describe(cfg: Config, name: str, picks: dict[str, str], refs: dict[str, dict]) -> dict:
    """system.json: what the system is — its engines by name and identity digest, its matching, and how it runs
    (pipeline/e2e.py `described`: detector settings, embedder, thresholds, preprocessing — what kiln_runtime reads
    back to run it) (`refs`: model → the engine's and its validation's manifest refs)."""
    from pipeline.e2e import described

    spec = cfg.system(name)
    return {
        "system": name, **described(cfg, name, "aligner" in picks),
        "engines": {m: {"engine": e, "target": cfg.engine(e).target, "precision": cfg.engine(e).precision,
                        "pinned": m in spec.engines, "xxh3_128": refs[m]["engine"]["xxh3_128"],
                        "validation_xxh3_128": refs[m]["validation"]["xxh3_128"]} for m, e in picks.items()},
        "matching": {"gallery": samples.chip_set(cfg, spec.embedder, "golden") + " (un-augmented chips)",
                     "search": "brute force", "index": None},
        "gate": asdict(spec.gate), "match_iou": MATCH_IOU,
    }
