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

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import box_iou

from features.detector import (
    ResNetTrunk,
    build_detector_model,
    model_from_checkpoint,
    resnet_depth,
)
from features.images import centre_crop_resize
from features.store import FieldSpec
from features.visual_config import DetectorConfig, ExtractConfig, GridConfig, RegionsConfig
from features.weights import (
    WeightsError,
    checkpoint_kind,
    describe,
    load_exact,
    read_checkpoint,
    trunk_state,
)

DEFAULT_DETECTOR = "resnet101_c4"  # Anderson et al. 2018
DEFAULT_CLASSES = 1601  # Visual Genome: 1600 object classes + background
DEFAULT_TRUNK = "resnet152"  # VSE++, UniVSE

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Part of every store fingerprint: bump it with any change that alters extracted features,
# or a persisted store made by the old code is kept (its fingerprint still matches).
EXTRACTOR_VERSION = "2"  # 2: exact BUTD selection (classes of unsurvived proposals)


# --------------------------------------------------------------------------- helpers


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


def _conflict(param: str, given, found, source: str) -> None:
    if given is not None and given != found:
        raise WeightsError(
            f"{param} is {given!r} but {source} says {found!r}; remove the param (it is "
            "taken from the checkpoint) or give a checkpoint that matches"
        )


def build_detector(cfg: RegionsConfig) -> nn.Module:
    """The torchvision detector of the ``regions`` params, weights loaded (or random).

    ``regions.weights`` may be a ``vse-detector`` checkpoint (architecture and class count
    come from it), a torchvision detection state dict (class count from it), or an
    ImageNet ResNet state dict, which initialises the trunk (and the C4 res5 head), as the
    bottom-up-attention model was initialised; the RPN and predictor stay random then.
    """
    param = "regions.weights"
    torch.manual_seed(cfg.seed)
    obj = read_checkpoint(cfg.weights, param) if cfg.weights else None
    kind = checkpoint_kind(obj) if obj is not None else None
    overrides = {"rpn_post_nms_test": cfg.proposals}
    if kind == "vse-detector":
        source = f"{cfg.weights} (a vse-detector checkpoint)"
        _conflict("regions.architecture", cfg.architecture, obj["config"]["architecture"], source)
        _conflict("regions.num_classes", cfg.num_classes, len(obj["classes"]) + 1, source)
        model = model_from_checkpoint(obj, overrides)
        model.architecture = obj["config"]["architecture"]
        return model.eval()
    arch = cfg.architecture or DEFAULT_DETECTOR
    num_classes = cfg.num_classes
    if kind == "detection" and "roi_heads.box_predictor.cls_score.weight" in obj:
        found = obj["roi_heads.box_predictor.cls_score.weight"].shape[0]
        _conflict("regions.num_classes", num_classes, found, f"{cfg.weights} ({describe(obj)})")
        num_classes = found
    spec = DetectorConfig(architecture=arch, **overrides)
    model = build_detector_model(spec, num_classes or DEFAULT_CLASSES)
    model.architecture = arch
    what = f"the regions detector ({arch})"
    if obj is None:
        _warn_random("regions", cfg.seed)
    elif kind == "detection":
        load_exact(model, obj, param, what, f"{cfg.weights} ({describe(obj)})")
    elif kind == "classification":
        _load_imagenet_trunk(model, obj, cfg.weights, arch)
    else:
        raise WeightsError(
            f"{param}: {cfg.weights} is {describe(obj)}; {what} takes a vse-detector "
            "checkpoint, a torchvision detection state dict or an ImageNet ResNet state dict"
        )
    return model.eval()


def _load_imagenet_trunk(model: nn.Module, obj: dict, path: str, arch: str) -> None:
    """ImageNet weights into the detector's trunk (``backbone.body``; for C4 also the res5
    box head), as Anderson et al. initialised theirs; the rest stays random."""
    state = trunk_state(obj, "regions.weights")
    source = f"{path} ({describe(obj)})"
    what = f"the trunk of the regions detector ({arch})"
    if arch.endswith("_c4"):
        head = {k[len("layer4.") :]: v for k, v in state.items() if k.startswith("layer4.")}
        state = {k: v for k, v in state.items() if not k.startswith("layer4.")}
        load_exact(model.roi_heads.box_head.layer4, head, "regions.weights", what, source)
    load_exact(model.backbone.body, state, "regions.weights", what, source)
    warnings.warn(
        f"regions: {path} initialises only the trunk of {arch}; the RPN and the box "
        "predictor are RANDOM, so regions and scores are meaningless until it is trained "
        "(vse train detector)",
        stacklevel=3,
    )


