"""The detectron2 backend of ``vse extract regions`` (used when ``import detectron2`` works).

For the original bottom-up-attention weights (Visual Genome, ResNet-101 C4, 1600 classes)
converted for detectron2, e.g. by the py-bottom-up-attention project: set
``regions.backend: detectron2``, ``regions.detectron2_config`` to its YAML config and
``regions.weights`` to its checkpoint. Install detectron2 from source against the
installed torch (it is not on PyPI):
``pip install 'git+https://github.com/facebookresearch/detectron2.git'``.

Only the forward pass differs from the torchvision backend; resizing, region selection
(:func:`features.images.select.butd_select`) and packing are shared.
"""

from __future__ import annotations

import numpy as np
import torch

from features.detector.inputs import batch_images, resize_for_detection
from features.images.config import RegionsConfig
from features.images.regions import RegionExtractor
from infra.config import UserError


def build_detectron2_extractor(cfg: RegionsConfig, device: torch.device) -> RegionExtractor:
    """The detectron2 model of ``cfg``; its checks come before the import, so they hold
    (and are tested) where detectron2 is absent."""
    if not cfg.detectron2_config or not cfg.weights:
        raise UserError(
            "regions.backend detectron2 needs regions.detectron2_config (a YAML config) and "
            "regions.weights (a local checkpoint)"
        )
    if cfg.weights.endswith(".pkl") and not cfg.allow_pickle_weights:
        raise UserError(
            f"regions.weights {cfg.weights}: a .pkl checkpoint is a pickle, which can run code "
            "when loaded; convert it to .pth, or set regions.allow_pickle_weights: true if "
            "you trust its source"
        )
    try:
        from detectron2.checkpoint import DetectionCheckpointer
        from detectron2.config import get_cfg
        from detectron2.modeling import build_model
    except ImportError:
        raise UserError(
            "regions.backend is detectron2, but detectron2 is not installed: install it from "
            "source (pip install 'git+https://github.com/facebookresearch/detectron2.git') "
            "or set regions.backend: torchvision"
        ) from None
    d2cfg = get_cfg()
    d2cfg.merge_from_file(cfg.detectron2_config)
    d2cfg.MODEL.DEVICE = device.type
    d2cfg.MODEL.RPN.POST_NMS_TOPK_TEST = cfg.proposals
    model = build_model(d2cfg).eval()
    DetectionCheckpointer(model).load(cfg.weights)
    return Detectron2RegionExtractor(model, cfg, device)


class Detectron2RegionExtractor(RegionExtractor):
    """A C4 (Res5ROIHeads) detectron2 model in place of the torchvision one."""

    def __init__(self, model, cfg: RegionsConfig, device: torch.device):
        self.model, self.cfg, self.device = model, cfg, device
        self.given = False
        self.dim = model.roi_heads.box_predictor.cls_score.in_features
        self.width = cfg.max_boxes

    @property
    def name(self) -> str:
        from pathlib import Path

        return f"regions-detectron2-{Path(self.cfg.detectron2_config or 'model').stem}"

    def prepare(self, image, row):
        """detectron2 models take BGR 0..255 and normalise with their own pixel mean/std."""
        resized, scale = resize_for_detection(image, self.cfg.min_side, self.cfg.max_side)
        bgr = torch.from_numpy(np.ascontiguousarray(np.asarray(resized)[:, :, ::-1]))
        return {"image": bgr.permute(2, 0, 1).float(), "scale": scale, "hw": image.size[::-1]}

    def _forward(self, items):
        from detectron2.structures import ImageList

        mean, std = self.model.pixel_mean, self.model.pixel_std
        tensors = [((it["image"].to(self.device) - mean) / std) for it in items]
        padded = batch_images(tensors)
        images = ImageList(padded.tensors, padded.image_sizes)
        features = self.model.backbone(images.tensor)
        proposals, _ = self.model.proposal_generator(images, features, None)
        boxes = [p.proposal_boxes for p in proposals]
        heads = self.model.roi_heads
        box_features = heads._shared_roi_transform([features[f] for f in heads.in_features], boxes)
        pooled = box_features.mean(dim=(2, 3))  # (sum P, 2048)
        logits, _ = heads.box_predictor(pooled)
        return [b.tensor for b in boxes], pooled, logits
