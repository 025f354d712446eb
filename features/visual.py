"""Visual features: Faster R-CNN regions (bottom-up attention), 7x7 grids, global vectors.

Extractors are pure modules built by the stage's entry point and passed in (tests pass
random-init ones). Each has a ``prepare`` step that runs in DataLoader workers (resize,
normalise: CPU work overlapped with inference) and a batched ``__call__`` that runs the
network and returns per-image numpy outputs. :mod:`features.extract` drives them.

Regions follow the bottom-up-attention recipe (Anderson et al. 2018, ``generate_tsv.py``):
the box head's pooled feature of each RPN proposal; per class, NMS over the proposals at
IoU ``nms_iou``; a proposal's confidence is its best class score among the classes for
which it survives NMS; keep proposals with confidence >= ``conf_threshold``, at least
``min_boxes`` and at most ``max_boxes`` of them (the top ones by confidence). Boxes are
the proposals' boxes in original-image pixels, as in the reference tool.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch import nn
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import batched_nms

from features.store import FieldSpec
from features.visual_config import ExtractConfig, GridConfig, RegionsConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Part of every store fingerprint: bump it with any change that alters extracted features,
# or a persisted store made by the old code is kept (its fingerprint still matches).
EXTRACTOR_VERSION = "1"


# --------------------------------------------------------------------------- weights


def weights_digest(path: str | None, seed: int) -> str:
    """SHA-256 of a checkpoint file, or a distinct tag for random initialisation."""
    if path is None:
        return f"random-init-seed-{seed}"
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"weights {path}: no such file; give a local checkpoint path (nothing is "
            "downloaded), or set weights: null for random initialisation"
        )
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_weights(model: nn.Module, path: str | None, seed: int, what: str) -> None:
    """Load a local checkpoint (weights only), or warn loudly about random weights."""
    if path is None:
        warnings.warn(
            f"{what}: NO WEIGHTS GIVEN, using RANDOM initialisation (seed {seed}). Features "
            "are only useful for testing the pipeline; set `weights:` to a local checkpoint "
            "for real runs. The store's fingerprint records the random init.",
            stacklevel=2,
        )
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"weights {path} do not fit the {what} model: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}); "
            "check the architecture / num_classes params"
        )


def _resnet(depth: int) -> torchvision.models.ResNet:
    return getattr(torchvision.models, f"resnet{depth}")(weights=None)


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda requested but torch.cuda.is_available() is False")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def _autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op on CPU (full precision)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def zeros(fields: dict[str, FieldSpec]) -> dict[str, np.ndarray]:
    return {name: np.zeros(spec.shape, dtype=spec.dtype) for name, spec in fields.items()}


def feature_params(cfg: ExtractConfig) -> dict:
    """The params that change the features, for the fingerprint (the weights enter as their
    digest; batch size, workers, device and error threshold do not change a feature)."""
    return cfg.model_dump(
        exclude={"batch_size", "num_workers", "device", "weights", "max_error_fraction"}
    )


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> normalised (3, H, W) float tensor."""
    array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (array - mean) / std


# --------------------------------------------------------------------------- regions


class Res5Head(nn.Module):
    """The C4 box head: ResNet's res5 stage on 14x14 RoI features, then average pooling."""

    def __init__(self, layer4: nn.Module):
        super().__init__()
        self.layer4 = layer4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (P, 1024, 14, 14) -> (P, 2048)
        return self.layer4(x).mean(dim=(2, 3))


