"""Throughput of the extraction stages against a bare model forward, in one run, and of
the bottom-up-attention region selection against the reference per-class loop.

For each extractor: (a) the whole stage (`extract_images`: decode and resize in a
DataLoader worker, batched forward, each batch finished (selection, packing) on a thread
beside the next forward, store writes) on demo images, (b) the bare extractor on the same
images decoded and prepared beforehand, each batch's forward then its finish, and (c) its
forward alone. `--threads N` sets torch's threads; each thread count's rows go to
`benchmarks/results/extract_stages.json`. Target: the stage reaches >= 0.95x of (b) on
CPU. The detector row
runs the torchvision path (RPN, box head, BUTD selection) of a `vse-detector` checkpoint:
`--detector data/models/detector/detector.pt`, or a random-init one of the demo's
architecture (params.yaml `detector`).

BUTD (issue 23): the native bottom-up-attention model (features/images/butd) against
upstream detectron2 with the backend's registrations (features/images/detectron2_backend),
forward + selection per image at 600/1000 px on the test photos, the same checkpoint
(random values in py-bottom-up-attention's layout at the published shapes: ResNet-101,
1601 classes, 401 attributes; `--butd-width 8` for a quick reduced run), the same images
and threads, one image at a time; the best of `--repeats` per image, averaged over the
images. Target >= 1.0x (detectron2's time / the native time). Needs detectron2 on the
path for the comparison (otherwise the native time alone).

BUTD batches: the native model at batch 1, 4 and 8 on eight images of seven sizes (each
image gets its own regions at any batch: the trunk runs per image, the RoI heads over the
batch); seconds per image, target: batch 4 at least as fast per image as batch 1.

Selection (issue 13): `butd_select` against generate_tsv.py's loop (one torchvision `nms`
per class) on 300 proposals x 1601 classes, with peaked (detector-like) and flat softmax
scores; the same inputs, in the same run; target >= 10x.

    python benchmarks/extract.py [--n 192] [--size 128] [--workers 1] [--detector CKPT]
    python benchmarks/extract.py --only butd [--threads 2] [--butd-images 3] [--repeats 2]
    python benchmarks/extract.py --only butd-batch [--threads 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import yaml
from torchvision.ops import nms

from features.decode import load_image
from features.demo import DemoConfig, build_dataset
from features.detector.config import DetectorConfig
from features.detector.model import build_detector_model, detector_checkpoint
from features.images.config import GridConfig, RegionsConfig
from features.images.extract import build_image_extractor, extract_images
from features.images.grid import GridExtractor, build_trunk
from features.images.regions import RegionExtractor, build_detector
from features.images.select import butd_select
from features.ingest.manifest import read_manifest, write_manifest
from features.ingest.readers import READERS, PrepareConfig
from features.ingest.validate import validate
from features.store.spec import StoreConfig

REPO = Path(__file__).resolve().parent.parent
PHOTOS = REPO / "tests" / "fixtures" / "photos"  # CC BY COCO photos (ATTRIBUTION.md there)


def bare_forward(extractor, items: list[dict], batch_size: int) -> tuple[float, float]:
    """images/s of the extractor alone on prepared items, best of 2 passes: the forward and
    finish (selection, packing) one after the other, and the forward alone."""
    best = {"call": 0.0, "forward": 0.0}
    for _ in range(2):
        for name, run in (("call", extractor), ("forward", extractor.forward)):
            start = time.perf_counter()
            for i in range(0, len(items), batch_size):
                run(items[i : i + batch_size])
            best[name] = max(best[name], len(items) / (time.perf_counter() - start))
    return best["call"], best["forward"]


def loop_select(boxes: torch.Tensor, scores: torch.Tensor, cfg: RegionsConfig):
    """generate_tsv.py's selection: one NMS per class over all proposals."""
    max_conf = torch.zeros(len(boxes))
    for c in range(1, scores.shape[1]):
        keep = nms(boxes, scores[:, c], cfg.nms_iou)
        max_conf[keep] = torch.maximum(max_conf[keep], scores[keep, c])
    n_keep = int((max_conf >= cfg.conf_threshold).sum())
    n_keep = min(max(n_keep, cfg.min_boxes), cfg.max_boxes, len(boxes))
    return torch.argsort(max_conf, descending=True, stable=True)[:n_keep]


