"""Photos as a face system reads them: a regular file (never a FIFO or device, checked on the open descriptor), or
bytes posted to `kiln-run serve`, decoded to HWC uint8 RGB with EXIF orientation applied, the longest side at most
MAX_SIDE (downscaled deterministically, JPEG by its decoder), 16-bit and float images scaled to 8 bits, anything past
MAX_PIXELS refused from its header, before it is decoded (decompression bombs). The build's image sets decode with
these same functions (pipeline/data.py), so a deployment host sees the pixels the gates saw.

Bytes from the network (`decode_bytes`) are read only in the formats a camera sends — WIRE_FORMATS: JPEG, PNG, BMP,
WebP — so no other Pillow plugin (GIF, TIFF, PSD, …) ever parses a request; the service also sets its own, lower
pixel cap (`kiln-run serve --max-pixels`). A file (`load_rgb`) may be any image Pillow reads (16-bit and float TIFFs
among them)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from kiln_runtime.errors import KilnError
from kiln_runtime.files import open_regular
from kiln_runtime.text import shown


MAX_SIDE = 4096                 # larger photos are downscaled on decode (JPEG: by the decoder itself)
MAX_PIXELS = 100_000_000        # beyond this a photo is refused before it is decoded (decompression bombs)
WIRE_FORMATS = ("JPEG", "PNG", "BMP", "WEBP")      # what `decode_bytes` reads (Pillow's format names)
WIRE_MAX_PIXELS = 4096 * 4096   # `kiln-run serve`'s default cap: a 4K UHD camera frame is 8.3 MP


class TooLarge(KilnError):
    """An image past the pixel cap, refused from its header."""


def _eight_bit(im: Image.Image, path: Path) -> Image.Image:
    """16-bit and float grey images as 8-bit levels, which convert("RGB") gets wrong (it clips 16-bit to white and
    truncates float 0..1 to black). 16-bit: / 257 (65535 → 255). Float: values in [0, 1] are scaled by 255, values
    in [0, 255] are levels as they are; any other range has no meaning Kiln can assume, so it is refused."""
    if im.mode.startswith("I;16"):          # 16-bit grey (PNG, TIFF); 16-bit colour decodes to 8-bit RGB itself
        return Image.fromarray(((np.asarray(im, np.uint32) + 128) // 257).astype(np.uint8), "L")   # rint(x / 257)
    if im.mode == "F":
        a = np.asarray(im, np.float32)
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if not (np.isfinite(a).all() and lo >= 0 and hi <= 255):
            raise KilnError(f"{shown(path, 500)}: a float image with values in [{lo:.4g}, {hi:.4g}]; Kiln reads float "
                            "images in [0, 1] or [0, 255]", "convert it to an 8-bit image (JPEG or PNG)")
        return Image.fromarray(np.rint(a * (255 if hi <= 1 else 1)).astype(np.uint8), "L")
    if im.mode == "I":
        raise KilnError(f"{shown(path, 500)}: a 32-bit integer image has no brightness range Kiln can assume",
                        "convert it to an 8-bit (or 16-bit PNG) image")
    return im


def load_rgb(path: Path, max_side: int = MAX_SIDE) -> np.ndarray:
    """An image file as HWC uint8 RGB, EXIF orientation applied, longest side at most `max_side` (downscaled
    deterministically); 16-bit and float images scaled to 8 bits (`_eight_bit`). A corrupt, non-image, non-regular
    (a FIFO would hang the read) or oversized file is a KilnError naming the file."""
    Image.MAX_IMAGE_PIXELS = MAX_PIXELS  # PIL raises DecompressionBombError past 2x this: refuse earlier, below
    try:
        with open_regular(path, "pass an image file; supported: JPEG, PNG, BMP, WebP") as f:
            return _decode(f, path, max_side)
    except KilnError:
        raise
    except Image.DecompressionBombError as e:      # PIL's own refusal, beyond twice the limit: header only
        raise TooLarge(f"{shown(path, 500)}: too large ({e})".replace(" could be decompression bomb DOS attack.", ""),
                        f"downscale it (longest side ≤ {max_side} is plenty for face detection)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise KilnError(f"{shown(path, 500)}: not a readable image ({e.__class__.__name__}: {str(e)[:200]})",
                        "replace or remove the file; supported: JPEG, PNG, BMP, WebP") from None


def _decode(f, path: Path, max_side: int, max_pixels: int = MAX_PIXELS, formats: tuple[str, ...] | None = None
            ) -> np.ndarray:
    with Image.open(f, formats=formats) as im:
        w, h = im.size
        if w * h > max_pixels:                       # from the header: not a pixel decoded yet
            raise TooLarge(f"{shown(path, 500)}: {w}×{h} pixels is too large (limit {_megapixels(max_pixels)})",
                            f"downscale it (longest side ≤ {max_side} is plenty for face detection)")
        if max(w, h) > max_side:   # JPEG decodes at 1/2, 1/4 or 1/8 to a size in [max_side/2, max_side]:
            im.draft("RGB", (max_side // 2, max_side // 2))  # never a full-size buffer
        im = _eight_bit(ImageOps.exif_transpose(im), path).convert("RGB")
        if max(im.size) > max_side:
            im.thumbnail((max_side, max_side), Image.Resampling.BOX)
        return np.asarray(im)


def _megapixels(n: int) -> str:
    return f"{n / 1e6:.3g} MP" if n >= 100_000 else f"{n} pixels"


_MAGIC = ((b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"8BPS", "PSD"),
          (b"\x00\x00\x01\x00", "ICO"), (b"%PDF", "PDF"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
          (b"\xffO\xffQ", "JPEG 2000"), (b"DDS ", "DDS"), (b"icns", "ICNS"), (b"qoif", "QOI"), (b"\x0a", "PCX"))


def sniffed(data: bytes) -> str | None:
    """A format outside the wire formats, named from its first bytes by Kiln itself (no Pillow plugin reads it)."""
    return next((name for magic, name in _MAGIC if data.startswith(magic)), None)


def decode_bytes(data: bytes, name: str = "image", max_side: int = MAX_SIDE, max_pixels: int = MAX_PIXELS,
                 formats: tuple[str, ...] = WIRE_FORMATS) -> np.ndarray:
    """Image bytes (an HTTP body) as `load_rgb` reads a file, in one of `formats` only and refused from the header
    past `max_pixels`: a KilnError naming `name` for anything else."""
    Image.MAX_IMAGE_PIXELS = MAX_PIXELS
    try:
        return _decode(io.BytesIO(data), Path(name), max_side, max_pixels, formats)
    except KilnError:
        raise
    except UnidentifiedImageError:
        got = sniffed(data)
        allowed = ", ".join("WebP" if f == "WEBP" else f for f in formats)
        if got:
            raise KilnError(f"{name}: {'an' if got[0] in 'AEIOU' else 'a'} {got} image; this service reads {allowed} "
                            "only",
                            f"send the image as {allowed}") from None
        raise KilnError(f"{name}: not a readable image (not {allowed})", f"send a {allowed} image") from None
    except Image.DecompressionBombError as e:
        raise TooLarge(f"{name}: too large ({e})".replace(" could be decompression bomb DOS attack.", ""),
                        f"downscale it (longest side ≤ {max_side} is plenty for face detection)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        why = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))[:200]     # no object reprs
        raise KilnError(f"{name}: not a readable image ({e.__class__.__name__}: {why})",
                        "send a JPEG, PNG, BMP or WebP image") from None


__all__ = ["MAX_PIXELS", "MAX_SIDE", "TooLarge", "WIRE_FORMATS", "WIRE_MAX_PIXELS", "decode_bytes", "load_rgb",
           "sniffed"]
