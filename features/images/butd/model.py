"""The bottom-up-attention Faster R-CNN (Anderson et al. 2018) in PyTorch and torchvision ops.

The Caffe model of the paper (``resnet101_faster_rcnn_final.caffemodel``, Visual Genome:
1600 objects, 400 attributes) at test time, as py-bottom-up-attention's detectron2
conversion runs it, so that the standard checkpoints give the standard features:

- input: BGR 0..255 minus the Caffe pixel means, shorter side 600, longer at most 1000;
- trunk: Caffe ResNet (stride in the first 1x1 conv of a block, frozen batch norm, stem
  max-pool 3x3 / 2 without padding and with ceil mode) up to res4 (stride 16);
- RPN (Ren et al. 2015, Sec. 3.1): 3x3 conv with 512 channels, 12 anchors per cell
  (sizes 64..512 = 4..32 x stride 16, aspect ratios 0.5/1/2), top 6000 before and
  ``proposals`` after NMS at IoU 0.7;
- box head (paper Sec. 3.1): 14x14 RoI max pooling of res4 into res5 run at stride 1 with
  dilation 2, averaged to one 2048-d vector per region: the region feature v_i;
- predictor: 1601-way class scores, per-class box deltas; the attribute head (paper Sec.
  3.1, "attribute predictor"): v_i concatenated with a learned embedding of the predicted
  class, a 512-unit layer with ReLU, 401 attribute scores (one meaning "no attribute").

Shapes: B images, P proposals over the batch, C classes with background, A attributes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.detection._utils import BoxCoder
from torchvision.ops import FrozenBatchNorm2d, batched_nms, roi_pool

CAFFE_PIXEL_MEAN_BGR = (102.9801, 115.9465, 122.7717)
ANCHOR_SIZES = (64, 128, 256, 512)  # 4, 8, 16, 32 x the stride, as the Caffe model
ASPECT_RATIOS = (0.5, 1.0, 2.0)
STRIDE = 16


@dataclass(frozen=True)
class ButdSpec:
    """The shape of a BUTD network; :func:`features.images.butd.checkpoint.spec_of` reads
    it from a checkpoint (the published ones: ResNet-101, width 64, 1601 classes)."""

    blocks: tuple[int, int, int, int] = (3, 4, 23, 3)
    width: int = 64  # stem channels = res2 bottleneck channels
    rpn_hidden: int = 512
    num_classes: int = 1601  # with background
    num_attrs: int = 401  # with "no attribute"; 0: no attribute head
    attr_embed: int = 256
    attr_hidden: int = 512
    # "detectron2": sigmoid objectness, background last (py-bottom-up-attention);
    # "milvlg": two-way softmax objectness, background first (bottom-up-attention.pytorch)
    layout: str = "detectron2"

    @property
    def dim(self) -> int:
        return self.width * 32  # res5 output channels: 2048 for width 64


class ConvNorm(nn.Conv2d):
    """A bias-free convolution followed by frozen batch norm (``<name>.norm.*`` keys)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, dilation: int = 1):
        pad = dilation * (k // 2)
        super().__init__(cin, cout, k, stride, pad, dilation, bias=False)
        self.norm = FrozenBatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:  # folded
            return super().forward(x)
        return self.norm(super().forward(x))

    @torch.no_grad()
    def fold(self) -> None:
        """Fold the frozen norm into the convolution (y = s (W x) + t = (s W) x + t): the
        same function, one pass over the map instead of three."""
        n = self.norm
        scale = n.weight * (n.running_var + n.eps).rsqrt()  # (C,)
        self.weight.mul_(scale.view(-1, 1, 1, 1))
        self.bias = nn.Parameter(n.bias - n.running_mean * scale)


class Bottleneck(nn.Module):
    """Caffe ResNet bottleneck (He et al. 2016, Fig. 5 right): the stride sits in the
    first 1x1 conv (MSRA's models), a projection shortcut where the width changes."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1, dilation: int = 1):
        super().__init__()
        self.shortcut = ConvNorm(cin, cout, 1, stride) if cin != cout else None
        self.conv1 = ConvNorm(cin, mid, 1, stride)
        self.conv2 = ConvNorm(mid, mid, 3, 1, dilation)
        self.conv3 = ConvNorm(mid, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu_(self.conv1(x))
        out = F.relu_(self.conv2(out))
        out = self.conv3(out)
        out += x if self.shortcut is None else self.shortcut(x)
        return F.relu_(out)


def stage(cin: int, mid: int, n: int, stride: int, dilation: int = 1) -> nn.Sequential:
    blocks = [Bottleneck(cin, mid, mid * 4, stride, dilation)]
    blocks += [Bottleneck(mid * 4, mid, mid * 4, 1, dilation) for _ in range(n - 1)]
    return nn.Sequential(*blocks)


class Stem(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = ConvNorm(3, width, 7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Caffe's pooling: no padding, output size rounded up (ceil mode)
        return F.max_pool2d(F.relu_(self.conv1(x)), 3, 2, 0, ceil_mode=True)


class Backbone(nn.Module):
    """Stem, res2, res3, res4: (B, 3, H, W) -> (B, 16 width, H/16, W/16)."""

    def __init__(self, spec: ButdSpec):
        super().__init__()
        w, (n2, n3, n4, _) = spec.width, spec.blocks
        self.stem = Stem(w)
        self.res2 = stage(w, w, n2, 1)
        self.res3 = stage(4 * w, 2 * w, n3, 2)
        self.res4 = stage(8 * w, 4 * w, n4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res4(self.res3(self.res2(self.stem(x))))


class RpnHead(nn.Module):
    def __init__(self, cin: int, hidden: int, anchors: int, logits_per_anchor: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, hidden, 3, padding=1)
        self.objectness_logits = nn.Conv2d(hidden, anchors * logits_per_anchor, 1)
        self.anchor_deltas = nn.Conv2d(hidden, anchors * 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = F.relu(self.conv(x))
        return self.objectness_logits(t), self.anchor_deltas(t)


def cell_anchors() -> torch.Tensor:
    """(12, 4) anchors centred on 0: size-major, then aspect ratio h/w (detectron2's
    order, which py-bottom-up-attention's converted RPN weights follow)."""
    out = []
    for size in ANCHOR_SIZES:
        for ratio in ASPECT_RATIOS:
            w = math.sqrt(size * size / ratio)
            h = ratio * w
            out.append((-w / 2, -h / 2, w / 2, h / 2))
    return torch.tensor(out)


def grid_anchors(height: int, width: int, device: torch.device) -> torch.Tensor:
    """(height * width * 12, 4) anchors, location-major (rows, then columns)."""
    ys = torch.arange(0, height * STRIDE, STRIDE, dtype=torch.float32, device=device)
    xs = torch.arange(0, width * STRIDE, STRIDE, dtype=torch.float32, device=device)
    y, x = torch.meshgrid(ys, xs, indexing="ij")
    shifts = torch.stack([x, y, x, y], dim=-1).reshape(-1, 1, 4)
    return (shifts + cell_anchors().to(device)).reshape(-1, 4)


class Predictor(nn.Module):
    """Class scores, per-class box deltas and the attribute head (detectron2 names; the
    MILVLG names are mapped onto these when a checkpoint is read)."""

    def __init__(self, spec: ButdSpec):
        super().__init__()
        d, c = spec.dim, spec.num_classes
        self.cls_score = nn.Linear(d, c)
        reg = c - 1 if spec.layout == "detectron2" else c
        self.bbox_pred = nn.Linear(d, reg * 4)
        self.num_attrs = spec.num_attrs
        if spec.num_attrs:
            self.cls_embedding = nn.Embedding(c, spec.attr_embed)
            self.fc_attr = nn.Linear(d + spec.attr_embed, spec.attr_hidden)
            self.attr_score = nn.Linear(spec.attr_hidden, spec.num_attrs)

    def forward(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(P, D) region features -> (P, C) class logits, (P, A) attribute logits. The
        attribute head embeds the argmax class over all C logits (background included),
        as both reference implementations do at test time."""
        logits = self.cls_score(v)
        if not self.num_attrs:
            return logits, None
        embedded = self.cls_embedding(logits.argmax(dim=1))  # (P, 256)
        hidden = F.relu(self.fc_attr(torch.cat([v, embedded], dim=1)))  # (P, 512)
        return logits, self.attr_score(hidden)


class RoiHeads(nn.Module):
    """RoI max pooling (14x14, scale 1/16) of res4, res5 at stride 1 with dilation 2, mean
    over the 14x14 cells: the 2048-d region feature; then the predictor."""

    def __init__(self, spec: ButdSpec):
        super().__init__()
        w = spec.width
        self.res5 = stage(16 * w, 8 * w, spec.blocks[3], 1, dilation=2)
        self.box_predictor = Predictor(spec)

    def pooled(self, maps: list[torch.Tensor], rois: list[torch.Tensor]) -> torch.Tensor:
        """Per-image (1, 16w, h_i, w_i) res4 maps and (P_i, 4) boxes in input pixels ->
        (P, D): each image's cells pooled from its own map, res5 over all of them at once.
        The pooling runs in float32 (a maximum: exact in any dtype; torchvision's CPU kernel
        has no bf16), res5 then in the autocast dtype, if any."""
        cells = [
            roi_pool(m.float(), [r.float()], (14, 14), 1.0 / STRIDE)
            for m, r in zip(maps, rois, strict=True)
        ]
        return self.res5(torch.cat(cells)).mean(dim=(2, 3))


class ButdModel(nn.Module):
    """The whole network; ``forward`` gives per-image proposals and, over all of them,
    region features, class probabilities (background in column 0) and attribute
    probabilities without the no-attribute column: renormalised over the 400 for the
    detectron2 layout (as py-bottom-up-attention's demo), not renormalised for MILVLG's
    (as its ``extract_features.py`` and Caffe's ``generate_tsv.py``)."""

    def __init__(self, spec: ButdSpec, proposals: int = 300):
        super().__init__()
        self.spec = spec
        self.post_nms = proposals
        self.backbone = Backbone(spec)
        per_anchor = 1 if spec.layout == "detectron2" else 2
        self.rpn_head = RpnHead(16 * spec.width, spec.rpn_hidden, 12, per_anchor)
        self.roi_heads = RoiHeads(spec)
        mean = torch.tensor(CAFFE_PIXEL_MEAN_BGR).view(3, 1, 1)
        self.register_buffer("pixel_mean", mean, persistent=False)

    def fold_norms(self) -> ButdModel:
        """Fold every frozen batch norm into its convolution (after loading weights)."""
        for module in self.modules():
            if isinstance(module, ConvNorm) and module.bias is None:
                module.fold()
        return self

    def proposals(self, res4: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """RPN proposals of one image (Ren et al. 2015, Sec. 3.1.2 test time) from its
        (1, 16w, h, w) res4 map and its (height, width): score every anchor, keep the top
        6000, decode, clip to the image, drop empty boxes, NMS at 0.7, keep
        ``post_nms``. Returns (P, 4) boxes."""
        logits, deltas = self.rpn_head(res4)  # (1, A or 2A, h, w), (1, 4A, h, w)
        _, _, h, w = res4.shape
        anchors = grid_anchors(h, w, res4.device)  # (h w A, 4)
        if self.spec.layout == "detectron2":
            scores = logits[0].permute(1, 2, 0).reshape(-1)  # (h w A) logits
        else:  # softmax over (background, object) per anchor: its object probability
            pairs = logits[0].view(12, 2, h, w).permute(2, 3, 0, 1).reshape(-1, 2)
            scores = pairs.softmax(dim=-1)[:, 1]
        deltas = deltas[0].view(12, 4, h, w).permute(2, 3, 0, 1).reshape(-1, 4)
        top, idx = scores.float().topk(min(6000, len(scores)))
        # Ren et al. 2015, Eq. 2 inverted; log-scales clamped at log(1000 / 16) as detectron2
        boxes = BoxCoder((1.0, 1.0, 1.0, 1.0)).decode_single(deltas[idx].float(), anchors[idx])
        finite = torch.isfinite(boxes).all(dim=1) & torch.isfinite(top)
        boxes, top = boxes[finite], top[finite]
        ih, iw = size
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, iw)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, ih)
        wide = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        boxes, top = boxes[wide], top[wide]
        keep = batched_nms(boxes, top, torch.zeros_like(top, dtype=torch.long), 0.7)
        return boxes[keep[: self.post_nms]]

    def forward(self, images: list[torch.Tensor], rois=None):
        """(3, H_i, W_i) images, BGR minus means, each at its own size; optional given
        per-image boxes. Returns (per-image rois, features (P, D), class probs (P, C) with
        background first, attribute probs (P, A - 1) or None), P over all images.

        Several images per call without changing any image's regions: the trunk and the
        RPN run on each image alone (no padding reaches an anchor or a RoI, as when it is
        extracted by itself), the RoI heads (res5 over 14x14 cells per region, most of the
        cost) on the regions of all images at once."""
        maps = [self.backbone(image[None]) for image in images]  # (1, 16w, H_i/16, W_i/16)
        if rois is None:
            rois = [self.proposals(m, im.shape[-2:]) for m, im in zip(maps, images, strict=True)]
        feats = self.roi_heads.pooled(maps, rois)  # (P, D)
        logits, attr_logits = self.roi_heads.box_predictor(feats)
        probs = logits.float().softmax(dim=1)  # (P, C)
        attrs = None
        if self.spec.layout == "detectron2":
            probs = torch.cat([probs[:, -1:], probs[:, :-1]], dim=1)  # background first
            if attr_logits is not None:  # py-bottom-up-attention: over the 400 proper
                attrs = attr_logits[:, :-1].float().softmax(dim=1)
        elif attr_logits is not None:  # MILVLG (and generate_tsv.py): all 401, then drop
            attrs = attr_logits.float().softmax(dim=1)[:, 1:]
        return rois, feats, probs, attrs
