"""Visual features: Faster R-CNN regions (bottom-up attention), 7x7 grids, global vectors.

Extractors are pure modules built by the stage's entry point and passed in (tests pass
random-init ones). Each has a ``prepare`` step that runs in DataLoader workers (resize,
normalise: CPU work overlapped with inference), a batched ``forward`` that runs the network
on the device, and a ``finish`` that turns its outputs into per-image numpy records on the
host (selection, packing) while the next batch runs; ``__call__`` is the two in one.
:mod:`features.images.extract` drives them.

Regions follow the bottom-up-attention recipe (Anderson et al. 2018, ``generate_tsv.py``):
the box head's pooled feature of each RPN proposal; per class, NMS over the proposals at
IoU ``nms_iou``; a proposal's confidence is its best class score among the classes for
which it survives NMS; keep proposals with confidence >= ``conf_threshold``, at least
``min_boxes`` and at most ``max_boxes`` of them (the top ones by confidence). Boxes are
the proposals' boxes in original-image pixels, as in the reference tool.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchvision.models.detection.image_list import ImageList

from features.detector.config import DetectorConfig
from features.detector.inputs import batch_images, resize_for_detection, to_tensor
from features.detector.model import build_detector_model, model_from_checkpoint
from features.detector.weights import (
    WeightsError,
    checkpoint_format,
    describe,
    load_exact,
    load_trunk,
    read_checkpoint,
    trunk_state,
)
from features.images.config import RegionsConfig
from features.images.extractor import (
    HostCopy,
    check_conflict,
    feature_params,
    to_device,
    warn_random_init,
    zeros,
)
from features.images.select import butd_select
from features.store.spec import FieldSpec
from infra.device import autocast

DEFAULT_DETECTOR = "resnet101_c4"  # Anderson et al. 2018


DEFAULT_CLASSES = 1601  # Visual Genome: 1600 object classes + background


def build_detector(cfg: RegionsConfig) -> nn.Module:
    """The torchvision detector of the ``regions`` params, weights loaded (or random).

    ``regions.weights`` may be a ``vse-detector`` checkpoint (architecture and class count
    come from it), a torchvision detection state dict (class count from it), a published
    bottom-up-attention checkpoint (:mod:`features.images.butd`: the native model), or an
    ImageNet ResNet state dict, which initialises the trunk (and the C4 res5 head), as the
    bottom-up-attention model was initialised; the RPN and predictor stay random then.
    """
    param = "regions.weights"
    torch.manual_seed(cfg.seed)
    obj = read_checkpoint(cfg.weights, param, cfg.allow_pickle_weights) if cfg.weights else None
    fmt = checkpoint_format(obj) if obj is not None else None
    overrides = {"rpn_post_nms_test": cfg.proposals}
    if fmt == "butd":  # the published bottom-up-attention weights: the native model
        from features.images.butd.checkpoint import butd_from_state

        model = butd_from_state(obj, f"{cfg.weights} ({describe(obj)})", cfg.proposals)
        spec = model.spec
        model.architecture = f"butd-r{3 * sum(spec.blocks) + 2}-{spec.layout}"
        return model
    if fmt == "vse-detector":
        source = f"{cfg.weights} (a vse-detector checkpoint)"
        check_conflict(
            "regions.architecture", cfg.architecture, obj["config"]["architecture"], source
        )
        check_conflict("regions.num_classes", cfg.num_classes, len(obj["classes"]) + 1, source)
        model = model_from_checkpoint(obj, overrides)
        model.architecture = obj["config"]["architecture"]
        return model.eval()
    arch = cfg.architecture or DEFAULT_DETECTOR
    num_classes = cfg.num_classes
    if fmt == "detection" and "roi_heads.box_predictor.cls_score.weight" in obj:
        found = obj["roi_heads.box_predictor.cls_score.weight"].shape[0]
        check_conflict(
            "regions.num_classes", num_classes, found, f"{cfg.weights} ({describe(obj)})"
        )
        num_classes = found
    spec = DetectorConfig(architecture=arch, **overrides)
    # no weights at all: ResNet blocks start as identities, so features stay finite at any
    # depth (torchvision's init makes R101-C4 features overflow float16)
    model = build_detector_model(
        spec, num_classes or DEFAULT_CLASSES, zero_init_residual=obj is None
    )
    model.architecture = arch
    what = f"the regions detector ({arch})"
    if obj is None:
        warn_random_init("regions", cfg.seed)
    elif fmt == "detection":
        load_exact(model, obj, param, what, f"{cfg.weights} ({describe(obj)})")
    elif fmt == "classification":
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
    what = f"the trunk of the regions detector ({arch})"
    source = f"{path} ({describe(obj)})"
    load_trunk(model, state, arch.endswith("_c4"), "regions.weights", what, source)
    warnings.warn(
        f"regions: {path} initialises only the trunk of {arch}; the RPN and the box "
        "predictor are RANDOM, so regions and scores are meaningless until it is trained "
        "(vse train detector)",
        stacklevel=3,
    )


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
        return self._given_boxes({"image": to_tensor(resized), "scale": scale}, image, row)

    def _given_boxes(self, item: dict, image: Image.Image, row: dict) -> dict:
        """``item`` with the image's height and width and, with ``given`` boxes, the first
        ``max_boxes`` of the manifest row's boxes (original-image pixels)."""
        item["hw"] = image.size[::-1]
        if self.given:
            boxes = np.asarray(row.get("boxes") or np.zeros((0, 4)), dtype=np.float32)
            item["boxes"] = torch.from_numpy(boxes[: self.width]).reshape(-1, 4)
        return item

    def __call__(self, items: list[dict]) -> list[dict[str, np.ndarray]]:
        return self.finish(items, self.forward(items))

    @torch.no_grad()
    def forward(self, items: list[dict]) -> HostCopy:
        """The network over a batch, on the device: RoIs per image (resized pixels), their
        pooled features and class probabilities, on their way to host memory."""
        rois, pooled, logits = self._forward(items)
        probs = None if logits is None else F.softmax(logits.float(), dim=-1)
        return HostCopy(
            self.device, rois=[r.float() for r in rois], pooled=pooled.float(), probs=probs
        )

    @torch.no_grad()
    def finish(self, items: list[dict], raw: HostCopy) -> list[dict[str, np.ndarray]]:
        """On the host, beside the next batch's forward: each image's selected regions,
        packed as its store record."""
        out = raw.wait()
        pooled, scores = out["pooled"], out["probs"]
        outputs = []
        start = 0
        for it, boxes in zip(items, out["rois"], strict=True):
            n = len(boxes)
            feats = pooled[start : start + n]
            probs = None if scores is None else scores[start : start + n]
            start += n
            boxes = boxes / it["scale"]  # back to original-image pixels
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
        images = ImageList(to_device(images.tensors, self.device), images.image_sizes)
        with autocast(self.device):
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
