"""Robust image decoding for extraction: what can be converted is, the rest is reported.

Conversions (documented in the README):

- EXIF orientation is applied (the pixels are turned as a viewer shows them);
- grayscale (L, LA), palette (P), CMYK, YCbCr, LAB and HSV images become RGB with
  Pillow's conversions (CMYK without colour management);
- alpha (RGBA, LA, P with transparency) is composited over white;
- 16-bit (I;16*) and 32-bit integer (I) images are scaled to 8 bits by their full
  range (``value / 257`` for 16-bit), not clipped; float (F) images by their min..max.

Refused with a reason (``BadImage``): an empty file, a file that is not an image, a
truncated or corrupt file, and an image of more than ``max_pixels`` pixels (checked from
the header, before decoding, so a decompression bomb costs nothing).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError


class BadImage(Exception):
    """An image that cannot be used; ``reason`` is a short code for the error report."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _to_8bit(image: Image.Image) -> Image.Image:
    array = np.asarray(image)
    if image.mode.startswith("I;16"):
        scaled = array.astype(np.float64) / 257.0
    elif image.mode == "I":
        scaled = array.astype(np.float64) / (257.0 if array.max(initial=0) > 255 else 1.0)
        if array.max(initial=0) > 65535:
            scaled = array.astype(np.float64) / array.max() * 255.0
    else:  # F
        lo, hi = float(array.min(initial=0.0)), float(array.max(initial=0.0))
        scaled = (array - lo) / (hi - lo or 1.0) * 255.0
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), "L")


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB, as documented above."""
    if image.mode.startswith("I") or image.mode == "F":
        image = _to_8bit(image)
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image.convert("RGB")


def load_image(path: str | Path, max_pixels: int = 89_478_485) -> Image.Image:
    """Open, check and decode ``path`` into an upright RGB image, or raise ``BadImage``."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise BadImage("empty_file", f"{path} has 0 bytes")
    except OSError as err:
        raise BadImage("unreadable", f"{path}: {err.strerror or err}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(path)
        except UnidentifiedImageError:
            raise BadImage("not_an_image", f"{path} is not an image Pillow can read") from None
        except Image.DecompressionBombError as err:
            raise BadImage("too_large", str(err)) from None
        except OSError as err:
            raise BadImage("unreadable", f"{path}: {err}") from None
        with image:
            width, height = image.size
            if width * height > max_pixels:
                raise BadImage(
                    "too_large",
                    f"{path} is {width}x{height} = {width * height} pixels, over "
                    f"{max_pixels} (a decompression bomb?)",
                )
            try:
                image.load()
                image = ImageOps.exif_transpose(image)
                return to_rgb(image)
            except (OSError, SyntaxError, ValueError) as err:
                # Pillow reports truncated or corrupt data on load
                raise BadImage("corrupt", f"{path}: {err}") from None
