"""Random-init extraction (``weights: null``) stays finite at the papers' depths on real
photographs: torchvision's own init overflows float16 at conv5 of a ResNet-152 (the
baseline in each test shows the photo would fail without the fix)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import torchvision

from features.decode import load_image
from features.images.config import GridConfig, RegionsConfig
from features.images.extract import build_image_extractor
from infra.finite import nonfinite_fields

PHOTO = Path(__file__).parent / "data/photos/000000229358.jpg"  # CC BY 2.0, ATTRIBUTION.md


def extract(extractor, image) -> dict:
    (record,) = extractor([extractor.prepare(image, {})])
    return record


def stored_nonfinite(extractor, record) -> list[str]:
    return nonfinite_fields(record, {n: s.dtype for n, s in extractor.fields().items()})


def test_random_resnet152_grid_is_finite_in_float16():
    cfg = GridConfig(device="cpu", image_size=96)  # ResNet-152 (the default), small image
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extractor = build_image_extractor("grid", cfg)
    assert extractor.model.architecture == "resnet152"
    image = load_image(PHOTO)
    record = extract(extractor, image)
    assert not stored_nonfinite(extractor, record)
    assert np.abs(record["features"]).max() > 0  # not all zeros either
    # baseline: torchvision's resnet152 with its own init, the same crop
    torch.manual_seed(0)
    plain = torchvision.models.resnet152(weights=None).eval()
    x = extractor.prepare(image, {})["image"][None]
    with torch.no_grad():
        conv5 = torch.nn.Sequential(*list(plain.children())[:-2])(x)
    assert not torch.isfinite(conv5.half()).all()


def test_random_r101_c4_regions_are_finite_in_float16():
    """With torchvision's init this photo gives no region at 128 px (NaN scores) and an
    infinite float16 feature at 200 px (measured; benchmarks/random_init.py at 600/1000)."""
    cfg = RegionsConfig(device="cpu", min_side=128, max_side=128, proposals=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extractor = build_image_extractor("regions", cfg)
    assert extractor.model.architecture == "resnet101_c4"
    record = extract(extractor, load_image(PHOTO))
    assert not stored_nonfinite(extractor, record)
    assert record["n_regions"] == 10  # every proposal kept (min_boxes 10), all finite
