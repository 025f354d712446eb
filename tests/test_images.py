"""Robust decoding: every conversion and every refusal of the bad-image corpus."""

import io

import numpy as np
import pytest
from PIL import Image

from features.images import BadImage, load_image


def make_corpus(folder):
    """The bad-image corpus: name -> path; made in code, small."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}

    def save(name, image, **kw):
        files[name] = folder / name
        image.save(files[name], **kw)

    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), np.uint8))
    save("good.jpg", rgb, quality=90)
    buf = io.BytesIO()
    rgb.save(buf, "JPEG", quality=90)
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    files["truncated.jpg"] = folder / "truncated.jpg"
    (folder / "empty.jpg").write_bytes(b"")
    files["empty.jpg"] = folder / "empty.jpg"
    (folder / "notes.jpg").write_text("this is not an image\n")
    files["notes.jpg"] = folder / "notes.jpg"
    save("bomb.png", Image.new("1", (10_000, 9_000)), optimize=False)
    save("gray.png", Image.new("L", (30, 20), 77))
    save("cmyk.jpg", Image.new("CMYK", (30, 20), (0, 255, 255, 0)))
    rgba = Image.new("RGBA", (30, 20), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))
    save("rgba.png", rgba)
    save("deep16.png", Image.fromarray(np.array([[0, 32896, 65535]], dtype=np.uint16)))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    save("rotated.jpg", Image.new("RGB", (40, 20), (0, 200, 0)), exif=exif)
    palette = Image.new("P", (10, 10), 1)
    palette.putpalette([255, 255, 255, 0, 0, 255] + [0] * 762)
    palette.info["transparency"] = 1
    save("palette.png", palette, transparency=1)
    return files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize(
    "name, reason",
    [
        ("truncated.jpg", "corrupt"),
        ("empty.jpg", "empty_file"),
        ("notes.jpg", "not_an_image"),
        ("bomb.png", "too_large"),
        ("missing.jpg", "unreadable"),
    ],
)
def test_refused_with_a_reason(corpus, name, reason):
    with pytest.raises(BadImage) as err:
        load_image(corpus.get(name, corpus["good.jpg"].parent / name))
    assert err.value.reason == reason and name in err.value.detail


def test_conversions(corpus):
    assert load_image(corpus["good.jpg"]).size == (64, 48)
    gray = np.asarray(load_image(corpus["gray.png"]))
    assert gray.shape == (20, 30, 3) and (gray == 77).all()
    cmyk = np.asarray(load_image(corpus["cmyk.jpg"]))
    assert cmyk[0, 0, 0] > 200 and cmyk[0, 0, 1] < 50  # C=0, M=Y=full -> red
    rgba = np.asarray(load_image(corpus["rgba.png"]))
    assert tuple(rgba[0, 0]) == (255, 255, 255) and tuple(rgba[5, 5]) == (255, 0, 0)
    deep = np.asarray(load_image(corpus["deep16.png"]))
    assert deep[0, :, 0].tolist() == [0, 128, 255]  # scaled, not clipped
    rotated = load_image(corpus["rotated.jpg"])
    assert rotated.size == (20, 40)  # EXIF orientation applied
    palette = np.asarray(load_image(corpus["palette.png"]))
    assert tuple(palette[0, 0]) == (255, 255, 255)  # transparent -> white


def test_pixel_limit_is_a_parameter(corpus):
    with pytest.raises(BadImage, match="too_large"):
        load_image(corpus["good.jpg"], max_pixels=100)