def build_c4_detector(depth: int, num_classes: int, proposals: int, stages: int = 4) -> nn.Module:
    """Faster R-CNN with a ResNet C4 backbone (stem..res4, stride 16) and res5 box head,
    the bottom-up-attention architecture, assembled from torchvision parts. ``stages < 4``
    moves the head down: stage ``stages`` is the head, the stages before it the backbone."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    resnet = _resnet(depth)
    layers = [resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4]
    backbone = nn.Sequential(
        resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool, *layers[: stages - 1]
    )
    backbone.out_channels = 256 * 2 ** (stages - 2)  # bottleneck ResNets
    dim = 2 * backbone.out_channels
    return FasterRCNN(
        backbone,
        rpn_anchor_generator=AnchorGenerator(((32, 64, 128, 256, 512),), ((0.5, 1.0, 2.0),)),
        box_roi_pool=MultiScaleRoIAlign(["0"], output_size=14, sampling_ratio=0),
        box_head=Res5Head(layers[stages - 1]),
        box_predictor=FastRCNNPredictor(dim, num_classes),
        rpn_pre_nms_top_n_test=6000,
        rpn_post_nms_top_n_test=proposals,
    )


def build_detector(cfg: RegionsConfig) -> nn.Module:
    """The torchvision detector of ``cfg.architecture``, weights loaded (or random)."""
    torch.manual_seed(cfg.seed)
    if cfg.architecture == "resnet50_fpn":
        from torchvision.models.detection import fasterrcnn_resnet50_fpn

        model = fasterrcnn_resnet50_fpn(
            weights=None,
            weights_backbone=None,
            num_classes=cfg.num_classes,
            rpn_post_nms_top_n_test=cfg.proposals,
        )
    else:
        depth = 101 if cfg.architecture == "resnet101_c4" else 50
        model = build_c4_detector(depth, cfg.num_classes, cfg.proposals, cfg.stages)
    load_weights(model, cfg.weights, cfg.seed, f"regions ({cfg.architecture})")
    return model.eval()


def butd_select(
    boxes: torch.Tensor, scores: torch.Tensor, cfg: RegionsConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bottom-up-attention region selection; returns kept indices, their class, confidence.

    ``scores`` (P, C) are softmax class probabilities with background in column 0. Per
    class c >= 1, NMS over all proposals by ``scores[:, c]`` at IoU ``nms_iou``; a
    proposal's confidence is its best score among the classes where it survives.
    """
    n, c = scores.shape
    pair_box = torch.arange(n).repeat_interleave(c - 1)  # all (box, foreground class) pairs
    pair_class = torch.arange(c - 1).repeat(n)
    pair_score = scores[:, 1:].reshape(-1)
    survive = batched_nms(boxes[pair_box].float(), pair_score.float(), pair_class, cfg.nms_iou)
    surviving = torch.full((n, c - 1), -1.0)  # score of (box, class) pairs that survive NMS
    surviving.view(-1)[survive] = pair_score[survive].float()
    confidence, best_class = surviving.max(dim=1)
    confidence = confidence.clamp(min=0.0)  # a box suppressed in every class: confidence 0
    ranked = torch.argsort(confidence, descending=True, stable=True)
    n_keep = int((confidence >= cfg.conf_threshold).sum())
    n_keep = min(max(n_keep, cfg.min_boxes), cfg.max_boxes, n)
    keep = ranked[:n_keep]
    return keep, best_class[keep] + 1, confidence[keep]


def resize_for_detection(image: Image.Image, min_side: int, max_side: int):
    """Shorter side to ``min_side`` unless the longer would pass ``max_side``."""
    w, h = image.size
    scale = min(min_side / min(w, h), max_side / max(w, h))
    size = (max(round(w * scale), 1), max(round(h * scale), 1))
    return image.resize(size, Image.BILINEAR), scale


