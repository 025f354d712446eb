"""Configs of the image extraction stages (``regions``, ``grid`` in params.yaml), apart
from :mod:`features.images` so that reading params imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from features.decode import MAX_ASPECT_RATIO
from features.detector.config import DetectorArchitecture, TrunkArchitecture
from infra.config import Section, Seed
from infra.device import Device


class ExtractConfig(Section):
    """Settings shared by the image extraction stages."""

    # a local checkpoint or torchvision:<Weights.ENTRY> from the local hub cache (see
    # features/detector/weights.py); none: random init, with a loud warning
    weights: str | None = None
    seed: Seed = 0  # random init and nothing else
    batch_size: int = Field(8, ge=1)
    num_workers: int = Field(2, ge=0)
    device: Device = "auto"
    max_pixels: int = Field(89_478_485, ge=1)
    # longer side / shorter side; a 1 x 10000 image would cost GBs once resized
    max_aspect_ratio: float = Field(MAX_ASPECT_RATIO, ge=1.0)
    max_error_fraction: float = Field(0.01, ge=0.0, le=1.0)


class RegionsConfig(ExtractConfig):
    """``regions`` section: bottom-up-attention region features."""

    backend: Literal["torchvision", "detectron2", "given"] = "torchvision"
    # none: from a vse-detector checkpoint, else resnet101_c4 (the paper's)
    architecture: DetectorArchitecture | None = None
    detectron2_config: str | None = None
    # detectron2 .pkl weights are pickles (they can run code when loaded): opt in
    allow_pickle_weights: bool = False
    # none: from the checkpoint, else 1601 (Visual Genome: 1600 classes + background)
    num_classes: int | None = Field(None, ge=2)
    min_side: int = Field(600, ge=32)
    max_side: int = Field(1000, ge=32)
    conf_threshold: float = Field(0.2, ge=0.0, le=1.0)
    nms_iou: float = Field(0.3, gt=0.0, le=1.0)
    min_boxes: int = Field(10, ge=0)
    max_boxes: int = Field(100, ge=1)
    proposals: int = Field(300, ge=1)  # RPN proposals kept after NMS, per image
    batch_size: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> RegionsConfig:
        if self.min_boxes > self.max_boxes:
            raise ValueError(f"min_boxes ({self.min_boxes}) > max_boxes ({self.max_boxes})")
        if self.min_side > self.max_side:
            raise ValueError(f"min_side ({self.min_side}) > max_side ({self.max_side})")
        return self


class GridConfig(ExtractConfig):
    """``grid`` section: ResNet conv5 map pooled to a grid (UniVSE), and its mean (VSE++)."""

    # none: from a vse-detector checkpoint, else resnet152 (the papers')
    architecture: TrunkArchitecture | None = None
    image_size: int = Field(224, ge=32)  # shorter side resized to this, then centre crop
    grid: int = Field(7, ge=1)
