"""Throughput of the extraction stages against a bare model forward, in one run.

For each extractor: (a) the whole stage (`extract_images`: decode and resize in a
DataLoader worker, batched inference, store writes) on demo images, and (b) the bare
forward pass of the same extractor on the same images decoded and prepared beforehand.
Target (issue 4): the stage reaches >= 0.9x of the bare forward on CPU.

    python benchmarks/extract.py [--n 192] [--size 128] [--workers 1]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from features.demo import DemoConfig, build_dataset
from features.extract import extract_images
from features.images import load_image
from features.ingest import READERS, PrepareConfig, read_manifest, validate, write_manifest
from features.store import StoreConfig
from features.visual import GridExtractor, RegionExtractor, build_detector, build_trunk
from features.visual_config import GridConfig, RegionsConfig


def bare_forward(extractor, items: list[dict], batch_size: int) -> float:
    """images/s of the extractor alone on prepared items (best of 2 passes)."""
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        for i in range(0, len(items), batch_size):
            extractor(items[i : i + batch_size])
        best = max(best, len(items) / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=192, help="images")
    parser.add_argument("--size", type=int, default=128, help="demo image size (px)")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*RANDOM initialisation")
    root = Path(tempfile.mkdtemp(prefix="vse-extract-bench-"))
    build_dataset(DemoConfig(n_train=args.n, n_val=1, n_test=1, image_size=args.size), root)
    dataset = READERS["demo"](root / "dataset.json", root / "images", PrepareConfig())
    records, _ = validate(dataset, root / "images", 5)
    write_manifest(records, dataset, 5, root / "manifest.parquet")
    manifest = read_manifest(root / "manifest.parquet")
    rows = manifest.table.to_pylist()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layout = StoreConfig(samples_per_shard=64, samples_per_chunk=16)
    side = args.size
    setups = {
        "regions (given boxes, resnet50_c4)": (
            RegionsConfig(
                backend="given",
                architecture="resnet50_c4",
                min_side=side,
                max_side=side,
                max_boxes=10,
                batch_size=8,
                num_workers=args.workers,
            ),
            lambda cfg: RegionExtractor(build_detector(cfg), cfg, device),
        ),
        "grid (resnet50)": (
            GridConfig(
                architecture="resnet50", image_size=side, batch_size=16, num_workers=args.workers
            ),
            lambda cfg: GridExtractor(build_trunk(cfg), cfg, device),
        ),
    }
    print(
        f"{len(rows)} images of {side}px, {device}, torch threads {torch.get_num_threads()}, "
        f"{args.workers} DataLoader worker(s)\n"
    )
    print(f"{'extractor':<38}{'stage img/s':>12}{'bare img/s':>12}{'ratio':>8}  phases")
    for name, (cfg, build) in setups.items():
        extractor = build(cfg)
        items = [extractor.prepare(load_image(root / "images" / r["path"]), r) for r in rows]
        bare = bare_forward(extractor, items, cfg.batch_size)
        best, phases = 0.0, ""
        for attempt in range(2):
            out = root / f"store-{attempt}.zarr"
            timing = extract_images(
                extractor, manifest, root / "images", out, cfg, layout, log=lambda m: None
            )
            rate = timing.images / timing.seconds
            if rate > best:
                best, phases = rate, timing.summary().split("; ")[1]
            shutil.rmtree(out)
        print(f"{name:<38}{best:>12.1f}{bare:>12.1f}{best / bare:>8.2f}  {phases}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
