"""Training of the bottom-up detector, then its evaluation on val (:mod:`.metrics`).

Training is Faster R-CNN's approximate joint training (Ren et al. 2015, sec. 3.2): one
loss, the sum of the RPN objectness and box terms, the head's classification and box
terms, and ``attribute_weight`` x the attribute term (Anderson et al. 2018); with
``image_loss_weight`` also that x an image-level multi-label term on the trunk's pooled
conv5 (not in the paper; see :class:`features.detector.model.ImageHead`). Images are
resized as the ``regions`` stage resizes them (shorter side ``min_side``, longer at most
``max_side``) and normalised alike, so the trained detector sees at extraction what it saw
in training. Optimiser: SGD with momentum or AdamW; linear warm-up, then step decay or a
cosine schedule, per iteration.

Deterministic: the image order and flips of epoch ``e`` come from ``(seed, e)``; the
RPN/RoI samplers draw from torch's global generator, seeded once and saved in ``last.pt``
(:class:`infra.trainer.Trainer`: after epochs, within them and on SIGTERM or SIGINT) with
the step reached, so ``resume`` ends bit-identical to an uninterrupted run. Metrics hold no
timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from features.detector.config import DetectorConfig
from features.detector.data import DetectionDataset
from features.detector.inputs import batch_images
from features.detector.loader import DetectionItems, epoch_jobs, make_loader
from features.detector.metrics import evaluate_detector
from features.detector.model import (
    backbone_with_conv5,
    build_detector_model,
    detector_checkpoint,
    image_loss,
)
from features.detector.weights import (
    checkpoint_format,
    describe,
    load_exact,
    load_trunk,
    read_checkpoint,
    trunk_state,
)
from infra.config import UserError
from infra.device import resolve_device
from infra.files import save_torch
from infra.kernels import adamw
from infra.schedule import lr_factor
from infra.trainer import Trainer

LAST = "last.pt"
FINAL = "detector.pt"
# settings that do not change the result: a run may resume under others
NOT_IDENTITY = ("checkpoint_every_steps", "checkpoint_every_minutes")


class DetectorTrainingError(UserError):
    """Training cannot go on; the message says why and what was kept."""


def _initialise(model: nn.Module, cfg: DetectorConfig, log: Callable[[str], None]) -> None:
    """``init_weights``: ImageNet weights into the trunk (and the C4 res5 head), as the
    paper initialised its ResNet-101; or a torchvision detection state dict (all but a
    predictor of another class count, which stays random)."""
    if not cfg.init_weights:
        return
    param = "detector.init_weights"
    obj = read_checkpoint(cfg.init_weights, param)
    fmt = checkpoint_format(obj)
    source = f"{cfg.init_weights} ({describe(obj)})"
    what = f"the detector ({cfg.architecture})"
    if fmt == "classification":
        load_trunk(model, trunk_state(obj, param), cfg.is_c4, param, what, source)
    elif fmt in ("detection", "vse-detector"):
        state = obj["state_dict"] if fmt == "vse-detector" else obj
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
    trunks = [model.backbone.body]
    if cfg.is_c4:
        trunks.append(model.roi_heads.box_head)
    frozen_bn = []
    for trunk in trunks:
        for name, p in trunk.named_parameters():
            if not name.startswith(tuple(trainable)):
                p.requires_grad_(False)
        if cfg.freeze_bn:
            for m in trunk.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.requires_grad_(False)
                    frozen_bn.append(m)
    return frozen_bn


def _losses(model: nn.Module, images: list[torch.Tensor], targets: list[dict]) -> dict:
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
    train_images = dataset.split("train")
    if len(train_images) < cfg.batch_size:
        raise DetectorTrainingError(
            f"{len(train_images)} train images with boxes cannot fill one batch of "
            f"{cfg.batch_size}; lower detector.batch_size or give more data"
        )
    device = resolve_device(cfg.device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    try:
        return _train(dataset, images_root, cfg, Path(out_dir), device, resume, log, progress)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _train(dataset, images_root, cfg, out_dir, device, resume, log, progress) -> dict:
    train_images, val_images = dataset.split("train"), dataset.split("val")
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
        optimizer = adamw(params, cfg.lr, cfg.weight_decay)
    steps_per_epoch = len(train_images) // cfg.batch_size
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lr_factor(
            steps_per_epoch,
            cfg.warmup_steps,
            cfg.lr_decay,
            cfg.lr_decay_epochs,
            cosine_epochs=cfg.epochs if cfg.schedule == "cosine" else None,
            warm_start=0.001,
        ),
    )
    identity = {
        "config": cfg.model_dump(mode="json", exclude=set(NOT_IDENTITY)),
        "classes": classes,
        "attributes": attributes,
        "train_keys": [im.key for im in train_images],
    }
    trainer = Trainer(
        "detector",
        model,
        optimizer,
        scheduler,
        identity=identity,
        last_path=out_dir / LAST,
        device=device,
        error=DetectorTrainingError,
        log=log,
        every_steps=cfg.checkpoint_every_steps,
        every_minutes=cfg.checkpoint_every_minutes,
    )
    if resume:
        trainer.resume()
    items = DetectionItems(train_images, images_root, cfg, classes, attributes)
    log(
        f"detector: {cfg.architecture}, {len(classes)} classes, {len(attributes)} attributes; "
        f"{len(train_images)} train / {len(val_images)} val images; {cfg.epochs} epochs of "
        f"{steps_per_epoch} steps on {device}"
    )
    weights = {"loss_attribute": cfg.attribute_weight, "loss_image": cfg.image_loss_weight}
    skipped: set[int] = set()  # unreadable images, reported once
    speed = {"seen": 0, "seconds": 0.0}  # of the last epoch

    def step(good: list[dict], sums: dict[str, float], epoch: int, i: int) -> None:
        """One optimizer step on the readable images of a batch; adds its terms to ``sums``."""
        images = [b["image"].to(device) for b in good]
        targets = [{k: v.to(device) for k, v in b["target"].items()} for b in good]
        parts = _losses(model, images, targets)
        loss = sum(v * weights.get(k, 1.0) for k, v in parts.items())
        if not torch.isfinite(loss):
            kept = str(trainer.last_path) if trainer.last_path.exists() else "none yet"
            raise DetectorTrainingError(
                f"detector: loss is {loss.item()} at epoch {epoch} step {i}; stopped. "
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

    def run_epoch(epoch: int, within: dict | None) -> dict:
        """One epoch of steps, from a step checkpoint's ``within`` on (the loader is given only
        the batches after it); returns the history row (mean loss terms, lr). After each
        step the trainer decides whether ``last.pt`` is written."""
        tick = time.perf_counter()
        model.train()
        for m in frozen_bn:
            m.eval()
        batches = epoch_jobs(len(items), cfg, epoch)
        first, seen, sums = 0, 0, {}
        if within is not None:
            first, seen, sums = within["step"], within["seen"], dict(within["sums"])
            skipped.update(within["skipped"])
        bar = progress(total=len(batches) * cfg.batch_size) if progress else None
        if bar is not None and first:
            bar.update(first * cfg.batch_size)
        loader = make_loader(items, batches[first:], cfg, cfg.seed + epoch)
        for i, batch in enumerate(loader, first):
            good = [b for b in batch if b["error"] is None]
            for b in batch:
                if b["error"] is not None and b["index"] not in skipped:
                    skipped.add(b["index"])
                    log(f"detector: skipping unreadable image {b['error']}")
            if good:
                step(good, sums, epoch, i)
            seen += len(batch)
            if bar is not None:
                bar.update(len(batch))
            trainer.step_done(
                epoch,
                i + 1,
                len(batches),
                lambda seen=seen: {"seen": seen, "sums": dict(sums), "skipped": sorted(skipped)},
            )
        if bar is not None:
            bar.close()
        row = {"epoch": epoch, **{k: round(v / len(batches), 6) for k, v in sums.items()}}
        row["lr"] = optimizer.param_groups[0]["lr"]
        speed.update(seen=seen, seconds=time.perf_counter() - tick)
        return row

    def after_save(epoch: int, row: dict, state: dict) -> None:
        log(
            f"detector epoch {epoch + 1}/{cfg.epochs}: loss {row['loss']:.4f} ("
            + ", ".join(f"{k[5:]} {v:.3f}" for k, v in row.items() if k.startswith("loss_"))
            + f"), {speed['seen'] / speed['seconds']:.1f} img/s, {speed['seconds']:.0f} s"
        )

    history = trainer.fit(cfg.epochs, run_epoch, after_save=after_save)
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
