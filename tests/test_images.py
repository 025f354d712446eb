"""Robust decoding: every conversion and every refusal of the bad-image corpus."""

import io

import numpy as np
import pytest
from PIL import Image

from features.decode import BadImage, load_image


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


def test_extreme_aspect_ratios_are_refused_with_their_own_reason(tmp_path):
    Image.new("RGB", (1, 10_000)).save(tmp_path / "sliver.png")  # ~100 bytes
    assert (tmp_path / "sliver.png").stat().st_size < 500
    with pytest.raises(BadImage) as err:
        load_image(tmp_path / "sliver.png")
    assert err.value.reason == "extreme_aspect_ratio" and "1x10000" in err.value.detail
    Image.new("RGB", (60, 3)).save(tmp_path / "wide.png")
    assert load_image(tmp_path / "wide.png", max_aspect_ratio=20).size == (60, 3)
    with pytest.raises(BadImage, match="extreme_aspect_ratio"):
        load_image(tmp_path / "wide.png", max_aspect_ratio=10)


def test_centre_crop_resize_equals_resize_then_crop():
    """The crop is taken in source coordinates, so it matches resizing the whole image
    first (what the grid's prepare did) without its cost."""
    from features.decode import centre_crop_resize

    rng = np.random.default_rng(0)
    for w, h in [(64, 48), (48, 64), (100, 37), (224, 224), (31, 300), (500, 499)]:
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8))
        size = 32
        scale = size / min(w, h)
        resized = image.resize(
            (max(round(w * scale), size), max(round(h * scale), size)), Image.BILINEAR
        )
        left, top = (resized.width - size) // 2, (resized.height - size) // 2
        old = np.asarray(resized.crop((left, top, left + size, top + size)), dtype=int)
        new = np.asarray(centre_crop_resize(image, size), dtype=int)
        assert new.shape == (size, size, 3)
        assert np.abs(new - old).max() <= 1, (w, h)


SLIVERS = """
import resource, sys, tempfile
from PIL import Image
from features.decode import BadImage, centre_crop_resize, load_image
w, h = int(sys.argv[1]), int(sys.argv[2])
image = Image.new("RGB", (w, h), (10, 20, 30))
path = tempfile.mktemp(suffix=".png")
image.save(path)
centre_crop_resize(Image.new("RGB", (64, 64)), 224)  # warm up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
crop = centre_crop_resize(image, 224)
try:
    load_image(path)
except BadImage as err:
    assert err.reason == "extreme_aspect_ratio"
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert crop.size == (224, 224), crop.size
print((after - before) // 1024)
"""


@pytest.mark.parametrize("w, h", [(1, 10_000), (10_000, 1), (3, 30_000), (20_000, 7)])
def test_peak_memory_of_extreme_slivers_is_bounded(w, h):
    """Resizing the whole 1 x 10000 image to a 224 shorter side first cost ~1.5 GB."""
    import subprocess
    import sys
    from pathlib import Path

    env = {"PYTHONPATH": str(Path(__file__).parent.parent), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", SLIVERS, str(w), str(h)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert int(out.stdout) < 20, f"{w}x{h}: peak grew by {out.stdout.strip()} MB"