def selection_rows(repeats: int = 5) -> None:
    """ms per image of the loop and of butd_select on the same 300 x 1601 inputs."""
    cfg = RegionsConfig()  # the paper's: 0.2 threshold, NMS 0.3, 10..100 boxes
    gen = torch.Generator().manual_seed(0)
    print(f"\n{'selection, 300 proposals x 1601 classes':<44}{'loop ms':>9}{'fast ms':>9}{'x':>7}")
    for name, temperature in (("peaked scores (detector-like)", 6.0), ("flat scores", 1.0)):
        inputs = []
        for _ in range(repeats):
            xy = torch.rand(300, 2, generator=gen) * 500
            boxes = torch.cat([xy, xy + torch.rand(300, 2, generator=gen) * 300 + 8], dim=1)
            logits = torch.randn(300, 1601, generator=gen) * temperature
            inputs.append((boxes, logits.softmax(dim=1)))
        timings = {}
        for label, fn in (("loop", loop_select), ("fast", butd_select)):
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                for boxes, scores in inputs:
                    fn(boxes, scores, cfg)
                best = min(best, (time.perf_counter() - start) / repeats)
            timings[label] = best * 1000
        for boxes, scores in inputs:
            assert (
                butd_select(boxes, scores, cfg)[0].tolist()
                == loop_select(boxes, scores, cfg).tolist()
            )
        ratio = timings["loop"] / timings["fast"]
        print(f"{name:<44}{timings['loop']:>9.1f}{timings['fast']:>9.1f}{ratio:>7.1f}")


