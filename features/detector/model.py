"""The bottom-up detector: Faster R-CNN with an attribute head (Anderson et al. 2018).

Faster R-CNN (Ren et al. 2015) from torchvision parts: a ResNet backbone, a region
proposal network (RPN, sec. 3.1 of Ren et al.), RoI pooling and a box head, and a
predictor giving softmax class scores and per-class box regression (sec. 3.2). Two
backbone layouts:

- ``resnetD_c4`` (D = 18, 34, 50, 101, 152): the bottom-up-attention layout. The RPN and
  RoIAlign (14 x 14) run on the stride-16 res4 map; the box head is res5 followed by mean
  pooling, so a region's feature is 2048-d (512-d for the BasicBlock ResNets). The paper
  uses ``resnet101_c4``, initialised from ImageNet.
- ``resnetD_fpn``: a feature pyramid (Lin et al. 2017) with RoIAlign 7 x 7 and the
  two-layer MLP box head; ``resnet50_fpn`` and ``resnet50_fpn_v2`` are built by
  torchvision's own constructors, so their detection checkpoints load as they are.

The attribute head follows Anderson et al. 2018, sec. 3.1 (:class:`AttributeHead`; the
ground-truth class in training, the predicted class at test time). The paper does not say
how an object's several attributes (the demo's: colour and size) enter the softmax loss;
here its target is the uniform distribution over them (a soft-target cross-entropy), so
each object weighs the same whatever its number of attributes; objects without attributes
target "no attribute", as in the paper. Only foreground RoIs train the head.

The checkpoint this module writes (:func:`detector_checkpoint`) is plain data, loadable
with ``weights_only=True``::

    {"format": "vse-detector", "version": 1, "config": {DetectorConfig as plain data},
     "classes": [names, without background], "attributes": [names, without "no
     attribute"], "state_dict": {...}}
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.roi_heads import RoIHeads, fastrcnn_loss
from torchvision.ops import MultiScaleRoIAlign, box_area
from torchvision.ops.poolers import LevelMapper, _setup_scales

from features.detector.config import DetectorConfig

CHECKPOINT_FORMAT = "vse-detector"
CHECKPOINT_VERSION = 1


def resnet_depth(architecture: str) -> int:
    """``resnet101_c4`` -> 101."""
    return int(architecture.removeprefix("resnet").split("_")[0])


def make_resnet(depth: int, zero_init_residual: bool = False) -> torchvision.models.ResNet:
    """torchvision's ResNet-``depth`` with random weights (torchvision's own init);
    ``zero_init_residual`` (Goyal et al. 2017) zeroes each residual block's last BatchNorm,
    so blocks start as identities and features of a model with no weights stay finite
    (torchvision's init takes a ResNet-152's conv5 to ~1e8, beyond float16)."""
    resnet = getattr(torchvision.models, f"resnet{depth}")
    return resnet(weights=None, zero_init_residual=zero_init_residual)


def stage_dims(depth: int) -> tuple[int, int, int, int]:
    """Output channels of layer1..layer4: BasicBlock (18, 34) or Bottleneck ResNets."""
    return (64, 128, 256, 512) if depth in (18, 34) else (256, 512, 1024, 2048)


class ResNetTrunk(nn.Module):
    """A torchvision ResNet without its classifier, up to ``layer<stages>``, keeping
    torchvision's names (``conv1``, ``bn1``, ``layer1``...), so a classification state
    dict loads into it as it is (``fc.*`` aside)."""

    def __init__(self, depth: int, stages: int = 4, zero_init_residual: bool = False):
        super().__init__()
        resnet = make_resnet(depth, zero_init_residual)
        layers = [f"layer{k}" for k in range(1, stages + 1)]
        for name in ("conv1", "bn1", "relu", "maxpool", *layers):
            setattr(self, name, getattr(resnet, name))
        self.stages = stages
        self.dim = stage_dims(depth)[stages - 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, dim, H/s, W/s)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for k in range(1, self.stages + 1):
            x = getattr(self, f"layer{k}")(x)
        return x


class Res5Head(nn.Module):
    """The C4 box head: res5 on 14x14 RoI features, then mean pooling (Anderson et al.)."""

    def __init__(self, layer4: nn.Module):
        super().__init__()
        self.layer4 = layer4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (P, 1024, 14, 14) -> (P, 2048)
        return self.layer4(x).mean(dim=(2, 3))


class PyramidLevels(nn.Module):
    """A :class:`BackboneWithFPN` whose output keeps only the first ``levels`` maps: all
    four stages feed the top-down pathway, but small images need no coarse levels."""

    def __init__(self, fpn: BackboneWithFPN, levels: int):
        super().__init__()
        self.body, self.fpn = fpn.body, fpn.fpn
        self.out_channels = fpn.out_channels
        self.levels = levels

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        return self.select(self.fpn(self.body(x)))

    def select(self, maps: OrderedDict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
        return OrderedDict((k, v) for i, (k, v) in enumerate(maps.items()) if i < self.levels)


class LevelMapper64(LevelMapper):
    """torchvision's FPN level of each RoI (Lin et al. 2017, eq. 1: ``floor(4 + log2(sqrt(wh)
    / 224))``) with the square root taken in float64 and rounded to float32: torch's float32
    ``sqrt`` on CPU rounds the last bit differently on Intel and AMD CPUs, and a box whose
    level flips changes every later step. The same levels as torchvision's but for those
    last bits."""

    def __call__(self, boxlists: list[torch.Tensor]) -> torch.Tensor:
        area = torch.cat([box_area(b) for b in boxlists])
        s = area.double().sqrt().to(area.dtype)
        eps = torch.tensor(self.eps, dtype=s.dtype)
        levels = torch.floor(self.lvl0 + torch.log2(s / self.s0) + eps)
        return levels.clamp(self.k_min, self.k_max).to(torch.int64) - self.k_min


class PyramidRoIAlign(MultiScaleRoIAlign):
    """torchvision's multi-level RoIAlign, its levels assigned by :class:`LevelMapper64`."""

    def forward(self, x, boxes, image_shapes):
        if self.map_levels is None:
            features = [x[name] for name in self.featmap_names]
            self.scales, mapper = _setup_scales(
                features, image_shapes, self.canonical_scale, self.canonical_level
            )
            self.map_levels = LevelMapper64(mapper.k_min, mapper.k_max, mapper.s0, mapper.lvl0)
        return super().forward(x, boxes, image_shapes)


