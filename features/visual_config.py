"""Configs of the image extraction stages (``regions``, ``grid`` in params.yaml), apart
from :mod:`features.visual` so that reading params imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from features.config import Section


class ExtractConfig(Section):
    """Settings shared by the image extraction stages."""

    weights: str | None = None  # local checkpoint; none: random init, with a loud warning
    seed: int = 0  # random init and nothing else
    batch_size: int = Field(8, ge=1)
    num_workers: int = Field(2, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_pixels: int = Field(89_478_485, ge=1)
    max_error_fraction: float = Field(0.01, ge=0.0, le=1.0)


class RegionsConfig(ExtractConfig):
    """``regions`` section: bottom-up-attention region features."""

    backend: Literal["torchvision", "detectron2", "given"] = "torchvision"
    architecture: Literal["resnet101_c4", "resnet50_c4", "resnet50_fpn"] = "resnet101_c4"
    detectron2_config: str | None = None
    num_classes: int = Field(1601, ge=2)  # Visual Genome: 1600 classes + background
    min_side: int = Field(600, ge=32)
    max_side: int = Field(1000, ge=32)
    conf_threshold: float = Field(0.2, ge=0.0, le=1.0)
    nms_iou: float = Field(0.3, gt=0.0, le=1.0)
    min_boxes: int = Field(10, ge=0)
    max_boxes: int = Field(100, ge=1)
    proposals: int = Field(300, ge=1)  # RPN proposals kept after NMS, per image
    batch_size: int = Field(2, ge=1)
    # C4 only: the box head is ResNet stage `stages` (4 = res5, the paper's); the backbone
    # the stages before it. Random-init demo weights keep colour only in early stages.
    stages: int = Field(4, ge=2, le=4)

    @model_validator(mode="after")
    def _bounds(self) -> RegionsConfig:
        if self.min_boxes > self.max_boxes:
            raise ValueError(f"min_boxes ({self.min_boxes}) > max_boxes ({self.max_boxes})")
        return self


class GridConfig(ExtractConfig):
    """``grid`` section: ResNet conv5 map pooled to a grid (UniVSE), and its mean (VSE++)."""

    architecture: Literal["resnet152", "resnet101", "resnet50"] = "resnet152"
    image_size: int = Field(224, ge=32)  # shorter side resized to this, then centre crop
    grid: int = Field(7, ge=1)
    # ResNet stages kept: 4 = conv5 (2048-d, the papers'); 1..3 give 256/512/1024-d maps.
    # Random-init demo weights keep colour only in early stages.
    stages: int = Field(4, ge=1, le=4)
