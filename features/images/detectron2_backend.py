"""The detectron2 backend of ``vse extract regions``: the published bottom-up-attention
checkpoints on upstream detectron2, built from source (it is not on PyPI: see the docs' tutorial
``tutorials/butd-weights.md``).

py-bottom-up-attention ran them on its own fork of a 2020 detectron2, whose additions this
module registers on upstream detectron2, so that its YAML configs (e.g.
``configs/VG-Detection/faster_rcnn_R_101_C4_attr_caffemaxpool.yaml``) load unchanged:

- config keys ``MODEL.CAFFE_MAXPOOL``, ``MODEL.PROPOSAL_GENERATOR.HID_CHANNELS``,
  ``MODEL.ROI_BOX_HEAD.RES5HALVE``, ``.ATTR``, ``.NUM_ATTRS``;
- the Caffe stem max-pool (3x3 / 2, no padding, ceil mode): backbone
  ``build_butd_caffe_resnet_backbone``;
- the RPN's hidden width: upstream's ``MODEL.RPN.CONV_DIMS``;
- res5 at stride 1 with dilation 2 (``RES5HALVE: False``) and the attribute head
  (Anderson et al. 2018, Sec. 3.1): ROI heads ``ButdRes5ROIHeads``.

Resizing, region selection (:func:`features.images.select.butd_select`) and the records
are the native route's (:class:`features.images.butd.extractor.ButdRegionExtractor`);
only the network is detectron2's. Not covered: MILVLG's own YAML (its meta-architecture
``GeneralizedBUARCNN`` and ``MODEL.BUA.*`` keys); its ``.pth`` runs on the native route.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from features.detector.weights import pickle_refused
from features.images.butd.extractor import ButdRegionExtractor
from features.images.butd.model import ButdSpec
from features.images.config import RegionsConfig
from infra.config import UserError

INSTALL = (
    "build it from source against the installed torch (pip install --no-build-isolation "
    "<detectron2 source>, see docs/tutorials/butd-weights.md) or set regions.backend: "
    "torchvision (the native model reads the same checkpoints)"
)


@functools.cache
def register() -> None:
    """Register the fork's backbone and ROI heads with detectron2 (once)."""
    from detectron2.layers import ShapeSpec
    from detectron2.modeling import BACKBONE_REGISTRY, ROI_HEADS_REGISTRY
    from detectron2.modeling.backbone.resnet import BasicStem, build_resnet_backbone
    from detectron2.modeling.roi_heads import Res5ROIHeads
    from detectron2.modeling.roi_heads.fast_rcnn import FastRCNNOutputLayers

    class CaffeMaxPoolStem(BasicStem):
        def forward(self, x):
            x = F.relu_(self.conv1(x))
            return F.max_pool2d(x, kernel_size=3, stride=2, padding=0, ceil_mode=True)

    @BACKBONE_REGISTRY.register()
    def build_butd_caffe_resnet_backbone(cfg, input_shape):
        backbone = build_resnet_backbone(cfg, input_shape)
        backbone.stem.__class__ = CaffeMaxPoolStem  # same weights, Caffe's pooling
        return backbone

    class AttributeOutputLayers(FastRCNNOutputLayers):
        """Upstream's predictor plus the attribute head: embedding of the argmax class
        (d/8), concatenated with the region feature, d/4 units with ReLU, attributes."""

        def __init__(self, cfg, input_shape, num_attrs: int):
            super().__init__(cfg, input_shape)
            d, c = input_shape.channels, cfg.MODEL.ROI_HEADS.NUM_CLASSES + 1
            self.cls_embedding = nn.Embedding(c, d // 8)
            self.fc_attr = nn.Linear(d + d // 8, d // 4)
            self.attr_score = nn.Linear(d // 4, num_attrs + 1)

        def attributes(self, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            embedded = self.cls_embedding(scores.argmax(dim=1))  # (P, d/8)
            return self.attr_score(F.relu(self.fc_attr(torch.cat([x, embedded], dim=1))))

    @ROI_HEADS_REGISTRY.register()
    class ButdRes5ROIHeads(Res5ROIHeads):
        @classmethod
        def from_config(cls, cfg, input_shape):
            ret = super().from_config(cfg, input_shape)
            box = cfg.MODEL.ROI_BOX_HEAD
            if not box.RES5HALVE:  # stride 1, dilation 2 (the Caffe model's res5)
                res5 = ret["res5"]
                res5[0].conv1.stride = (1, 1)
                res5[0].shortcut.stride = (1, 1)
                for block in res5:
                    block.conv2.padding, block.conv2.dilation = (2, 2), (2, 2)
            if box.ATTR:
                channels = ret["box_predictor"].cls_score.in_features
                shape = ShapeSpec(channels=channels, height=1, width=1)
                ret["box_predictor"] = AttributeOutputLayers(cfg, shape, box.NUM_ATTRS)
            return ret


def butd_config(path: str):
    """A detectron2 config read from ``path``, with the fork's keys known and mapped onto
    upstream's (and the registered parts)."""
    from detectron2.config import CfgNode, get_cfg

    cfg = get_cfg()
    cfg.MODEL.CAFFE_MAXPOOL = False
    cfg.MODEL.PROPOSAL_GENERATOR.HID_CHANNELS = -1
    cfg.MODEL.ROI_BOX_HEAD.RES5HALVE = True
    cfg.MODEL.ROI_BOX_HEAD.ATTR = False
    cfg.MODEL.ROI_BOX_HEAD.NUM_ATTRS = -1
    assert isinstance(cfg, CfgNode)
    cfg.merge_from_file(path)
    if cfg.MODEL.CAFFE_MAXPOOL:
        cfg.MODEL.BACKBONE.NAME = "build_butd_caffe_resnet_backbone"
    if cfg.MODEL.PROPOSAL_GENERATOR.HID_CHANNELS > 0:
        cfg.MODEL.RPN.CONV_DIMS = [cfg.MODEL.PROPOSAL_GENERATOR.HID_CHANNELS]
    box = cfg.MODEL.ROI_BOX_HEAD
    if cfg.MODEL.ROI_HEADS.NAME == "Res5ROIHeads" and (box.ATTR or not box.RES5HALVE):
        cfg.MODEL.ROI_HEADS.NAME = "ButdRes5ROIHeads"
    return cfg


class Detectron2Butd(nn.Module):
    """A detectron2 C4 model behind :class:`ButdModel`'s interface: proposals, region
    features (P, D), class probabilities with background first, attribute probabilities
    without "no attribute"."""

    def __init__(self, model, cfg: RegionsConfig):
        super().__init__()
        self.model = model
        self.roi_heads = model.roi_heads
        if not torch.equal(model.pixel_std.cpu(), torch.ones_like(model.pixel_std.cpu())):
            raise UserError(
                f"{cfg.detectron2_config}: MODEL.PIXEL_STD must be [1, 1, 1] for the "
                "bottom-up-attention weights (Caffe input: BGR minus the pixel means)"
            )
        self.pixel_mean = model.pixel_mean.detach().cpu().view(3, 1, 1)
        predictor = model.roi_heads.box_predictor
        attrs = predictor.attr_score.out_features if hasattr(predictor, "attr_score") else 0
        self.spec = ButdSpec(num_classes=predictor.cls_score.out_features, num_attrs=attrs)
        self.architecture = Path(cfg.detectron2_config or "model").stem

    def forward(self, images: list[torch.Tensor], rois=None):
        """As detectron2 runs a batch: the images zero-padded to one size."""
        from detectron2.structures import Boxes, ImageList

        d2 = self.model
        batch = ImageList.from_tensors(images)
        features = d2.backbone(batch.tensor)
        if rois is None:
            proposals, _ = d2.proposal_generator(batch, features, None)
            boxes = [p.proposal_boxes for p in proposals]
        else:
            boxes = [Boxes(r) for r in rois]
        heads = d2.roi_heads
        pooled = heads._shared_roi_transform([features[f] for f in heads.in_features], boxes)
        pooled = pooled.mean(dim=(2, 3))  # (P, D)
        logits, _ = heads.box_predictor(pooled)
        probs = logits.float().softmax(dim=1)
        probs = torch.cat([probs[:, -1:], probs[:, :-1]], dim=1)  # background first
        attrs = None
        if hasattr(heads.box_predictor, "attributes"):
            attr_logits = heads.box_predictor.attributes(pooled, logits)
            attrs = attr_logits[:, :-1].float().softmax(dim=1)
        return [b.tensor for b in boxes], pooled, probs, attrs


def build_detectron2_extractor(cfg: RegionsConfig, device: torch.device) -> ButdRegionExtractor:
    """The detectron2 model of ``cfg``; its checks come before the import, so they hold
    (and are tested) where detectron2 is absent."""
    if not cfg.detectron2_config or not cfg.weights:
        raise UserError(
            "regions.backend detectron2 needs regions.detectron2_config (a YAML config) and "
            "regions.weights (a local checkpoint)"
        )
    if cfg.weights.endswith(".pkl") and not cfg.allow_pickle_weights:
        raise pickle_refused("regions.weights", cfg.weights)
    try:
        from detectron2.checkpoint import DetectionCheckpointer
        from detectron2.modeling import build_model
    except ImportError:
        raise UserError(
            f"regions.backend is detectron2, but detectron2 is not installed: {INSTALL}"
        ) from None
    register()
    d2cfg = butd_config(cfg.detectron2_config)
    d2cfg.MODEL.DEVICE = device.type
    d2cfg.MODEL.RPN.POST_NMS_TOPK_TEST = cfg.proposals
    model = build_model(d2cfg).eval()
    DetectionCheckpointer(model).load(cfg.weights)
    return ButdRegionExtractor(Detectron2Butd(model, cfg).eval(), cfg, device)
