"""Training and evaluation of the bottom-up detector (:mod:`features.detector`).

Training is Faster R-CNN's approximate joint training (Ren et al. 2015, sec. 3.2): one
loss, the sum of the RPN objectness and box terms, the head's classification and box
terms, and ``attribute_weight`` x the attribute term (Anderson et al. 2018); with
``image_loss_weight`` also that x an image-level multi-label term on the trunk's pooled
conv5 (not in the paper; see :class:`features.detector.ImageHead`). Images are
resized as the ``regions`` stage resizes them (shorter side ``min_side``, longer at most
``max_side``) and normalised alike, so the trained detector sees at extraction what it saw
in training. Optimiser: SGD with momentum or AdamW; linear warm-up, then step decay or a
cosine schedule, per iteration.

Deterministic: the image order and flips of epoch ``e`` come from ``(seed, e)``; the
RPN/RoI samplers draw from torch's global generator, seeded once and saved in ``last.pt``
with the optimiser and scheduler after every epoch, so ``resume`` ends bit-identical to an
uninterrupted run. Metrics hold no timings.

Evaluation on val (:func:`evaluate_detector`):

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

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import box_iou

from features.config import UserError
from features.detection_data import DetectionDataset, DetectionImage
from features.detector import (
    backbone_with_conv5,
    build_detector_model,
    detector_checkpoint,
    image_loss,
)
from features.device import resolve_device
from features.files import atomic_path, save_torch, write_json
from features.images import BadImage, load_image
from features.resume import restore_training, training_state
from features.visual import batch_images, resize_for_detection, to_tensor
from features.visual_config import DetectorConfig
from features.weights import checkpoint_kind, describe, load_exact, read_checkpoint, trunk_state

LAST = "last.pt"
FINAL = "detector.pt"
MAX_PIXELS = 89_478_485


class DetectorTrainingError(UserError):
    """Training cannot go on; the message says why and what was kept."""


# --------------------------------------------------------------------------- data


def attribute_targets(attributes: list[list[str]] | None, names: list[str], n: int):
    """(G, 1 + A) targets: uniform over each object's attributes, or "no attribute"."""
    index = {a: i + 1 for i, a in enumerate(names)}
    out = torch.zeros(n, len(names) + 1)
    for g in range(n):
        own = [index[a] for a in (attributes[g] if attributes else []) if a in index]
        if own:
            out[g, own] = 1.0 / len(own)
        else:
            out[g, 0] = 1.0
    return out


class DetectionItems(Dataset):
    """(image index, flip) -> the resized, normalised image and its targets; a bad image
    gives ``None`` (reported once, skipped)."""

    def __init__(
        self,
        images: list[DetectionImage],
        root: Path,
        cfg: DetectorConfig,
        classes: list[str],
        attributes: list[str],
    ):
        self.images, self.root, self.cfg = images, root, cfg
        self.class_index = {c: i + 1 for i, c in enumerate(classes)}
        self.attributes = attributes

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, job: tuple[int, bool]) -> dict:
        i, flip = job
        record = self.images[i]
        try:
            image = load_image(self.root / record.path, MAX_PIXELS)
        except BadImage as err:
            return {"index": i, "error": f"{record.path}: {err.reason} ({err.detail})"}
        resized, scale = resize_for_detection(image, self.cfg.min_side, self.cfg.max_side)
        tensor = to_tensor(resized)  # (3, h, w)
        boxes = torch.tensor(record.boxes, dtype=torch.float32).reshape(-1, 4) * scale
        w = tensor.shape[2]
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, tensor.shape[1])
        if flip:
            tensor = tensor.flip(2)
            boxes = torch.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], 1)
        labels = torch.tensor([self.class_index.get(n, 0) for n in record.names], dtype=torch.long)
        # names outside the class list are not trained on; nor are boxes that clipping to
        # the image left empty
        known = (labels > 0) & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        target = {"boxes": boxes[known], "labels": labels[known]}
        if self.attributes:
            attrs = record.attributes or [[] for _ in record.names]
            kept = [a for a, k in zip(attrs, known.tolist(), strict=True) if k]
            target["attributes"] = attribute_targets(kept, self.attributes, int(known.sum()))
        return {"index": i, "error": None, "image": tensor, "target": target}


def keep_list(items: list) -> list:
    return items


def epoch_jobs(n: int, cfg: DetectorConfig, epoch: int) -> list[list[tuple[int, bool]]]:
    """Batches of (image index, flip) for ``epoch``: a permutation and flips seeded by
    ``(seed, epoch)``; the tail that does not fill a batch is dropped."""
    rng = np.random.default_rng([cfg.seed, epoch])
    order = rng.permutation(n)
    flips = rng.random(n) < 0.5 if cfg.hflip else np.zeros(n, dtype=bool)
    steps = n // cfg.batch_size
    return [
        [(int(i), bool(flips[i])) for i in order[s * cfg.batch_size : (s + 1) * cfg.batch_size]]
        for s in range(steps)
    ]


def _loader(items: DetectionItems, batches, cfg: DetectorConfig, seed: int) -> DataLoader:
    return DataLoader(
        items,
        batch_sampler=batches,
        num_workers=cfg.num_workers,
        collate_fn=keep_list,
        generator=torch.Generator().manual_seed(seed),
    )


