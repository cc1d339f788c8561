"""The frames a load test feeds: made of photos (sysbench@: the pinned ones), the same for every run, every host,
every stream.

Each distinct frame is a `resolution` canvas (mid grey) holding either one photo, letterboxed to the canvas, or two
photos side by side, each letterboxed to one half — so frames carry one or two faces at the sizes a camera at that
resolution sees. Resizing is PIL's bilinear on 8-bit pixels (integer arithmetic). Stream `s` shows frame
`(k + 7·s) mod n` at its k-th tick, so concurrent streams are never in lock-step on the same picture.
"""

from __future__ import annotations

import hashlib
import numpy as np

GREY = 127
STREAM_OFFSET = 7


def _letterbox(rgb: np.ndarray, w: int, h: int) -> np.ndarray:
    from PIL import Image

    ph, pw = rgb.shape[:2]
    k = min(w / pw, h / ph)
    nw, nh = max(1, round(pw * k)), max(1, round(ph * k))
    out = np.full((h, w, 3), GREY, np.uint8)
    small = np.asarray(Image.fromarray(rgb).resize((nw, nh), Image.BILINEAR))
    y, x = (h - nh) // 2, (w - nw) // 2
    out[y:y + nh, x:x + nw] = small
    return out


def frames(photos: list[np.ndarray], resolution: tuple[int, int]) -> list[np.ndarray]:
    """The distinct frames, in order: each photo alone, then each consecutive pair side by side."""
    w, h = resolution
    if not photos:
        raise ValueError("no photos to make frames of")
    out = [_letterbox(p, w, h) for p in photos]
    for a, b in zip(photos, photos[1:]):
        out.append(np.concatenate([_letterbox(a, w // 2, h), _letterbox(b, w - w // 2, h)], axis=1))
    return [np.ascontiguousarray(f) for f in out]


def pick(n_frames: int, stream: int, tick: int) -> int:
    """Which frame stream `stream` shows at its `tick`-th frame."""
    return (tick + STREAM_OFFSET * stream) % n_frames


def digest(frame_list: list[np.ndarray]) -> str:
    """sha256 over every frame's shape and bytes: what the load test fed, in its record."""
    h = hashlib.sha256()
    for f in frame_list:
        h.update(repr(f.shape).encode())
        h.update(f.tobytes())
    return h.hexdigest()
