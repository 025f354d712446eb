"""Random-init extraction at the papers' sizes (issue 24): non-finite images and CPU speed.

With ``weights: null`` (testing without weights), ``grid`` builds a ResNet-152 at 224 px
and ``regions`` an R101-C4 Faster R-CNN at 600/1000 px. Each runs the project's extractor
(``build_image_extractor``: ResNet blocks start as identities, ``zero_init_residual``) and,
as the baseline in the same run, the same network with torchvision's plain init, on real
photographs (the CC BY COCO val2017 set of ../shared/data). It prints, per row, the images
whose stored (float16) features are not finite, and seconds per image of the forward pass.
Target: 0 non-finite images for the project's extractor.

    python benchmarks/random_init.py [--photos DIR] [--n 4] [--kinds grid regions]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from features.decode import load_image
from features.detector.config import DetectorConfig
from features.detector.model import ResNetTrunk, build_detector_model, resnet_depth
from features.images.config import GridConfig, RegionsConfig
from features.images.extract import build_image_extractor
from features.images.grid import GridExtractor
from features.images.regions import DEFAULT_CLASSES, DEFAULT_DETECTOR, RegionExtractor
from infra.finite import nonfinite_fields

PHOTOS = Path(__file__).resolve().parents[1] / "tests/data/photos"  # CC BY COCO photos


def plain_init(kind: str, cfg):
    """The same network with torchvision's own init (the baseline)."""
    torch.manual_seed(cfg.seed)
    if kind == "grid":
        trunk = ResNetTrunk(resnet_depth(cfg.architecture or "resnet152")).eval()
        trunk.architecture = cfg.architecture or "resnet152"
        return GridExtractor(trunk, cfg, torch.device("cpu"))
    spec = DetectorConfig(architecture=DEFAULT_DETECTOR, rpn_post_nms_test=cfg.proposals)
    model = build_detector_model(spec, DEFAULT_CLASSES).eval()
    return RegionExtractor(model, cfg, torch.device("cpu"))


def measure(extractor, images) -> tuple[int, float, float]:
    """(non-finite images, seconds per image, max |feature| as stored)."""
    dtypes = {name: spec.dtype for name, spec in extractor.fields().items()}
    bad, seconds, peak = 0, 0.0, 0.0
    for image in images:
        item = extractor.prepare(image, {})
        start = time.perf_counter()
        (record,) = extractor([item])
        seconds += time.perf_counter() - start
        bad += bool(nonfinite_fields(record, dtypes))
        stored = torch.from_numpy(record["features"]).float()
        if stored.numel():
            peak = max(peak, float(stored.abs().max()))
    return bad, seconds / len(images), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=Path, default=PHOTOS)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", default=["grid", "regions"])
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    files = sorted(args.photos.glob("*.jpg"))[: args.n]
    images = [load_image(f) for f in files]
    print(f"{len(images)} photos from {args.photos}, {torch.get_num_threads()} threads, CPU")
    configs = {
        "grid": GridConfig(device="cpu"),  # code defaults: ResNet-152, 224 px
        "regions": RegionsConfig(device="cpu"),  # R101-C4, 600/1000 px, 300 proposals
    }
    for kind in args.kinds:
        cfg = configs[kind]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = build_image_extractor(kind, cfg)
            base = plain_init(kind, cfg)
        for name, extractor in (("torchvision init", base), ("zero_init_residual", ours)):
            bad, per_image, peak = measure(extractor, images)
            print(
                f"{kind:8s} {name:20s} non-finite {bad}/{len(images)}  "
                f"max |feature| {peak:.3g}  {per_image:.2f} s/img ({1 / per_image:.2f} img/s)"
            )


if __name__ == "__main__":
    main()
