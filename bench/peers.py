"""What a user would run instead, on the same frames, beside Kiln's systems — the buyer's "faster than what I run now?".

Peers, each on the files Kiln builds from (the same pinned weights):
* OpenCV's own FaceDetectorYN + FaceRecognizerSF on the pinned YuNet and SFace files (what OpenCV Zoo's demo runs):
  detect at the frame's size, alignCrop, feature, cosine ≥ SFace's threshold (OpenCV 5.0 refuses the SFace file as
  shipped — 29 declared inputs nothing feeds — so it gets the file with those dropped, the same weights);
* dlib's own pipeline as face_recognition runs it: HOG detector with one upsample, the 5-point shape predictor, the
  ResNet descriptor (the weights Kiln's dlib embedder is converted from; num_jitters 1), L2 < 0.6.
Each peer enrols its gallery with its own pipeline on the pinned photos (one face a photo), as Kiln's systems enrol
theirs (the golden set's un-augmented chips of the same photos).

Frames: the sysbench@ frames (params.yaml sysbench.resolution, kiln_runtime/frames.py: the pinned photos alone and
in pairs) and one portrait at its own size. Timing: `--rounds` interleaved rounds (each runner runs every frame once
a round, runners in turn), ms per frame = p50 over rounds of the round's mean; one process, one frame at a time,
each runtime with the threads it is given (named). Per peer: faces found, identities per frame, and agreement with
the Kiln system that runs the same weights (same identities, `unknown` included, on every frame).

Usage (after `bash scripts/run.sh`): .venv/bin/python bench/peers.py [--rounds 7] [--systems a,b]; the OpenCV peer needs
SFace in params (`kiln profile yunet-sface`, then `bash scripts/run.sh` builds its systems to compare against).
Writes artifacts/reports/peers.json (`kiln report` shows it). Timings are one run on the host class named.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from pipeline import config, paths, tables
from pipeline.data import list_photos, load_rgb
from pipeline.errors import KilnError
from kiln_runtime import frames as frame_source
from kiln_runtime.host import host_class

if TYPE_CHECKING:
    from pipeline.config import Config


# ---------------------------------------------------------------------------------------------- peers
class OpenCVYuNetSFace:
    """OpenCV's FaceDetectorYN + FaceRecognizerSF on the pinned files."""

    weights = ("yunet", "sface")

    def __init__(self, cfg: Config, threads: int, root: Path = Path(".")):
        import tempfile

        import cv2
        import onnx

        from pipeline import onnx_import

        cv2.setNumThreads(threads)
        det = cfg.model("yunet")
        self.det = cv2.FaceDetectorYN.create(str(root / det.onnx.path), "", (320, 320), det.decode.score_threshold,
                                             det.decode.nms_threshold, det.decode.top_k)
        # OpenCV 5.0's DNN engine refuses the SFace file as shipped (29 declared inputs nothing feeds: "empty name can
        # only be used to set input if there is just one input"); its classic engine runs it but cannot run YuNet,
        # and the engine is chosen once a process. What a user does: drop the unfed inputs (onnx_import.runnable:
        # structural, the same weights and values) — then FaceRecognizerSF runs it.
        fixed, _ = onnx_import.runnable(onnx.load(str(root / cfg.model("sface").onnx.path)))
        with tempfile.TemporaryDirectory() as tmp:
            onnx.save(fixed, f"{tmp}/sface.onnx")
            self.rec = cv2.FaceRecognizerSF.create(f"{tmp}/sface.onnx", "")
        self.threshold = cfg.model("sface").verify_threshold
        self.name = f"OpenCV {cv2.__version__} FaceDetectorYN + FaceRecognizerSF"
        self.threads = f"cv2.setNumThreads({threads}) → {cv2.getNumThreads()}"
        self.gallery: tuple[np.ndarray, list[str]] | None = None

    def faces(self, rgb: np.ndarray) -> list[tuple[tuple[float, ...], np.ndarray]]:
        bgr = np.ascontiguousarray(rgb[:, :, ::-1])
        self.det.setInputSize((bgr.shape[1], bgr.shape[0]))
        _, found = self.det.detect(bgr)
        out = []
        for f in ([] if found is None else found):
            feat = self.rec.feature(self.rec.alignCrop(bgr, f)).ravel()
            out.append(((float(f[0]), float(f[1]), float(f[0] + f[2]), float(f[1] + f[3])),
                        feat / max(np.linalg.norm(feat), 1e-30)))
        return out

    def decide(self, emb: np.ndarray) -> str:
        sims = self.gallery[0] @ emb
        k = int(np.argmax(sims))
        return self.gallery[1][k] if sims[k] >= self.threshold else "unknown"


