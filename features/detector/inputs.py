"""Images as the detector takes them: normalised tensors, resized (shorter side, capped
longer side) and batched to a size divisible by 32."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image
from torchvision.models.detection.image_list import ImageList
from torchvision.transforms import functional as TF

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> normalised (3, H, W) float tensor."""
    return TF.normalize(TF.to_tensor(image), IMAGENET_MEAN, IMAGENET_STD)


def resize_for_detection(image: Image.Image, min_side: int, max_side: int):
    """The normalised (3, h, w) tensor of ``image`` with its shorter side at ``min_side``
    unless the longer would pass ``max_side``, and the scale."""
    w, h = image.size
    scale = min(min_side / min(w, h), max_side / max(w, h))
    size = (max(round(w * scale), 1), max(round(h * scale), 1))
    return to_tensor(image.resize(size, Image.BILINEAR)), scale


def batch_images(tensors: Sequence[torch.Tensor]) -> ImageList:
    """Zero-pad (3, H, W) tensors to one batch (sizes rounded up to a multiple of 32)."""
    h = -(-max(t.shape[1] for t in tensors) // 32) * 32
    w = -(-max(t.shape[2] for t in tensors) // 32) * 32
    batch = tensors[0].new_zeros((len(tensors), 3, h, w))
    for i, t in enumerate(tensors):
        batch[i, :, : t.shape[1], : t.shape[2]] = t
    return ImageList(batch, [tuple(t.shape[1:]) for t in tensors])