# --------------------------------------------------------------------------- model setup


def _initialise(model: nn.Module, cfg: DetectorConfig, log: Callable[[str], None]) -> None:
    """``init_weights``: ImageNet weights into the trunk (and the C4 res5 head), as the
    paper initialised its ResNet-101; or a torchvision detection state dict (all but a
    predictor of another class count, which stays random)."""
    if not cfg.init_weights:
        return
    param = "detector.init_weights"
    obj = read_checkpoint(cfg.init_weights, param)
    kind = checkpoint_kind(obj)
    source = f"{cfg.init_weights} ({describe(obj)})"
    what = f"the detector ({cfg.architecture})"
    if kind == "classification":
        state = trunk_state(obj, param)
        if cfg.is_c4:
            head = {k[7:]: v for k, v in state.items() if k.startswith("layer4.")}
            load_exact(model.roi_heads.box_head.layer4, head, param, what, source)
            state = {k: v for k, v in state.items() if not k.startswith("layer4.")}
        load_exact(model.backbone.body, state, param, what, source)
    elif kind in ("detection", "vse-detector"):
        state = obj["state_dict"] if kind == "vse-detector" else obj
        own = model.state_dict()
        heads = ("roi_heads.box_predictor.", "roi_heads.attribute_head.", "image_head.")
        # a predictor (attribute head, image head) for another class list stays random
        fresh = {
            k: v
            for k, v in own.items()
            if k.startswith(heads) and (k not in state or state[k].shape != v.shape)
        }
        state = {
            k: v
            for k, v in state.items()
            if k not in fresh and (k in own or not k.startswith(heads))
        }
        load_exact(model, {**state, **fresh}, param, what, source)
    else:
        raise DetectorTrainingError(f"{param}: {source} cannot initialise {what}")
    log(f"detector: initialised from {source}")


def _freeze(model: nn.Module, cfg: DetectorConfig) -> list[nn.Module]:
    """Freeze the trunk stages below ``trainable_layers`` (torchvision's convention) and,
    with ``freeze_bn``, every BatchNorm of the trunk; returns the frozen BatchNorms (they
    stay in eval mode while training)."""
    trainable = ["layer4", "layer3", "layer2", "layer1", "conv1"][: cfg.trainable_layers]
    if cfg.trainable_layers == 5:
        trainable.append("bn1")
    trunks = [("backbone.body.", model.backbone.body)]
    if cfg.is_c4:
        trunks.append(("roi_heads.box_head.", model.roi_heads.box_head))
    frozen_bn = []
    for _, trunk in trunks:
        for name, p in trunk.named_parameters():
            if not any(name.startswith(t) for t in trainable):
                p.requires_grad_(False)
        if cfg.freeze_bn:
            for m in trunk.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.requires_grad_(False)
                    frozen_bn.append(m)
    return frozen_bn


