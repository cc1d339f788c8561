"""kiln_runtime/images.py as the service decodes a request body: the pixel cap from the header, before a pixel is
decoded; only the wire formats' plugins ever parse network bytes (reliability round 5, item 4)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import GifImagePlugin, Image, ImageFile, TiffImagePlugin

from kiln_runtime.errors import KilnError
from kiln_runtime.images import WIRE_MAX_PIXELS, TooLarge, decode_bytes, load_rgb


def _encoded(fmt: str, size=(64, 48), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, fmt)
    return buf.getvalue()


def test_a_bomb_is_refused_from_its_header_before_a_pixel_is_decoded(monkeypatch):
    """A 79 kB PNG declaring 9000×9000 (81 MP: under the CLI's 100 MP cap, it cost a worker 4.45 s to decode) is
    refused at the service's cap without Pillow ever loading its pixels."""
    bomb = _encoded("PNG", (9000, 9000), "L")
    assert len(bomb) < 100_000

    def never(self, *a, **k):
        raise AssertionError("pixels were decoded")

    with monkeypatch.context() as mp:
        mp.setattr(ImageFile.ImageFile, "load", never)
        with pytest.raises(TooLarge, match=r"request body: 9000×9000 pixels is too large \(limit 16.8 MP\)"):
            decode_bytes(bomb, "request body", max_pixels=WIRE_MAX_PIXELS)
    assert decode_bytes(_encoded("PNG"), max_pixels=WIRE_MAX_PIXELS).shape == (48, 64, 3)


@pytest.mark.parametrize("fmt, plugin", [("GIF", GifImagePlugin.GifImageFile),
                                         ("TIFF", TiffImagePlugin.TiffImageFile)])
def test_only_the_wire_formats_parse_network_bytes(monkeypatch, fmt, plugin):
    """GIF and TIFF were decoded although the service lists JPEG, PNG, BMP and WebP: now refused, naming the format
    and the allowed ones, and their Pillow plugin never runs on the bytes."""
    data = _encoded(fmt)

    def never(self, *a, **k):
        raise AssertionError(f"the {fmt} plugin parsed network bytes")

    with monkeypatch.context() as mp:
        mp.setattr(plugin, "_open", never)
        with pytest.raises(KilnError, match=f"request body: an? {fmt} image; this service reads JPEG, PNG, BMP, "
                                            "WebP only") as e:
            decode_bytes(data, "request body")
    assert "JPEG, PNG, BMP, WebP" in e.value.hint
    for wire in ("JPEG", "PNG", "BMP", "WEBP"):
        assert decode_bytes(_encoded(wire)).shape == (48, 64, 3), wire
    with pytest.raises(KilnError, match=r"not a readable image \(not JPEG, PNG, BMP, WebP\)"):
        decode_bytes(b"\x00" * 64, "request body")


def test_a_file_still_reads_any_format_and_its_name_is_shown_escaped(tmp_path):
    """Files (the CLI, the build's photo sets) keep every format Pillow reads — 16-bit and float TIFFs are real
    inputs; a file name holding ESC / OSC 8 is shown escaped in the one error line (round 4's leftover)."""
    Image.fromarray(np.zeros((8, 8), np.uint16)).save(tmp_path / "g16.tif")
    assert load_rgb(tmp_path / "g16.tif").shape == (8, 8, 3)
    evil = tmp_path / "\x1b]8;;evil.example\x07photo\x1b]8;;\x07.jpg"
    with pytest.raises(KilnError) as e:
        load_rgb(evil)
    assert "\x1b" not in e.value.message and "\\x1b]8;;evil.example\\x07photo" in e.value.message