class DlibFaceRecognition:
    """dlib's pipeline as face_recognition runs it (HOG, upsample 1, 5-point shape, ResNet descriptor)."""

    weights = ("embedder",)

    def __init__(self, cfg: Config, threads: int, root: Path = Path(".")):
        import dlib

        from pipeline.assets import DLIB_DAT, DLIB_SHAPE5

        assets = root / cfg.assets.dir
        self.detector = dlib.get_frontal_face_detector()
        self.shape = dlib.shape_predictor(str(assets / DLIB_SHAPE5))
        self.rec = dlib.face_recognition_model_v1(str(assets / DLIB_DAT))
        self.threshold = cfg.model("embedder").verify_threshold
        self.name = f"dlib {dlib.__version__} (face_recognition's pipeline)"
        self.threads = "1 (dlib's HOG and descriptor run on the calling thread)"
        self.gallery = None

    def faces(self, rgb: np.ndarray):
        out = []
        for r in self.detector(rgb, 1):
            d = np.asarray(self.rec.compute_face_descriptor(rgb, self.shape(rgb, r), 1), np.float64)
            out.append(((float(r.left()), float(r.top()), float(r.right()), float(r.bottom())), d))
        return out

    def decide(self, emb: np.ndarray) -> str:
        d = np.linalg.norm(self.gallery[0] - emb[None], axis=1)
        k = int(np.argmin(d))
        return self.gallery[1][k] if d[k] < self.threshold else "unknown"


PEERS = (OpenCVYuNetSFace, DlibFaceRecognition)


def enrol(peer, photos) -> None:
    """The peer's gallery: its own pipeline on each pinned photo, the best (first) face."""
    emb, names = [], []
    for p in photos:
        found = peer.faces(load_rgb(p.path))
        if not found:
            raise KilnError(f"{peer.name} finds no face on {p.path}", "the peer cannot enrol the pinned photos")
        emb.append(found[0][1])
        names.append(p.identity)
    peer.gallery = (np.stack(emb), names)


# ---------------------------------------------------------------------------------------------- Kiln's systems
def kiln_systems(cfg: Config, wanted: list[str] | None):
    from pipeline.e2e import System, resolve

    out = []
    for name in wanted or list(cfg.systems):
        picks = resolve(cfg, name)
        if not all(paths.engine(e).is_dir() for e in picks.values()):
            print(f"peers: system {name} not built here (dvc repro builds it); left out", file=sys.stderr)
            continue
        s = System.from_picks(cfg, name, picks, system=name)
        s.enroll()
        out.append(s)
    return out


def weights_of(cfg: Config, system: str) -> set[str]:
    spec = cfg.system(system)
    return {spec.detector, spec.embedder}


# ---------------------------------------------------------------------------------------------- timing
def identities(run, frame) -> list[str]:
    return sorted(run(frame))


