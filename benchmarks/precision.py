"""Reduced precision against float32, measured: the bottom-up-attention regions and the
grid trunk's features under bf16 and fp16 autocast, on the CC BY test photos, on CPU.

For each model and dtype, every photo is extracted in float32 (the reference) and under
``torch.autocast(dtype=...)``; the figures compare the two:

- BUTD (:class:`features.images.butd.ButdModel`, the stage's selection): the share of the
  reference's regions that a region of the reduced run matches at IoU >= 0.9 (one to one,
  highest IoU first), the mean and lowest cosine between matched regions' features, the
  share of matched regions with the same object id (and attribute id);
- grid (the ResNet trunk of stage ``grid``): the mean and lowest cosine per grid cell.

The BUTD checkpoint is the parity tests' ``peaked`` one (py-bottom-up-attention's layout,
the reduced network, its predictor peaked so that one class clearly wins per region, as
in a trained model). A random checkpoint at the published shapes is no use here: its flat
class scores make the kept regions a near-random pick among overlapping proposals, in
float32 already. The grid trunk is torchvision's ResNet-152 from its own constructor,
random values (zero-init residuals). No weights are downloaded.

Writes ``benchmarks/results/precision.json``; the docs read it.

    python benchmarks/precision.py [--photos 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torchvision.ops import box_iou

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tools")]

from butd_data import photo_set  # noqa: E402
from make_butd_golden import GOLDEN_PARAMS, peaked_checkpoint  # noqa: E402

from features.images.config import GridConfig, RegionsConfig  # noqa: E402
from features.images.extract import build_image_extractor  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MATCH_IOU = 0.9


def matched_pairs(reference: torch.Tensor, other: torch.Tensor) -> list[tuple[int, int]]:
    """(i, j) pairs of reference and other boxes at IoU >= :data:`MATCH_IOU`, one to one,
    the highest IoU first."""
    if not len(reference) or not len(other):
        return []
    iou = box_iou(reference.double(), other.double())
    pairs, used_i, used_j = [], set(), set()
    for flat in torch.argsort(iou.flatten(), descending=True).tolist():
        i, j = divmod(flat, iou.shape[1])
        if iou[i, j] < MATCH_IOU:
            break
        if i not in used_i and j not in used_j:
            pairs.append((i, j))
            used_i.add(i)
            used_j.add(j)
    return pairs


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return (a * b).sum(axis=-1) / np.maximum(norms, 1e-12)


def regions_of(extractor, images, dtype) -> tuple[list[dict], float]:
    """Each image's kept regions (float32 tensors) and the seconds per image."""
    items = [extractor.prepare(image, {}) for image in images]
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        out = [extractor.regions([item])[0] for item in items]
    return out, (time.perf_counter() - start) / len(items)


def compare_regions(reference: list[dict], reduced: list[dict]) -> dict:
    total = matched = same_object = same_attr = 0
    cos = []
    for ref, red in zip(reference, reduced, strict=True):
        pairs = matched_pairs(ref["boxes"], red["boxes"])
        total += len(ref["boxes"])
        matched += len(pairs)
        if not pairs:
            continue
        i, j = (list(x) for x in zip(*pairs, strict=True))
        cos.extend(cosines(ref["features"][i].numpy(), red["features"][j].numpy()))
        same_object += int((ref["objects_id"][i] == red["objects_id"][j]).sum())
        if "attrs_id" in ref:
            same_attr += int((ref["attrs_id"][i] == red["attrs_id"][j]).sum())
    return {
        "regions": total,
        "matched_iou_0_9": matched / max(total, 1),
        "cosine_mean": float(np.mean(cos)) if cos else None,
        "cosine_min": float(np.min(cos)) if cos else None,
        "same_object_id": same_object / max(matched, 1),
        "same_attribute_id": same_attr / max(matched, 1) if "attrs_id" in reference[0] else None,
    }


def butd_rows(name: str, weights: Path, params: dict, images) -> dict:
    extractor = build_image_extractor(
        "regions", RegionsConfig(weights=str(weights), device="cpu", **params)
    )
    reference, seconds = regions_of(extractor, images, None)
    row = {"float32": {"seconds_per_image": seconds}}
    for label, dtype in DTYPES.items():
        reduced, seconds = regions_of(extractor, images, dtype)
        row[label] = {**compare_regions(reference, reduced), "seconds_per_image": seconds}
        print(f"{name} {label}: {json.dumps(row[label])}", flush=True)
    # the RoI heads alone in bf16 (res5 over 14x14 cells per region: most of the cost),
    # the trunk and the RPN in float32, so that the proposals stay as they are
    res5 = extractor.model.roi_heads.res5
    full = res5.forward

    def heads_in_bf16(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return full(x).float()

    res5.forward = heads_in_bf16
    reduced, seconds = regions_of(extractor, images, None)
    res5.forward = full
    row["bf16_heads"] = {**compare_regions(reference, reduced), "seconds_per_image": seconds}
    print(f"{name} bf16_heads: {json.dumps(row['bf16_heads'])}", flush=True)
    return row


def grid_rows(images) -> dict:
    """The trunk's conv5 map (the stage's features before pooling) per photo, float32
    against each reduced dtype: cosine per map cell."""
    extractor = build_image_extractor("grid", GridConfig(device="cpu", architecture="resnet152"))
    batches = [extractor.prepare(image, {})["image"][None] for image in images]

    def conv5(dtype) -> list[np.ndarray]:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            maps = [extractor.model(b).float() for b in batches]  # (1, 2048, h, w)
        return [m[0].flatten(1).T.numpy() for m in maps]  # (cells, 2048)

    reference = conv5(None)
    row = {}
    for label, dtype in DTYPES.items():
        cos = np.concatenate([cosines(a, b) for a, b in zip(reference, conv5(dtype), strict=True)])
        row[label] = {
            "cells": int(cos.size),
            "cosine_mean": float(cos.mean()),
            "cosine_min": float(cos.min()),
        }
        print(f"grid {label}: {json.dumps(row[label])}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/precision.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    images = photo_set(args.photos)
    result = {
        "device": "cpu",
        "torch": torch.__version__,
        "photos": len(images),
        "match_iou": MATCH_IOU,
        "butd": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        peaked = peaked_checkpoint(Path(tmp) / "peaked.pth")
        result["butd"]["peaked"] = butd_rows("peaked", peaked, GOLDEN_PARAMS, images)
    result["grid"] = grid_rows(images)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