def demo_detector(path: str | None, root: Path) -> str:
    """A vse-detector checkpoint: the given one, or a random-init one of the demo's
    architecture (params.yaml `detector`; 6 classes, 8 attributes)."""
    if path:
        return path
    section = yaml.safe_load(Path("params.yaml").read_text()).get("detector", {})
    cfg = DetectorConfig.model_validate(section)
    torch.manual_seed(0)
    model = build_detector_model(cfg, 7, 8)
    classes = [f"class{i}" for i in range(6)]
    attributes = [f"attribute{i}" for i in range(8)]
    torch.save(detector_checkpoint(model, cfg, classes, attributes), root / "detector.pt")
    return str(root / "detector.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=192, help="images")
    parser.add_argument("--size", type=int, default=128, help="demo image size (px)")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    parser.add_argument("--detector", help="vse-detector checkpoint (default: random init)")
    parser.add_argument(
        "--only", choices=["stages", "selection", "butd", "butd-batch"], help="one part"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--butd-images", type=int, default=3, help="test photos")
    parser.add_argument("--butd-width", type=int, default=64, help="64: the real model")
    parser.add_argument("--repeats", type=int, default=2, help="per image (best of)")
    parser.add_argument(
        "--stage-butd-width", type=int, default=8, help="BUTD width of the stage row"
    )
    args = parser.parse_args()
    if args.only in (None, "stages"):
        stage_rows(args)
    if args.only in (None, "selection"):
        selection_rows()
    if args.only in (None, "butd"):
        butd_rows(args)
    if args.only in (None, "butd-batch"):
        butd_batch_rows(args)


def butd_checkpoint(root: Path, width: int = 64) -> Path:
    """``root/butd.pth``: random values in py-bottom-up-attention's layout at the published
    shapes (ResNet-101, 1601 classes, 401 attributes; ``width`` 64 is the real network)."""
    sys.path.insert(0, str(REPO / "tests"))  # the test suite's BUTD checkpoint builder
    from butd_data import butd_state

    w = width
    state = butd_state(blocks=(3, 4, 23, 3), width=w, hidden=8 * w, classes=1601, attrs=401)
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, root / "butd.pth")
    return root / "butd.pth"


def butd_rows(args: argparse.Namespace) -> None:
    """Native BUTD vs detectron2: seconds per image, forward + selection."""
    from PIL import Image

    torch.set_num_threads(args.threads)
    photos = sorted(PHOTOS.glob("*.jpg"))[: args.butd_images]
    w = args.butd_width
    root = Path(tempfile.mkdtemp(prefix="vse-butd-bench-"))
    base = {"weights": str(butd_checkpoint(root, w)), "device": "cpu"}
    routes = {"native": RegionsConfig(**base)}
    try:
        import detectron2  # noqa: F401

        config = root / "butd.yaml"
        config.write_text(_butd_yaml(w))
        routes["detectron2"] = RegionsConfig(
            **base, backend="detectron2", detectron2_config=str(config)
        )
    except ImportError:
        print("detectron2 is not installed: native time only")
    images = [Image.open(p).convert("RGB") for p in photos]
    extractors = {name: build_image_extractor("regions", cfg) for name, cfg in routes.items()}
    items = {name: [e.prepare(i, {}) for i in images] for name, e in extractors.items()}
    for name, e in extractors.items():
        e.regions(items[name][:1])  # warm-up
    best = {name: [float("inf")] * len(images) for name in routes}
    for i in range(len(images)):  # the routes alternate, so both meet the same load
        for _ in range(args.repeats):
            for name, e in extractors.items():
                tick = time.perf_counter()
                e.regions([items[name][i]])
                best[name][i] = min(best[name][i], time.perf_counter() - tick)
    seconds = {name: sum(b) / len(b) for name, b in best.items()}
    shutil.rmtree(root)
    print(f"BUTD R101 width {w}, {len(images)} photos at 600/1000 px, {args.threads} threads")
    for name, s in seconds.items():
        print(f"  {name:<12}{s:>8.2f} s/image")
    if "detectron2" in seconds:
        ratio = seconds["detectron2"] / seconds["native"]
        print(f"  native speed vs detectron2: {ratio:.2f}x (target >= 1.0x)")


def butd_batch_rows(args: argparse.Namespace) -> None:
    """Native BUTD at batch 1, 4 and 8: seconds per image (forward + selection) on eight
    images of seven sizes, 600/1000 px, 300 proposals; the batch sizes alternate per
    repeat, the best of ``--repeats`` counts. Target: batch 4 at least as fast per image
    as batch 1. Writes ``benchmarks/results/butd_batch.json``."""
    torch.set_num_threads(args.threads)
    w = args.butd_width
    root = Path(tempfile.mkdtemp(prefix="vse-butd-batch-"))
    weights = butd_checkpoint(root, w)
    from butd_data import photo_set  # on the path since butd_checkpoint

    extractor = build_image_extractor("regions", RegionsConfig(weights=str(weights), device="cpu"))
    items = [extractor.prepare(image, {}) for image in photo_set(8)]
    extractor.regions(items[:1])  # warm-up
    best = {b: float("inf") for b in (1, 4, 8)}
    for _ in range(args.repeats):
        for b in best:
            tick = time.perf_counter()
            for lo in range(0, len(items), b):
                extractor.regions(items[lo : lo + b])
            best[b] = min(best[b], (time.perf_counter() - tick) / len(items))
            print(f"  batch {b}: {best[b]:.2f} s/image", flush=True)
    shutil.rmtree(root)
    result = {
        "model": f"BUTD R101 width {w}, 300 proposals, 600/1000 px",
        "images": len(items),
        "threads": args.threads,
        "device": "cpu",
        "seconds_per_image": {str(b): s for b, s in best.items()},
        "batch4_over_batch1": best[1] / best[4],
        "batch8_over_batch1": best[1] / best[8],
    }
    out = REPO / "benchmarks" / "results" / "butd_batch.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"BUTD batch 4: {result['batch4_over_batch1']:.2f}x batch 1's images/s, batch 8: "
        f"{result['batch8_over_batch1']:.2f}x (target >= 1.0x); wrote {out}"
    )


