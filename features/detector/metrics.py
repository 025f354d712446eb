"""The detector's metrics on val, written as metrics JSON and a per-class AP plot:

- ``map50``: VOC-style mAP at IoU ``eval_iou`` (0.5): per class, detections of all images
  ranked by score, each matched to the best-overlapping unmatched ground truth of its
  class; AP is the area under the precision envelope (all points, VOC 2010+); the mean is
  over classes with ground truth in val.
- ``recall``: ground-truth boxes found by a detection (any class) at IoU >= ``eval_iou``;
  ``proposal_recall`` the same for the RPN's ``rpn_post_nms_test`` proposals.
- ``class_accuracy``: the predicted class of each ground-truth box (the box head on it).
- ``attribute_accuracy``: for each ground-truth object with k attributes, the share of
  them among the head's top-k attributes (given the object's ground-truth class, as in
  training), averaged over objects.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchvision.ops import box_iou

from features.detector.config import DetectorConfig
from features.detector.data import DetectionImage
from features.detector.inputs import batch_images
from features.detector.loader import DetectionItems, make_loader
from features.detector.model import backbone_with_conv5
from infra.files import atomic_path, write_json


def average_precision(recall: np.ndarray, precision: np.ndarray) -> float:
    """VOC 2010+ AP: area under the precision envelope, over all recall points."""
    mrec = np.concatenate([[0.0], recall, [1.0]])
    mpre = np.concatenate([[0.0], precision, [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    changes = np.where(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[changes + 1] - mrec[changes]) * mpre[changes + 1]))


def voc_ap_per_class(
    detections: list[dict], truths: list[dict], num_classes: int, iou: float
) -> dict[int, float]:
    """AP per class (1..num_classes-1) with ground truth; ``detections[i]`` and
    ``truths[i]`` hold ``boxes`` (N, 4) and ``labels`` (N,) (detections also ``scores``)
    of image i."""
    out = {}
    for c in range(1, num_classes):
        gts = [t["boxes"][t["labels"] == c] for t in truths]
        n_gt = sum(len(g) for g in gts)
        if n_gt == 0:
            continue
        entries = []  # (score, image, detection box)
        for i, d in enumerate(detections):
            mask = d["labels"] == c
            for s, b in zip(d["scores"][mask].tolist(), d["boxes"][mask], strict=True):
                entries.append((s, i, b))
        entries.sort(key=lambda e: -e[0])  # stable: ties keep image order
        used = [torch.zeros(len(g), dtype=torch.bool) for g in gts]
        tp = np.zeros(len(entries))
        for k, (_, i, box) in enumerate(entries):
            if len(gts[i]) == 0:
                continue
            overlaps = box_iou(box[None], gts[i])[0]
            j = int(overlaps.argmax())
            if overlaps[j] >= iou and not used[i][j]:
                used[i][j] = True
                tp[k] = 1
        hits = np.cumsum(tp)
        recall = hits / n_gt
        precision = hits / np.arange(1, len(entries) + 1)
        out[c] = average_precision(recall, precision)
    return out


def _recall(truths: list[torch.Tensor], found: list[torch.Tensor], iou: float) -> float:
    hit = total = 0
    for t, f in zip(truths, found, strict=True):
        total += len(t)
        if len(t) and len(f):
            hit += int((box_iou(t, f).max(dim=1).values >= iou).sum())
    return hit / max(total, 1)


@torch.no_grad()
def evaluate_detector(
    model: nn.Module,
    images: list[DetectionImage],
    images_root: Path,
    cfg: DetectorConfig,
    classes: list[str],
    attributes: list[str],
    device: torch.device | str = "cpu",
    batch_size: int = 16,
    progress: Callable | None = None,
) -> dict:
    """mAP@0.5 (VOC), recall of ground truth by detections and by proposals, class and
    attribute accuracy on ground-truth boxes (see the module docstring); plain data."""
    model.eval()
    items = DetectionItems(images, images_root, cfg, classes, attributes)
    jobs = [
        [(i, False) for i in range(s, min(s + batch_size, len(images)))]
        for s in range(0, len(images), batch_size)
    ]
    detections, truths, proposals = [], [], []
    class_hits = class_total = 0
    attr_scores: list[float] = []
    bar = progress(total=len(images)) if progress else None
    heads = model.roi_heads
    for batch in make_loader(items, jobs, cfg, cfg.seed):
        good = [b for b in batch if b["error"] is None]
        if not good:
            continue
        packed = batch_images([b["image"].to(device) for b in good])
        features, _ = backbone_with_conv5(model, packed.tensors)
        props, _ = model.rpn(packed, features)
        found, _ = heads(features, props, packed.image_sizes)
        gt_boxes = [b["target"]["boxes"].to(device) for b in good]
        gt_labels = [b["target"]["labels"].to(device) for b in good]
        pooled = heads.box_head(heads.box_roi_pool(features, gt_boxes, packed.image_sizes))
        labels = torch.cat(gt_labels)
        if len(labels):
            logits = heads.box_predictor.cls_score(pooled)
            class_hits += int((logits[:, 1:].argmax(dim=1) + 1 == labels).sum())
            class_total += len(labels)
        if heads.attribute_head is not None and len(labels):
            probs = heads.attributes(pooled, labels)[:, 1:]  # (G, A): without "none"
            targets = torch.cat([b["target"]["attributes"] for b in good])[:, 1:]
            for p, t in zip(probs.cpu(), targets, strict=True):
                k = int((t > 0).sum())
                if k:
                    top = p.topk(k).indices
                    attr_scores.append(float((t[top] > 0).sum()) / k)
        for f, p, g, lab in zip(found, props, gt_boxes, gt_labels, strict=True):
            detections.append({k: v.cpu() for k, v in f.items()})
            proposals.append(p.cpu())
            truths.append({"boxes": g.cpu(), "labels": lab.cpu()})
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    ap = voc_ap_per_class(detections, truths, len(classes) + 1, cfg.eval_iou)
    gt = [t["boxes"] for t in truths]
    metrics = {
        "val_images": len(truths),
        "val_boxes": sum(len(g) for g in gt),
        "map50": _round(float(np.mean(list(ap.values()))) if ap else 0.0),
        "recall": _round(_recall(gt, [d["boxes"] for d in detections], cfg.eval_iou)),
        "proposal_recall": _round(_recall(gt, proposals, cfg.eval_iou)),
        "class_accuracy": _round(class_hits / max(class_total, 1)),
        "ap50": {classes[c - 1]: _round(v) for c, v in ap.items()},
    }
    if attributes:
        metrics["attribute_accuracy"] = _round(float(np.mean(attr_scores)) if attr_scores else 0.0)
    return metrics


def _round(x: float) -> float:
    return round(float(x), 6)


def write_metrics(metrics: dict, path: Path) -> None:
    """The DVC metrics JSON (deterministic: no timings)."""
    write_json(path, metrics)


def plot_ap(metrics: dict, path: Path) -> None:
    """Per-class AP@0.5 bars (matplotlib Agg; no timestamps, so the PNG is deterministic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = metrics["ap50"]
    names = list(ap)
    shown = sorted(names, key=lambda n: (-ap[n], n))[:50]  # at most 50 bars, best first
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(shown) + 1.5), 3.4))
    ax.bar(range(len(shown)), [ap[n] for n in shown], color="#4c72b0")
    ax.set_xticks(range(len(shown)), shown, rotation=60, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("AP@0.5")
    more = f", top {len(shown)} of {len(names)}" if len(shown) < len(names) else ""
    ax.set_title(f"detector on val: mAP@0.5 {metrics['map50']:.3f}{more}", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png", metadata={"Software": None})
    plt.close(fig)
