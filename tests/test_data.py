"""Alignment and image sets: known-answer warps, determinism, clear errors for bad photos."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from pipeline.data import build_set, list_photos, load_rgb, load_set, save_set
from pipeline.errors import KilnError
from pipeline.models.align import align, chip_transform, fit_similarity


def test_fit_similarity_recovers_a_known_transform():
    src = np.array([[10, 20], [50, 22], [30, 40], [15, 60], [45, 61]], float)
    th, s, t = np.deg2rad(12), 1.7, np.array([5.0, -3.0])
    r = s * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    m = fit_similarity(src, src @ r.T + t)
    np.testing.assert_allclose(m, np.column_stack([r, t]), atol=1e-9)


def test_identity_landmarks_cut_the_top_left_crop():
    """Landmarks equal to the template mean 'the chip is the image's top-left S×S block', pixel for pixel."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (200, 240, 3), dtype=np.uint8)
    template = np.array([[46.4, 44.1], [100.9, 44.0], [73.3, 75.4], [49.3, 103.8], [101.4, 103.4]])
    chip = align(image, chip_transform(template, template)[None], 150)[0]
    np.testing.assert_allclose(chip, image[:150, :150], atol=0.01)  # float32 grid rounding; a 1 px shift is ~100


def _fixed_landmarker(rgb, path):
    h, w = rgb.shape[:2]
    return np.array([[0.35 * w, 0.4 * h], [0.65 * w, 0.4 * h], [0.5 * w, 0.55 * h], [0.38 * w, 0.7 * h],
                     [0.62 * w, 0.7 * h]])


def test_sets_are_deterministic_and_hashed(tmp_path, assets_dir, cfg):
    photos = list_photos(assets_dir / "photos")
    spec = dataclasses.replace(cfg.data.sets["golden"], per_photo=3)
    a = build_set(photos, _fixed_landmarker, cfg.data, spec)
    b = build_set(photos, _fixed_landmarker, cfg.data, spec)
    assert a.chips.shape == (len(photos) * 3, 150, 150, 3) and a.chips.dtype == np.uint8
    assert np.array_equal(a.chips, b.chips) and a.content_hash == b.content_hash
    assert a.identities == ("barack_obama", "emmanuel_macron", "jacinda_ardern", "rishi_sunak")
    other = build_set(photos, _fixed_landmarker, cfg.data, dataclasses.replace(spec, seed=spec.seed + 1))
    assert other.content_hash != a.content_hash and np.array_equal(other.chips[0], a.chips[0])  # chip 0 is plain
    files = save_set(a, tmp_path / "set")
    assert load_set(tmp_path / "set").content_hash == a.content_hash
    chips = np.load(files[0])
    chips[0, 0, 0, 0] ^= 1
    np.save(files[0], chips)
    with pytest.raises(KilnError, match="do not match the content hash"):
        load_set(tmp_path / "set")


def test_bad_photo_folders_and_files(tmp_path):
    with pytest.raises(KilnError, match="photo folder not found"):
        list_photos(tmp_path / "nope")
    (tmp_path / "alice").mkdir()
    with pytest.raises(KilnError, match="no images found"):
        list_photos(tmp_path)
    bad = tmp_path / "alice" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    assert list_photos(tmp_path)[0].identity == "alice"
    with pytest.raises(KilnError, match="broken.jpg: not a readable image"):
        load_rgb(bad)


@pytest.mark.parametrize("folder", ["obama\n  face 2: box [0, 0, 9, 9] score 1.000 → president", "unknown",
                                    "distractor", "bob\x1b[31m", "ann\u202e", ".hidden", "a" * 65, "Zoë"])
def test_an_identity_folder_that_is_not_an_identity_slug_is_refused_at_enrolment(tmp_path, folder):
    """Issue 44 item 4: identify prints identity names and a system release ships them, so each photo folder's name
    must be an identity slug — not a name with a newline (a forged `face` line), an escape sequence, a bidi
    character, a dot, 65 characters, or a word identify prints in its place — refused in one escaped line."""
    (tmp_path / "alice").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "alice" / "a.jpg")
    (tmp_path / folder).mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / folder / "b.jpg")
    with pytest.raises(KilnError, match="is not an identity name") as e:
        list_photos(tmp_path)
    assert e.value.message.isprintable() and len(e.value.message) < len(str(tmp_path)) + 120
    assert "letters, digits" in e.value.hint


def test_photo_without_a_face_stops_the_set(tmp_path, assets_dir, cfg):
    from pipeline.stages.dataset import mtcnn_landmarker

    (tmp_path / "wall").mkdir()
    Image.fromarray(np.full((200, 200, 3), 128, np.uint8)).save(tmp_path / "wall" / "grey.png")
    with pytest.raises(KilnError, match="grey.png: no face found"):
        weights = [assets_dir / "mtcnn" / f"{n}.pt" for n in ("pnet", "rnet", "onet")]
        build_set(list_photos(tmp_path), mtcnn_landmarker(weights, 40), cfg.data, cfg.data.sets["golden"])


def test_built_sets_separate_identities(built):
    """On the pinned photos, the golden chips (MTCNN-aligned) put every same-person pair under dlib's 0.6."""
    import json

    m = json.loads((built / "artifacts/golden/embedder/embedder.manifest.json").read_text())
    plain = m["results"]["plain_chips"]
    assert plain["same_l2_max"] < 0.6 < plain["diff_l2_min"], plain