def _butd_yaml(width: int) -> str:
    """py-bottom-up-attention's VG-Detection keys at ResNet-101 depth and ``width``."""
    return f"""MODEL:
  META_ARCHITECTURE: GeneralizedRCNN
  CAFFE_MAXPOOL: True
  PIXEL_MEAN: [102.9801, 115.9465, 122.7717]
  RESNETS: {{DEPTH: 101, STEM_OUT_CHANNELS: {width}, RES2_OUT_CHANNELS: {4 * width},
    WIDTH_PER_GROUP: {width}}}
  PROPOSAL_GENERATOR: {{HID_CHANNELS: {8 * width}}}
  ANCHOR_GENERATOR: {{SIZES: [[64, 128, 256, 512]]}}
  RPN: {{PRE_NMS_TOPK_TEST: 6000, POST_NMS_TOPK_TEST: 300}}
  ROI_HEADS: {{NAME: Res5ROIHeads, NUM_CLASSES: 1600}}
  ROI_BOX_HEAD: {{RES5HALVE: False, POOLER_TYPE: ROIPool, ATTR: True, NUM_ATTRS: 400}}
"""


def stage_rows(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message=".*RANDOM initialisation")
    torch.set_num_threads(args.threads)
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
    detector = demo_detector(args.detector, root)
    setups = {
        "detector": (
            "regions (detector: RPN+head+selection)",
            RegionsConfig(
                backend="torchvision",
                weights=detector,
                min_side=side,
                max_side=side,
                proposals=100,
                min_boxes=2,
                max_boxes=10,
                batch_size=8,
                num_workers=args.workers,
            ),
            lambda cfg: RegionExtractor(build_detector(cfg), cfg, device),
        ),
        "butd": (
            f"regions (BUTD R101 width {args.stage_butd_width}, 300 prop.)",
            RegionsConfig(
                weights=str(butd_checkpoint(root, args.stage_butd_width)),
                min_side=side,
                max_side=side,
                batch_size=4,
                num_workers=args.workers,
            ),
            lambda cfg: build_image_extractor("regions", cfg),
        ),
        "given": (
            "regions (given boxes, resnet50_c4)",
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
        "grid_resnet18": (
            "grid (the detector's resnet18 trunk)",
            GridConfig(weights=detector, image_size=side, batch_size=16, num_workers=args.workers),
            lambda cfg: GridExtractor(build_trunk(cfg), cfg, device),
        ),
        "grid_resnet50": (
            "grid (resnet50)",
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
    print(
        f"{'extractor':<38}{'stage':>8}{'bare':>8}{'ratio':>7}{'forward':>9}{'ratio':>7}  "
        "phases (images/s; bare: forward then finish; forward: the network alone)"
    )
    results = {}
    for key, (name, cfg, build) in setups.items():
        extractor = build(cfg)
        items = [extractor.prepare(load_image(root / "images" / r["path"]), r) for r in rows]
        bare, forward = bare_forward(extractor, items, cfg.batch_size)
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
        print(
            f"{name:<38}{best:>8.1f}{bare:>8.1f}{best / bare:>7.2f}{forward:>9.1f}"
            f"{best / forward:>7.2f}  {phases}",
            flush=True,
        )
        results[key] = {
            "extractor": name,
            "stage_images_per_s": round(best, 2),
            "bare_images_per_s": round(bare, 2),
            "forward_images_per_s": round(forward, 2),
            "stage_over_bare": round(best / bare, 3),
            "stage_over_forward": round(best / forward, 3),
            "phases": phases,
        }
    out = REPO / "benchmarks" / "results" / "extract_stages.json"
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved[f"threads_{torch.get_num_threads()}"] = {
        "images": len(rows),
        "image_px": side,
        "device": device.type,
        "dataloader_workers": args.workers,
        "rows": results,
    }
    out.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"wrote {out}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
