"""The grid stage's extractor: ResNet conv5 average-pooled to a grid (7x7) and over the whole
map (UniVSE's grid features; the pooled vector feeds ``global``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from features.decode import centre_crop_resize
from features.detector.inputs import to_tensor
from features.detector.model import ResNetTrunk, resnet_depth
from features.detector.weights import (
    checkpoint_format,
    describe,
    load_exact,
    read_checkpoint,
    trunk_state,
)
from features.images.config import GridConfig
from features.images.extractor import (
    DEFAULT_TRUNK,
    HostCopy,
    ImageExtractor,
    check_conflict,
    to_device,
    warn_random_init,
)
from features.store.spec import FieldSpec
from infra.device import autocast


def build_trunk(cfg: GridConfig) -> ResNetTrunk:
    """The grid/global trunk: a ResNet to conv5 (layer4), weights from ``grid.weights``.

    Takes torchvision ResNet classification state dicts (``fc.*`` ignored), the trunk of
    torchvision detection state dicts and of ``vse-detector`` checkpoints (its
    architecture then comes from the checkpoint). ``.architecture`` says which ResNet.
    """
    param = "grid.weights"
    torch.manual_seed(cfg.seed)
    arch = cfg.architecture
    obj = read_checkpoint(cfg.weights, param) if cfg.weights else None
    if obj is not None and checkpoint_format(obj) == "vse-detector":
        found = f"resnet{resnet_depth(obj['config']['architecture'])}"
        check_conflict(
            "grid.architecture", arch, found, f"{cfg.weights} (a vse-detector checkpoint)"
        )
        arch = found
    arch = arch or DEFAULT_TRUNK
    # no weights: ResNet blocks start as identities (torchvision's zero_init_residual), so a
    # random ResNet-152's conv5 stays finite in float16 (torchvision's init: ~1e8)
    trunk = ResNetTrunk(resnet_depth(arch), zero_init_residual=obj is None)
    trunk.architecture = arch
    if obj is None:
        warn_random_init("grid", cfg.seed)
    else:
        source = f"{cfg.weights} ({describe(obj)})"
        load_exact(trunk, trunk_state(obj, param), param, f"the grid trunk ({arch})", source)
    return trunk.eval()


class GridExtractor(ImageExtractor):
    """conv5 map adaptively average-pooled to ``grid x grid`` (UniVSE), and the map's mean
    over all positions (the global pooled feature of VSE++)."""

    kind = "grid"

    def __init__(self, model: nn.Module, cfg: GridConfig, device: torch.device):
        super().__init__(model, cfg, device)
        self.dim = model.dim

    @property
    def name(self) -> str:
        return f"grid-{getattr(self.model, 'architecture', self.cfg.architecture)}"

    def fields(self) -> dict[str, FieldSpec]:
        g = self.cfg.grid
        return {
            "features": FieldSpec((g, g, self.dim), "float16"),
            "pooled": FieldSpec((self.dim,), "float32"),
            "image_hw": FieldSpec((2,), "int32"),
        }

    def prepare(self, image: Image.Image, row: dict) -> dict[str, Any]:
        w, h = image.size
        return {"image": to_tensor(centre_crop_resize(image, self.cfg.image_size)), "hw": (h, w)}

    @torch.no_grad()
    def forward(self, items: list[dict]) -> HostCopy:
        """The trunk over a batch, on the device: the pooled grids and means."""
        batch = to_device(torch.stack([it["image"] for it in items]), self.device)
        with autocast(self.device):
            conv5 = self.model(batch).float()  # (B, 2048, h, w)
        grid = F.adaptive_avg_pool2d(conv5, self.cfg.grid).permute(0, 2, 3, 1)
        return HostCopy(self.device, grid=grid, pooled=conv5.mean(dim=(2, 3)))

    def finish(self, items: list[dict], raw: HostCopy) -> list[dict[str, np.ndarray]]:
        out = raw.wait()
        return [
            {"features": g, "pooled": p, "image_hw": np.asarray(it["hw"], dtype=np.int32)}
            for g, p, it in zip(out["grid"].numpy(), out["pooled"].numpy(), items, strict=True)
        ]