def _warn_random(what: str, seed: int) -> None:
    warnings.warn(
        f"{what}: NO WEIGHTS GIVEN, using RANDOM initialisation (seed {seed}). Features "
        "are only useful for testing the pipeline; set `weights:` to a local checkpoint "
        "for real runs. The store's fingerprint records the random init.",
        stacklevel=3,
    )


def butd_select(
    boxes: torch.Tensor, scores: torch.Tensor, cfg: RegionsConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bottom-up-attention region selection; returns kept indices, their class, confidence.

    The result is exactly that of the per-class loop of bottom-up-attention's
    ``generate_tsv.py`` with torchvision's ``nms``: for each class c >= 1 (column 0 of the
    softmax ``scores`` (P, C) is background), greedy NMS over all proposals ordered by
    ``scores[:, c]`` (descending; ties by proposal index, as torchvision's stable sort) at
    IoU ``> nms_iou``; ``max_conf[i]`` = the best score of proposal i among the classes in
    which it survives (0 if none); keep the proposals with ``max_conf >= conf_threshold``,
    at least ``min_boxes`` and at most ``max_boxes``, ranked by ``max_conf`` (descending,
    ties by index; the paper's tool keeps the in-range case in index order). A proposal's
    class is the lowest class reaching its ``max_conf``; one that survives in no class
    with a positive score (kept only to reach ``min_boxes``) gets its top-scoring class.

    The loop costs C NMS runs; this does the same selection from one IoU matrix and only
    the (proposal, class) pairs that can matter. Survival of pair (i, c) depends only on
    the pairs of class c that precede it, so NMS restricted to the pairs scoring
    ``>= tau`` is exact for them, and gives ``max_conf`` exactly for every proposal whose
    ``max_conf >= tau`` (the others are known to be below ``tau``). With ``tau =
    conf_threshold`` that decides everything unless fewer than ``min_boxes`` proposals
    pass; then ``tau`` drops to a value that at least ``min_boxes`` proposals are known to
    reach (each class's top proposal always survives), or to 0 (all pairs) in degenerate
    cases. NMS itself runs for all classes at once, one rank at a time, on bitsets.
    """
    n = len(boxes)
    fg = scores[:, 1:]  # (P, C-1)
    if n == 0 or fg.shape[1] == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, torch.zeros(0, dtype=scores.dtype)
    # torchvision's nms compares the float IoU with the threshold as a double
    over = box_iou(boxes, boxes).double() > cfg.nms_iou  # (P, P) suppression relation
    target = min(cfg.min_boxes, n)
    tau = cfg.conf_threshold
    max_conf, best = _max_conf_from(fg, over, tau)
    if int((max_conf >= tau).sum()) < target and tau > 0:
        # each class's top proposal survives its NMS: a lower bound on max_conf
        top_score, top_box = fg.max(dim=0)
        bound = torch.zeros(n, dtype=fg.dtype).scatter_reduce(0, top_box, top_score, "amax")
        ranked_bound = bound.sort(descending=True).values
        tau = min(tau, float(ranked_bound[target - 1])) if target else tau
        max_conf, best = _max_conf_from(fg, over, tau)
    confidence = torch.where(max_conf >= tau, max_conf, torch.zeros_like(max_conf))
    ranked = torch.argsort(confidence, descending=True, stable=True)
    n_keep = int((confidence >= cfg.conf_threshold).sum())
    n_keep = min(max(n_keep, cfg.min_boxes), cfg.max_boxes, n)
    keep = ranked[:n_keep]
    classes = torch.where(best[keep] >= 0, best[keep], fg[keep].argmax(dim=1))
    return keep, classes + 1, confidence[keep]


def _max_conf_from(
    fg: torch.Tensor, over: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class greedy NMS on the pairs scoring ``>= tau``; returns ``max_conf`` (P,)
    (exact where ``>= tau``) and the lowest class reaching it with a positive score (-1
    where there is none)."""
    n = len(fg)
    box, cls = torch.nonzero(fg >= tau, as_tuple=True)  # box-major: box ascending per class
    score = fg[box, cls]
    order = torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(cls[order], stable=True)]  # class, score desc, box asc
    box, cls, score = box[order], cls[order], score[order]
    survives = _grouped_nms(box, cls, over)
    max_conf = torch.zeros(n, dtype=fg.dtype)
    best = torch.full((n,), -1, dtype=torch.long)
    if len(box) == 0:
        return max_conf, best
    alive = survives & (score > 0)
    max_conf.scatter_reduce_(0, box[alive], score[alive], "amax")
    winner = alive & (score == max_conf[box])
    big = fg.shape[1]
    lowest = torch.full((n,), big, dtype=torch.long)
    lowest.scatter_reduce_(0, box[winner], cls[winner], "amin")
    best = torch.where(lowest < big, lowest, best)
    return max_conf, best


def _grouped_nms(box: torch.Tensor, cls: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    """Greedy NMS of every class at once: pairs sorted by class, then rank; ``over[a, b]``
    says a kept ``a`` suppresses ``b``. Step r decides the r-th pair of every class, whose
    suppression by earlier kept pairs is read from per-class bitsets (32 boxes a word)."""
    if len(box) == 0:
        return torch.zeros(0, dtype=torch.bool)
    n = len(over)
    words = -(-n // 32)
    padded = torch.zeros(n, words * 32, dtype=torch.int64)
    padded[:, :n] = over.to(torch.int64)
    bits = (padded.view(n, words, 32) << torch.arange(32)).sum(dim=2)  # (P, W)
    classes, counts = torch.unique_consecutive(cls, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(box)) - torch.repeat_interleave(starts, counts)
    group = torch.repeat_interleave(torch.arange(len(classes)), counts)
    table = torch.full((len(classes), int(counts.max())), -1, dtype=torch.long)
    table[group, rank] = box  # (G, R) proposals of each class in NMS order
    kept = torch.zeros_like(table, dtype=torch.bool)
    suppressed = torch.zeros(len(classes), words, dtype=torch.int64)  # (G, W) bitsets
    for r in range(table.shape[1]):
        b = table[:, r]
        valid = b >= 0
        b = b.clamp(min=0)
        word = suppressed.gather(1, (b // 32)[:, None])[:, 0]
        keep = valid & (((word >> (b % 32)) & 1) == 0)
        kept[:, r] = keep
        suppressed |= bits[b] * keep[:, None]
    return kept[group, rank]


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
        architecture = getattr(self.model, "architecture", self.cfg.architecture)
        return f"regions-{self.cfg.backend}-{architecture}"

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
        scores = None if logits is None else F.softmax(logits.float(), dim=-1).cpu()
        outputs = []
        start = 0
        for it, boxes in zip(items, rois, strict=True):
            n = len(boxes)
            feats = pooled[start : start + n]
            probs = None if scores is None else scores[start : start + n]
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
            # class scores only: the selection keeps proposal boxes, so the per-class box
            # regression (4 x classes outputs a region) is not computed; given boxes need
            # no scores at all
            logits = None if self.given else heads.box_predictor.cls_score(pooled)
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
    if obj is not None and checkpoint_kind(obj) == "vse-detector":
        found = f"resnet{resnet_depth(obj['config']['architecture'])}"
        _conflict("grid.architecture", arch, found, f"{cfg.weights} (a vse-detector checkpoint)")
        arch = found
    arch = arch or DEFAULT_TRUNK
    trunk = ResNetTrunk(resnet_depth(arch))
    trunk.architecture = arch
    if obj is None:
        _warn_random("grid", cfg.seed)
    else:
        source = f"{cfg.weights} ({describe(obj)})"
        load_exact(trunk, trunk_state(obj, param), param, f"the grid trunk ({arch})", source)
    return trunk.eval()


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