def batch_images(tensors: Sequence[torch.Tensor], divisible: int = 32) -> ImageList:
    """Zero-pad (3, H, W) tensors to one batch (sizes rounded up to ``divisible``)."""
    h = max(t.shape[1] for t in tensors)
    w = max(t.shape[2] for t in tensors)
    h, w = -(-h // divisible) * divisible, -(-w // divisible) * divisible
    batch = tensors[0].new_zeros((len(tensors), 3, h, w))
    for i, t in enumerate(tensors):
        batch[i, :, : t.shape[1], : t.shape[2]] = t
    return ImageList(batch, [tuple(t.shape[1:]) for t in tensors])


class RegionExtractor:
    """Region features from a torchvision Faster R-CNN, or at given boxes (``given``)."""

    kind = "regions"

    def __init__(self, model: nn.Module, cfg: RegionsConfig, device: torch.device):
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        self.given = cfg.backend == "given"
        self.dim = model.roi_heads.box_predictor.cls_score.in_features
        self.width = cfg.max_boxes

    @property
    def name(self) -> str:
        return f"regions-{self.cfg.backend}-{self.cfg.architecture}"

    def fields(self) -> dict[str, FieldSpec]:
        r = self.width
        return {
            "features": FieldSpec((r, self.dim), "float16"),
            "boxes": FieldSpec((r, 4), "float32"),
            "classes": FieldSpec((r,), "int32"),
            "scores": FieldSpec((r,), "float32"),
            "n_regions": FieldSpec((), "int32"),
            "image_hw": FieldSpec((2,), "int32"),
        }

    def prepare(self, image: Image.Image, row: dict) -> dict[str, Any]:
        """In a DataLoader worker: resize and normalise; scale given boxes alike."""
        resized, scale = resize_for_detection(image, self.cfg.min_side, self.cfg.max_side)
        item = {"image": to_tensor(resized), "scale": scale, "hw": image.size[::-1]}
        if self.given:
            boxes = np.asarray(row.get("boxes") or np.zeros((0, 4)), dtype=np.float32)
            item["boxes"] = torch.from_numpy(boxes[: self.width]).reshape(-1, 4)
        return item

    @torch.no_grad()
    def __call__(self, items: list[dict]) -> list[dict[str, np.ndarray]]:
        rois, pooled, logits = self._forward(items)
        pooled = pooled.float().cpu()
        scores = F.softmax(logits.float(), dim=-1).cpu()
        outputs = []
        start = 0
        for it, boxes in zip(items, rois, strict=True):
            n = len(boxes)
            feats, probs = pooled[start : start + n], scores[start : start + n]
            start += n
            boxes = boxes.float().cpu() / it["scale"]  # back to original-image pixels
            if self.given:
                keep = torch.arange(n)
                classes = torch.full((n,), -1, dtype=torch.long)
                confidence = torch.ones(n)
            else:
                keep, classes, confidence = butd_select(boxes, probs, self.cfg)
            outputs.append(self._pack(feats[keep], boxes[keep], classes, confidence, it["hw"]))
        return outputs

    def _forward(self, items: list[dict]):
        """RoIs per image (resized pixels), their pooled box-head features (sum P, D) and
        class logits (sum P, C)."""
        images = batch_images([it["image"] for it in items])
        images = ImageList(images.tensors.to(self.device, non_blocking=True), images.image_sizes)
        with _autocast(self.device):
            feature_maps = self.model.backbone(images.tensors)
            if not isinstance(feature_maps, dict):
                feature_maps = {"0": feature_maps}
            if self.given:
                rois = [(it["boxes"] * it["scale"]).to(self.device) for it in items]
            else:
                rois, _ = self.model.rpn(images, feature_maps)
            heads = self.model.roi_heads
            pooled = heads.box_head(heads.box_roi_pool(feature_maps, rois, images.image_sizes))
            logits, _ = heads.box_predictor(pooled)
        return rois, pooled, logits

    def _pack(self, feats, boxes, classes, confidence, hw) -> dict[str, np.ndarray]:
        out = self.empty()
        n = len(feats)
        out["features"][:n] = feats.numpy()
        out["boxes"][:n] = boxes.numpy()
        out["classes"][:n] = classes.numpy()
        out["scores"][:n] = confidence.numpy()
        out["n_regions"] = np.int32(n)
        out["image_hw"] = np.asarray(hw, dtype=np.int32)
        return out

    def empty(self) -> dict[str, np.ndarray]:
        """The record of an image that could not be read: no regions."""
        return zeros(self.fields())

    def provenance_params(self) -> dict:
        return feature_params(self.cfg)


# --------------------------------------------------------------------------- grid


class ResNetTrunk(nn.Module):
    """ResNet up to conv5 (layer4): (B, 3, H, W) -> (B, 2048, H/32, W/32); with
    ``stages < 4`` up to that stage: (B, 256 * 2^(stages-1), H/2^(stages+1), ...)."""

    def __init__(self, depth: int, stages: int = 4):
        super().__init__()
        resnet = _resnet(depth)
        self.body = nn.Sequential(*list(resnet.children())[: 4 + stages])  # stem + stages
        self.dim = 256 * 2 ** (stages - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build_trunk(cfg: GridConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = ResNetTrunk(int(cfg.architecture.removeprefix("resnet")), cfg.stages)
    load_weights(model.body, cfg.weights, cfg.seed, f"grid ({cfg.architecture})")
    return model.eval()


class GridExtractor:
    """conv5 map adaptively average-pooled to ``grid x grid`` (UniVSE), and the map's mean
    over all positions (the global pooled feature of VSE++)."""

    kind = "grid"

    def __init__(self, model: nn.Module, cfg: GridConfig, device: torch.device):
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        self.dim = model.dim

    @property
    def name(self) -> str:
        return f"grid-{self.cfg.architecture}"

    def fields(self) -> dict[str, FieldSpec]:
        g = self.cfg.grid
        return {
            "features": FieldSpec((g, g, self.dim), "float16"),
            "pooled": FieldSpec((self.dim,), "float32"),
            "image_hw": FieldSpec((2,), "int32"),
        }

    def prepare(self, image: Image.Image, row: dict) -> dict[str, Any]:
        size = self.cfg.image_size
        w, h = image.size
        scale = size / min(w, h)
        resized = image.resize(
            (max(round(w * scale), size), max(round(h * scale), size)), Image.BILINEAR
        )
        left = (resized.width - size) // 2
        top = (resized.height - size) // 2
        crop = resized.crop((left, top, left + size, top + size))
        return {"image": to_tensor(crop), "hw": (h, w)}

    @torch.no_grad()
    def __call__(self, items: list[dict]) -> list[dict[str, np.ndarray]]:
        batch = torch.stack([it["image"] for it in items]).to(self.device, non_blocking=True)
        with _autocast(self.device):
            conv5 = self.model(batch).float()  # (B, 2048, h, w)
        grid = F.adaptive_avg_pool2d(conv5, self.cfg.grid).permute(0, 2, 3, 1).cpu().numpy()
        pooled = conv5.mean(dim=(2, 3)).cpu().numpy()
        return [
            {"features": g, "pooled": p, "image_hw": np.asarray(it["hw"], dtype=np.int32)}
            for g, p, it in zip(grid, pooled, items, strict=True)
        ]

    def empty(self) -> dict[str, np.ndarray]:
        return zeros(self.fields())

    def provenance_params(self) -> dict:
        return feature_params(self.cfg)