def backbone_with_conv5(model: nn.Module, x: torch.Tensor):
    """The detector's feature maps and, for FPN models, the trunk's conv5 map (B, D, h, w)
    (``None`` for C4 models, whose res5 is the box head)."""
    backbone = model.backbone
    if not hasattr(backbone, "fpn"):
        return {"0": backbone(x)}, None
    stages = backbone.body(x)
    maps = backbone.fpn(stages)
    if isinstance(backbone, PyramidLevels):
        maps = backbone.select(maps)
    return maps, next(reversed(stages.values()))


class ImageHead(nn.Module):
    """How much of an image each object class covers and which attributes it has, from its
    pooled conv5 (a linear layer; :func:`image_loss`). Not in Anderson et al.: it stands in
    for ImageNet pretraining of a trunk trained from scratch (``detector.image_loss_weight``;
    0, the paper's set-up, builds no head)."""

    def __init__(self, dim: int, outputs: int):
        super().__init__()
        self.fc = nn.Linear(dim, outputs)

    def forward(self, conv5: torch.Tensor) -> torch.Tensor:  # (B, D, h, w) -> (B, outputs)
        return self.fc(conv5.mean(dim=(2, 3)))


class AttributeHead(nn.Module):
    """Anderson et al. 2018 sec. 3.1: [region feature ; class embedding] -> FC + ReLU ->
    logits over ``1 + num_attributes`` (index 0: no attribute)."""

    def __init__(self, in_dim: int, num_classes: int, num_attributes: int, embed: int, hidden: int):
        super().__init__()
        self.class_embedding = nn.Embedding(num_classes, embed)
        self.fc = nn.Linear(in_dim + embed, hidden)
        self.attr_score = nn.Linear(hidden, num_attributes + 1)

    def forward(self, features: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        x = torch.cat([features, self.class_embedding(classes)], dim=1)  # (P, D + E)
        return self.attr_score(F.relu(self.fc(x)))  # (P, 1 + A)


def attribute_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against each object's target distribution (uniform over its
    attributes, or all mass on "no attribute"): ``-sum_a t_a log softmax(z)_a``."""
    if len(logits) == 0:
        return logits.sum() * 0.0
    return -(targets * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


class BottomUpRoIHeads(RoIHeads):
    """torchvision's RoI heads plus the attribute head (when the data has attributes).

    Training targets per image: ``boxes`` (G, 4), ``labels`` (G,) (1..C-1), and with an
    attribute head ``attributes`` (G, 1 + A), each row a distribution (see module doc).
    """

    attribute_head: AttributeHead | None

    def forward(self, features, proposals, image_shapes, targets=None):
        if not self.training or self.attribute_head is None:
            return super().forward(features, proposals, image_shapes, targets)
        proposals, matched_idxs, labels, regression_targets = self.select_training_samples(
            proposals, targets
        )
        pooled = self.box_head(self.box_roi_pool(features, proposals, image_shapes))  # (P, D)
        class_logits, box_regression = self.box_predictor(pooled)
        loss_classifier, loss_box_reg = fastrcnn_loss(
            class_logits, box_regression, labels, regression_targets
        )
        labels_all = torch.cat(labels)
        foreground = torch.where(labels_all > 0)[0]
        attr_targets = torch.cat(
            [t["attributes"][m] for t, m in zip(targets, matched_idxs, strict=True)]
        )
        attr_logits = self.attribute_head(pooled[foreground], labels_all[foreground])
        losses = {
            "loss_classifier": loss_classifier,
            "loss_box_reg": loss_box_reg,
            "loss_attribute": attribute_loss(attr_logits, attr_targets[foreground]),
        }
        return [], losses

    def attributes(self, pooled: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """Attribute probabilities (P, 1 + A) of regions with features ``pooled`` (P, D)
        and object classes ``classes`` (P,)."""
        return F.softmax(self.attribute_head(pooled, classes), dim=1)


def build_detector_model(
    cfg: DetectorConfig, num_classes: int, num_attributes: int = 0, zero_init_residual=False
) -> FasterRCNN:
    """The Faster R-CNN of ``cfg.architecture`` with ``num_classes`` (background included)
    and, if ``num_attributes``, the attribute head; random init (seeded by the caller), its
    ResNet blocks starting as identities with ``zero_init_residual`` (see :func:`make_resnet`;
    the torchvision-built ``resnet50_fpn*`` keep torchvision's init).

    Image resizing and normalisation are the caller's (:mod:`features.images`): the
    model's own transform is never used, so images go straight to ``model.backbone``.
    """
    arch = cfg.architecture
    depth = resnet_depth(arch)
    conv5_dim = stage_dims(depth)[3]
    rpn = {
        "rpn_pre_nms_top_n_train": cfg.rpn_pre_nms_train,
        "rpn_post_nms_top_n_train": cfg.rpn_post_nms_train,
        "rpn_pre_nms_top_n_test": cfg.rpn_pre_nms_test or (6000 if cfg.is_c4 else 1000),
        "rpn_post_nms_top_n_test": cfg.rpn_post_nms_test,
        "rpn_batch_size_per_image": cfg.rpn_batch_size,
        "box_batch_size_per_image": cfg.box_batch_size,
        "box_positive_fraction": cfg.box_positive_fraction,
        "box_detections_per_img": cfg.detections_per_image,
        "box_score_thresh": cfg.score_threshold,
        "min_size": cfg.min_side,
        "max_size": cfg.max_side,
    }
    if arch in ("resnet50_fpn", "resnet50_fpn_v2"):
        from torchvision.models import detection

        build = getattr(detection, f"fasterrcnn_{arch}")
        pool = PyramidRoIAlign(["0", "1", "2", "3"], 7, sampling_ratio=2)  # torchvision's
        model = build(
            weights=None, weights_backbone=None, num_classes=num_classes, box_roi_pool=pool, **rpn
        )
    else:
        if cfg.is_c4:
            # stem..res4 (stride 16) under ``backbone.body``, as torchvision names it
            backbone = nn.Sequential(OrderedDict(body=ResNetTrunk(depth, 3, zero_init_residual)))
            backbone.out_channels = backbone.body.dim
            head = Res5Head(make_resnet(depth, zero_init_residual).layer4)
            dim = conv5_dim
            pool = MultiScaleRoIAlign(["0"], output_size=14, sampling_ratio=0)
            sizes = (tuple(cfg.anchors()),)
        else:
            fpn = BackboneWithFPN(
                make_resnet(depth, zero_init_residual),
                {f"layer{k}": str(k - 1) for k in range(1, 5)},
                list(stage_dims(depth)),
                cfg.fpn_channels,
            )
            levels = cfg.fpn_levels
            backbone = PyramidLevels(fpn, levels)
            dim = cfg.representation_size
            head = TwoMLPHead(cfg.fpn_channels * 7 * 7, dim)
            pool = PyramidRoIAlign([str(k) for k in range(levels)], 7, sampling_ratio=2)
            per_level = len(cfg.anchors()) // levels
            sizes = tuple(
                tuple(cfg.anchors()[k * per_level : (k + 1) * per_level]) for k in range(levels)
            )
        anchors = AnchorGenerator(sizes, (tuple(cfg.aspect_ratios),) * len(sizes))
        model = FasterRCNN(
            backbone,
            rpn_anchor_generator=anchors,
            box_roi_pool=pool,
            box_head=head,
            box_predictor=FastRCNNPredictor(dim, num_classes),
            **rpn,
        )
    dim = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.__class__ = BottomUpRoIHeads  # the same heads, plus the attribute head
    model.roi_heads.attribute_head = (
        AttributeHead(dim, num_classes, num_attributes, cfg.class_embedding, cfg.attribute_hidden)
        if num_attributes
        else None
    )
    if cfg.image_loss_weight > 0:
        model.image_head = ImageHead(conv5_dim, num_classes - 1 + num_attributes)
    return model


def image_loss(logits: torch.Tensor, targets: list[dict], num_classes: int) -> torch.Tensor:
    """The :class:`ImageHead` loss on logits (B, C-1 + A): how much of each image every
    object class covers, as a softmax cross-entropy against the box-area-weighted class
    distribution (the multi-object analogue of the one ImageNet label of an image), plus
    which attributes its objects have, as binary cross-entropy."""
    c = num_classes - 1
    cover = torch.zeros_like(logits[:, :c])  # (B, C-1)
    present = torch.zeros_like(logits[:, c:])  # (B, A)
    for i, target in enumerate(targets):
        boxes = target["boxes"]
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        cover[i].index_add_(0, target["labels"] - 1, area.to(cover.dtype))
        cover[i] /= cover[i].sum().clamp_min(1e-9)
        if present.shape[1] and len(target.get("attributes", ())):
            present[i] = (target["attributes"][:, 1:] > 0).any(dim=0).to(present.dtype)
    loss = -(cover * F.log_softmax(logits[:, :c], dim=1)).sum(dim=1).mean()
    if present.shape[1]:
        loss = loss + F.binary_cross_entropy_with_logits(logits[:, c:], present)
    return loss


def detector_checkpoint(
    model: nn.Module, cfg: DetectorConfig, classes: list[str], attributes: list[str]
) -> dict:
    """The plain-data checkpoint of a trained detector (see the module docstring)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "config": cfg.model_dump(mode="json"),
        "classes": list(classes),
        "attributes": list(attributes),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }


def model_from_checkpoint(ckpt: dict, overrides: dict | None = None) -> FasterRCNN:
    """Build the detector a ``vse-detector`` checkpoint describes and load its weights;
    ``overrides`` replace test-time settings of its config (e.g. ``rpn_post_nms_test``)."""
    cfg = DetectorConfig.model_validate({**ckpt["config"], **(overrides or {})})
    model = build_detector_model(cfg, len(ckpt["classes"]) + 1, len(ckpt["attributes"]))
    model.load_state_dict(ckpt["state_dict"])
    return model
