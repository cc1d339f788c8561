"""From an image to a face a gallery can hold: exactly one face, big and sure enough by the release's own detector
settings, its embedding, and a crop of it kept for a later re-embedding (a new embedder sees the face again).

The policy is read from the release (`policy`): a face at least twice the detector's smallest detectable face
(MTCNN's `min_face_size`, 40 px for a single-shot detector, which has none) and at least the detector's own final
score threshold. A photo with no face, several faces, or a face below the policy is refused naming why — an
enrolment is what every later decision compares with, so it is never guessed.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from kiln_runtime.errors import KilnError

CROP_MARGIN = 0.4                 # of the box's side, around it
CROP_SIDE = 256                   # the crop's longer side at most


@dataclass(frozen=True)
class Policy:
    min_side: float
    min_score: float


def policy(spec) -> Policy:
    """The enrolment policy of a system (its Spec: kiln_runtime/system.py)."""
    s = spec.settings
    if spec.detector == "mtcnn":
        return Policy(2.0 * float(s.min_face_size), float(s.thresholds[-1]))
    return Policy(40.0, float(getattr(s, "score_threshold", 0.5)))


class NotEnrolable(KilnError):
    """An image that cannot be enrolled: no face, several, or one below the policy (a 422 on the service)."""


EDGE = 0.1                        # of the face's side: a box further than this past the image's edge is cut off


def the_face(matches: list, pol: Policy, name: str = "the image", shape: tuple[int, int] | None = None):
    """The one face of `matches` (kiln_runtime.system.Match) fit to enrol or verify with, else NotEnrolable; with
    the image's (height, width), a face cut off by its edge is refused too."""
    if not matches:
        raise NotEnrolable(f"{name}: no face found", "send a photo with one face, frontal, at least "
                           f"{pol.min_side:.0f} px wide")
    if len(matches) > 1:
        raise NotEnrolable(f"{name}: {len(matches)} faces found; enrolment needs exactly one",
                           "crop the photo to the one person")
    m = matches[0]
    side = min(m.box[2] - m.box[0], m.box[3] - m.box[1])
    if side < pol.min_side:
        raise NotEnrolable(f"{name}: the face is {side:.0f} px; enrolment needs at least {pol.min_side:.0f} px",
                           "send a closer or larger photo")
    if m.score < pol.min_score:
        raise NotEnrolable(f"{name}: the face scores {m.score:.3f}; enrolment needs at least {pol.min_score:g}",
                           "send a sharper, frontal photo")
    if shape is not None:
        h, w = shape
        slack = EDGE * side
        if m.box[0] < -slack or m.box[1] < -slack or m.box[2] > w + slack or m.box[3] > h + slack:
            raise NotEnrolable(f"{name}: the face is cut off by the image's edge", "send a photo with the whole "
                               "face in it")
    return m


def crop(rgb: np.ndarray, box, landmarks) -> tuple[bytes, list[list[float]]]:
    """The face with a margin, at most CROP_SIDE px, as PNG bytes (deterministic), and the landmarks in its
    coordinates — enough to align it again for any chip geometry."""
    from PIL import Image

    h, w = rgb.shape[:2]
    x0, y0, x1, y1 = (float(v) for v in box)
    pad = CROP_MARGIN * max(x1 - x0, y1 - y0)
    left, top = int(max(0, np.floor(x0 - pad))), int(max(0, np.floor(y0 - pad)))
    right, bottom = int(min(w, np.ceil(x1 + pad))), int(min(h, np.ceil(y1 + pad)))
    im = Image.fromarray(np.ascontiguousarray(rgb[top:bottom, left:right]))
    scale = min(1.0, CROP_SIDE / max(im.size))
    if scale < 1.0:
        im = im.resize((max(1, round(im.size[0] * scale)), max(1, round(im.size[1] * scale))), Image.Resampling.BOX)
    buf = io.BytesIO()
    im.save(buf, "PNG", optimize=False)
    marks = [] if landmarks is None else [[round((float(x) - left) * scale, 3), round((float(y) - top) * scale, 3)]
                                          for x, y in np.asarray(landmarks)]
    return buf.getvalue(), marks


__all__ = ["CROP_SIDE", "NotEnrolable", "Policy", "crop", "policy", "the_face"]
