"""Robust image decoding for extraction: what can be converted is, the rest is reported.

Conversions:

- EXIF orientation is applied (the pixels are turned as a viewer shows them);
- grayscale (L, LA), palette (P), CMYK, YCbCr, LAB and HSV images become RGB with
  Pillow's conversions (CMYK without colour management);
- alpha (RGBA, LA, P with transparency) is composited over white;
- 16-bit (I;16*) and 32-bit integer (I) images are scaled to 8 bits by their full
  range (``value / 257`` for 16-bit), not clipped; float (F) images by their min..max.

Refused with a reason (``BadImage``): an empty file, a file that is not an image, a
truncated or corrupt file, an image of more than ``max_pixels`` pixels and one whose
longer side is more than ``max_aspect_ratio`` times its shorter side (both checked from
the header, before decoding, so a decompression bomb or a 1 x 10000 sliver costs
nothing). Memory per image is thus bounded by ``max_pixels`` and, in
:func:`centre_crop_resize`, by the output size.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_PIXELS = 89_478_485  # Pillow's own decompression-bomb limit
MAX_ASPECT_RATIO = 20.0  # longer side / shorter side; panoramas stay well below


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


def load_image(
    path: str | Path,
    max_pixels: int = MAX_PIXELS,
    max_aspect_ratio: float = MAX_ASPECT_RATIO,
    reduce_to: int | None = None,
) -> Image.Image:
    """Open, check and decode ``path`` into an upright RGB image, or raise ``BadImage``.

    With ``reduce_to``, a JPEG is decoded at the smallest scale (1/2, 1/4, 1/8) that keeps
    its shorter side at least ``reduce_to`` pixels: decoding costs memory in proportion to
    the output, not to the file (other formats decode whole, bounded by ``max_pixels``).
    """
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise BadImage("empty_file", f"{path} has 0 bytes")
    except OSError as err:
        raise BadImage("unreadable", f"{path}: {err.strerror or err}") from None
    with warnings.catch_warnings(action="ignore", category=Image.DecompressionBombWarning):
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
            if max(width, height) > max_aspect_ratio * min(width, height):
                raise BadImage(
                    "extreme_aspect_ratio",
                    f"{path} is {width}x{height}, more than {max_aspect_ratio:g} times longer "
                    "than wide (raise the stage's max_aspect_ratio to keep such images)",
                )
            try:
                if reduce_to and image.format == "JPEG" and min(width, height) > reduce_to:
                    scale = reduce_to / min(width, height)
                    image.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
                image.load()
                image = ImageOps.exif_transpose(image)
                return to_rgb(image)
            except (OSError, SyntaxError, ValueError) as err:
                # Pillow reports truncated or corrupt data on load
                raise BadImage("corrupt", f"{path}: {err}") from None


def centre_crop_resize(image: Image.Image, size: int) -> Image.Image:
    """The centre ``size`` x ``size`` square of ``image`` resized so that its shorter side
    is ``size`` (bilinear), as resize-then-crop gives it, but cropped first: the cost is
    bounded by the output whatever the aspect ratio (resizing a 1 x 10000 image to a 224
    shorter side first is 224 x 2.24M pixels, ~1.5 GB).

    The crop box is the resized crop mapped back to source coordinates (fractional), so
    the pixels match resizing the whole image and cropping, to within rounding."""
    w, h = image.size
    scale = size / min(w, h)
    rw, rh = max(round(w * scale), size), max(round(h * scale), size)
    left, top = (rw - size) // 2, (rh - size) // 2
    sx, sy = w / rw, h / rh
    box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
    return image.resize((size, size), Image.BILINEAR, box=box)