def _lr_factor(cfg: DetectorConfig, steps_per_epoch: int) -> Callable[[int], float]:
    total = cfg.epochs * steps_per_epoch

    def factor(step: int) -> float:
        warm = min(1.0, 0.001 + (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        if cfg.schedule == "cosine":
            return warm * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
        epoch = step // steps_per_epoch
        return warm * cfg.lr_decay ** sum(epoch >= e for e in cfg.lr_decay_epochs)

    return factor


def _losses(model: nn.Module, images: list[torch.Tensor], targets: list[dict], cfg) -> dict:
    """One forward pass of the detector in training mode: the loss terms."""
    batch = batch_images(images)
    features, conv5 = backbone_with_conv5(model, batch.tensors)
    proposals, rpn_losses = model.rpn(batch, features, targets)
    _, head_losses = model.roi_heads(features, proposals, batch.image_sizes, targets)
    losses = {**rpn_losses, **head_losses}
    if getattr(model, "image_head", None) is not None:
        num_classes = model.roi_heads.box_predictor.cls_score.out_features
        losses["loss_image"] = image_loss(model.image_head(conv5), targets, num_classes)
    return losses


# --------------------------------------------------------------------------- training


def train_detector(
    dataset: DetectionDataset,
    images_root: Path,
    cfg: DetectorConfig,
    out_dir: Path,
    *,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable | None = None,
) -> dict:
    """Train on ``dataset``'s train split, evaluate on its val split; writes
    ``out_dir/last.pt`` after every epoch (resumable) and ``out_dir/detector.pt`` (the
    ``vse-detector`` checkpoint) at the end. Returns the metrics (:func:`evaluate_detector`
    plus the last epoch's losses): plain, deterministic data for a DVC metrics file.

    ``progress(total=n)`` gives a bar (``update(k)``, ``close()``) per epoch.
    """
    out_dir = Path(out_dir)
    train_images, val_images = dataset.split("train"), dataset.split("val")
    if len(train_images) < cfg.batch_size:
        raise DetectorTrainingError(
            f"{len(train_images)} train images with boxes cannot fill one batch of "
            f"{cfg.batch_size}; lower detector.batch_size or give more data"
        )
    device = resolve_device(cfg.device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    try:
        return _train(
            dataset,
            train_images,
            val_images,
            images_root,
            cfg,
            out_dir,
            device,
            resume,
            log,
            progress,
        )
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _train(
    dataset, train_images, val_images, images_root, cfg, out_dir, device, resume, log, progress
) -> dict:
    classes, attributes = dataset.classes, dataset.attributes
    torch.manual_seed(cfg.seed)
    model = build_detector_model(cfg, len(classes) + 1, len(attributes))
    _initialise(model, cfg, log)
    frozen_bn = _freeze(model, cfg)
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(train_images) // cfg.batch_size
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(cfg, steps_per_epoch))
    identity = {
        "config": cfg.model_dump(mode="json"),
        "classes": classes,
        "attributes": attributes,
        "train_keys": [im.key for im in train_images],
    }
    history: list[dict] = []
    start = 0
    last_path = out_dir / LAST
    if resume and last_path.exists():
        ckpt = restore_training(
            last_path, identity, model, optimizer, scheduler, device, DetectorTrainingError
        )
        history, start = ckpt["history"], ckpt["epoch"] + 1
        log(f"detector: resuming from {last_path} after epoch {ckpt['epoch']}")
    elif resume:
        log(f"detector: --resume, but no {last_path} yet: starting from scratch")

    items = DetectionItems(train_images, images_root, cfg, classes, attributes)
    weights = {"loss_attribute": cfg.attribute_weight, "loss_image": cfg.image_loss_weight}
    skipped: set[int] = set()
    log(
        f"detector: {cfg.architecture}, {len(classes)} classes, {len(attributes)} attributes; "
        f"{len(train_images)} train / {len(val_images)} val images; {cfg.epochs} epochs of "
        f"{steps_per_epoch} steps on {device}"
    )
    for epoch in range(start, cfg.epochs):
        model.train()
        for m in frozen_bn:
            m.eval()
        tick, seen = time.perf_counter(), 0
        sums: dict[str, float] = {}
        batches = epoch_jobs(len(train_images), cfg, epoch)
        bar = progress(total=len(batches) * cfg.batch_size) if progress else None
        for step, batch in enumerate(_loader(items, batches, cfg, cfg.seed + epoch)):
            good = [b for b in batch if b["error"] is None]
            for b in batch:
                if b["error"] is not None and b["index"] not in skipped:
                    skipped.add(b["index"])
                    log(f"detector: skipping unreadable image {b['error']}")
            if not good:
                continue
            images = [b["image"].to(device) for b in good]
            targets = [{k: v.to(device) for k, v in b["target"].items()} for b in good]
            parts = _losses(model, images, targets, cfg)
            loss = sum(v * weights.get(k, 1.0) for k, v in parts.items())
            if not torch.isfinite(loss):
                kept = f"{last_path} (epoch {epoch - 1})" if epoch > 0 else "none yet"
                raise DetectorTrainingError(
                    f"detector: loss is {loss.item()} at epoch {epoch} step {step}; stopped. "
                    f"Kept the last good checkpoint: {kept}. Lower detector.lr or raise "
                    "detector.warmup_steps, then rerun with --resume"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            parts["loss"] = loss
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
            seen += len(batch)
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        row = {"epoch": epoch, **{k: round(v / len(batches), 6) for k, v in sums.items()}}
        row["lr"] = optimizer.param_groups[0]["lr"]
        history.append(row)
        seconds = time.perf_counter() - tick
        out_dir.mkdir(parents=True, exist_ok=True)
        save_torch(
            {
                **identity,
                **training_state(model, optimizer, scheduler, device),
                "epoch": epoch,
                "history": history,
            },
            last_path,
        )
        log(
            f"detector epoch {epoch + 1}/{cfg.epochs}: loss {row['loss']:.4f} "
            f"({', '.join(f'{k[5:]} {v:.3f}' for k, v in row.items() if k.startswith('loss_'))})"
            f", {seen / seconds:.1f} img/s, {seconds:.0f} s"
        )
    tick = time.perf_counter()
    metrics = evaluate_detector(
        model, val_images, images_root, cfg, classes, attributes, device, progress=progress
    )
    log(f"detector: evaluated {len(val_images)} val images in {time.perf_counter() - tick:.0f} s")
    metrics = {
        "train_images": len(train_images),
        "epochs": cfg.epochs,
        "last_epoch": history[-1] if history else {},
        "data": dataset.summary(),
        **metrics,
    }
    save_torch(detector_checkpoint(model, cfg, classes, attributes), out_dir / FINAL)
    return metrics


# --------------------------------------------------------------------------- evaluation


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
    device = torch.device(device)
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
    for batch in DataLoader(
        items, batch_sampler=jobs, num_workers=cfg.num_workers, collate_fn=keep_list
    ):
        good = [b for b in batch if b["error"] is None]
        if not good:
            continue
        packed = batch_images([b["image"].to(device) for b in good])
        features = model.backbone(packed.tensors)
        if not isinstance(features, dict):
            features = {"0": features}
        props, _ = model.rpn(ImageList(packed.tensors, packed.image_sizes), features)
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
