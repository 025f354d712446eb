"""Config of the bottom-up detector (``detector`` section) and the architectures the region
and grid trunks are built from."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from infra.config import Section, Seed
from infra.device import Device

DetectorArchitecture = Literal[
    "resnet18_c4",
    "resnet34_c4",
    "resnet50_c4",
    "resnet101_c4",
    "resnet152_c4",
    "resnet18_fpn",
    "resnet34_fpn",
    "resnet50_fpn",
    "resnet101_fpn",
    "resnet152_fpn",
    "resnet50_fpn_v2",
]


TrunkArchitecture = Literal["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]


class DetectorConfig(Section):
    """``detector`` section: the bottom-up detector trained by ``vse train detector``.

    The defaults are the paper's (Anderson et al. 2018): ResNet-101 C4 from ImageNet at
    600/1000 px, 1600 object and 400 attribute classes (Visual Genome); the demo overrides
    sizes (a ResNet-18 FPN at 128 px trained from scratch).
    """

    # data: which boxes train it (the reader is picked by the command line's inputs)
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)  # COCO/VG without a val file: held out
    max_classes: int = Field(1600, ge=1)  # most frequent object names kept (Visual Genome)
    max_attributes: int = Field(400, ge=0)  # most frequent attribute names kept
    # malformed annotations are dropped and reported (OUT/errors.csv); more than this
    # fraction of them fails the stage, as prepare.max_error_fraction does
    max_error_fraction: float = Field(0.01, ge=0.0, le=1.0)
    # architecture (see features/detector/model.py)
    architecture: DetectorArchitecture = "resnet101_c4"
    init_weights: str | None = None  # ImageNet or torchvision detection weights; none: scratch
    # anchor sizes in px; FPN: split evenly over the levels. None: C4 64..512 (the paper's
    # scales 4..32 x stride 16), FPN 32, 64, ... one per level (torchvision's)
    anchor_sizes: list[PositiveInt] | None = None
    aspect_ratios: list[PositiveFloat] = [0.5, 1.0, 2.0]
    fpn_channels: int = Field(256, ge=8)
    fpn_levels: int = Field(4, ge=1, le=4)  # FPN maps P2.. used by the RPN and RoIAlign
    representation_size: int = Field(1024, ge=8)  # FPN box head width (the region feature)
    class_embedding: int = Field(256, ge=1)  # attribute head: object class embedding
    attribute_hidden: int = Field(512, ge=1)  # attribute head: FC width
    min_side: int = Field(600, ge=32)  # images resized as for `regions`
    max_side: int = Field(1000, ge=32)
    rpn_pre_nms_train: int = Field(2000, ge=1)  # per FPN level
    rpn_post_nms_train: int = Field(2000, ge=1)
    rpn_pre_nms_test: int | None = Field(None, ge=1)  # None: C4 6000 (paper), FPN 1000
    rpn_post_nms_test: int = Field(300, ge=1)
    rpn_batch_size: int = Field(256, ge=1)  # anchors sampled per image for the RPN loss
    box_batch_size: int = Field(512, ge=1)  # RoIs sampled per image for the head losses
    box_positive_fraction: float = Field(0.25, gt=0.0, le=1.0)  # of those, at most foreground
    detections_per_image: int = Field(100, ge=1)
    score_threshold: float = Field(0.05, ge=0.0, le=1.0)  # detections kept for mAP
    # training
    epochs: int = Field(12, ge=1)
    batch_size: int = Field(4, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.01, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(1e-4, ge=0.0)
    warmup_steps: int = Field(500, ge=0)
    schedule: Literal["step", "cosine"] = "step"
    lr_decay_epochs: list[PositiveInt] = [8, 11]  # step schedule: x lr_decay at these epochs
    lr_decay: float = Field(0.1, gt=0.0)
    grad_clip: float = Field(10.0, gt=0.0)
    attribute_weight: float = Field(0.5, ge=0.0)  # weight of the attribute loss
    # image-level multi-label loss on the trunk's pooled conv5 (FPN only; not in the paper:
    # stands in for ImageNet pretraining when a trunk is trained from scratch; 0: none)
    image_loss_weight: float = Field(0.0, ge=0.0)
    hflip: bool = True  # random horizontal flips (seeded by epoch and image)
    trainable_layers: int = Field(3, ge=0, le=5)  # ResNet stages trained (5: all, with bn1)
    freeze_bn: bool = True  # BatchNorm statistics and affine frozen (pretrained trunks)
    seed: Seed = 0
    device: Device = "auto"
    num_workers: int = Field(0, ge=0)  # image decoding happens once, before training
    # last.pt also mid-epoch every N steps / minutes (0: at epoch ends only); SIGTERM or
    # SIGINT always write it and exit 75 (infra/resume.py). Not part of the run's identity.
    checkpoint_every_steps: NonNegativeInt = 0
    checkpoint_every_minutes: NonNegativeFloat = 0.0
    eval_iou: float = Field(0.5, gt=0.0, le=1.0)  # mAP@IoU and recall

    @property
    def is_c4(self) -> bool:
        return self.architecture.endswith("_c4")

    def anchors(self) -> list[int]:
        if self.anchor_sizes is not None:
            return list(self.anchor_sizes)
        if self.is_c4:
            return [64, 128, 256, 512]
        return [32 * 2**k for k in range(self.fpn_levels)]

    @model_validator(mode="after")
    def _anchors(self) -> DetectorConfig:
        if self.is_c4 and self.image_loss_weight > 0:
            raise ValueError("image_loss_weight needs an FPN architecture (C4: res5 is the head)")
        if self.min_side > self.max_side:
            raise ValueError(f"min_side ({self.min_side}) > max_side ({self.max_side})")
        if not self.is_c4 and len(self.anchors()) % self.fpn_levels:
            raise ValueError(
                f"anchor_sizes ({len(self.anchors())}) must split evenly over fpn_levels "
                f"({self.fpn_levels})"
            )
        return self