def measure(runners: dict[str, Callable], frames: list[np.ndarray], rounds: int) -> dict[str, list[float]]:
    """Per runner, each round's mean ms per frame; runners take turns within a round (interleaved)."""
    ms = {n: [] for n in runners}
    for _ in range(rounds):
        for n, run in runners.items():
            t0 = time.perf_counter()
            for f in frames:
                run(f)
            ms[n].append((time.perf_counter() - t0) * 1e3 / len(frames))
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2, help="threads given to OpenCV (Kiln's engines: as compiled)")
    ap.add_argument("--systems", help="comma-separated params.yaml systems (default: every built one)")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default=str(paths.reports(Path(".")) / "peers.json"))
    args = ap.parse_args(argv)
    try:
        cfg = config.load(Path(args.params))
        photos = list_photos(Path(cfg.data.photos))
        rgb = [load_rgb(p.path) for p in photos]
        sets = {"sysbench frames": frame_source.frames(rgb, tuple(cfg.sysbench.resolution)),
                "portrait": [rgb[[p.path.stem for p in photos].index("person_b_1")]]}
        systems = kiln_systems(cfg, args.systems.split(",") if args.systems else None)
        peers = []
        for cls in PEERS:
            if missing := [m for m in cls.weights if m not in cfg.models]:
                print(f"peers: {cls.__doc__.splitlines()[0]} left out: params.yaml has no {', '.join(missing)} "
                      "(kiln profile yunet-sface adds SFace)", file=sys.stderr)
                continue
            peer = cls(cfg, args.threads)
            enrol(peer, photos)
            peers.append(peer)
    except KilnError as e:
        print(f"kiln: error: {e.message} (hint: {e.hint})", file=sys.stderr)
        return 2
    runners = {s.system: (lambda s: lambda f: [m.identity for m in s.identify(f)])(s) for s in systems}
    runners.update({p.name: (lambda p: lambda f: [p.decide(e) for _, e in p.faces(f)])(p) for p in peers})
    result = {"host_class": host_class(), "cpu": platform.processor() or platform.machine(), "rounds": args.rounds,
              "frames_sha256": frame_source.digest(sets["sysbench frames"]), "sets": {}, "peers": {}, "systems": {}}
    for p in peers:
        result["peers"][p.name] = {"threads": p.threads, "same_weights_as": sorted(
            s.system for s in systems if weights_of(cfg, s.system) >= set(p.weights))}
    for s in systems:
        result["systems"][s.system] = {"engines": dict(s.engines), "threads": dict(s.threads_used)}
    for set_name, fr in sets.items():
        for run in runners.values():                      # warm every runner (first-call allocations) untimed
            run(fr[0])
        ms = measure(runners, fr, args.rounds)
        ids = {n: [identities(run, f) for f in fr] for n, run in runners.items()}
        rows = {}
        for n in runners:
            rows[n] = {"ms_per_frame_p50": round(statistics.median(ms[n]), 3),
                       "ms_rounds": [round(v, 3) for v in ms[n]],
                       "faces": sum(len(i) for i in ids[n]), "identities": ids[n]}
        for p in peers:
            for sys_name in result["peers"][p.name]["same_weights_as"]:
                same = sum(a == b for a, b in zip(ids[p.name], ids[sys_name]))
                rows[p.name].setdefault("agreement", {})[sys_name] = f"{same}/{len(fr)}"
                rows[sys_name].setdefault("vs_peer", {})[p.name] = round(
                    rows[p.name]["ms_per_frame_p50"] / rows[sys_name]["ms_per_frame_p50"], 2)
        result["sets"][set_name] = {"frames": len(fr), "rows": rows}
        print(f"\n{set_name}: {len(fr)} frame(s), p50 of {args.rounds} interleaved rounds, host class "
              f"{result['host_class']}")
        print(tables.markdown(["runner", "ms/frame p50", "faces", "peer ms ÷ Kiln ms", "agreement with Kiln"], [
            [n, r["ms_per_frame_p50"], r["faces"],
             ", ".join(f"{k}: {v:.2f}×" for k, v in r.get("vs_peer", {}).items()) or "—",
             ", ".join(f"{k}: {v}" for k, v in r.get("agreement", {}).items()) or "—"] for n, r in rows.items()]))
    for p in peers:
        print(f"{p.name}: threads {p.threads}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(out)
    print(f"peers: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
