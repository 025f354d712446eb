"""The regions stage's extractor: bottom-up-attention region features from a torchvision
Faster R-CNN (Anderson et al. 2018): the box head's pooled feature of each RPN proposal,
selected by :func:`features.images.select.butd_select`, boxes in original-image pixels as in
the reference tool; or the features at the manifest's boxes (``backend: given``).
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
from features.detector.inputs import batch_images, resize_for_detection
from features.detector.model import (
    backbone_with_conv5,
    build_detector_model,
    model_from_checkpoint,
)
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
    ImageExtractor,
    check_conflict,
    to_device,
    warn_random_init,
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
    source = f"{cfg.weights} ({describe(obj)})" if obj is not None else ""
    overrides = {"rpn_post_nms_test": cfg.proposals}
    if fmt == "butd":  # the published bottom-up-attention weights: the native model
        from features.images.butd.checkpoint import butd_from_state

        model = butd_from_state(obj, source, cfg.proposals)
        spec = model.spec
        model.architecture = f"butd-r{3 * sum(spec.blocks) + 2}-{spec.layout}"
        return model
    if fmt == "vse-detector":
        own = f"{cfg.weights} (a vse-detector checkpoint)"
        check_conflict("regions.architecture", cfg.architecture, obj["config"]["architecture"], own)
        check_conflict("regions.num_classes", cfg.num_classes, len(obj["classes"]) + 1, own)
        model = model_from_checkpoint(obj, overrides)
        model.architecture = obj["config"]["architecture"]
        return model.eval()
    arch = cfg.architecture or DEFAULT_DETECTOR
    num_classes = cfg.num_classes
    if fmt == "detection" and "roi_heads.box_predictor.cls_score.weight" in obj:
        found = obj["roi_heads.box_predictor.cls_score.weight"].shape[0]
        check_conflict("regions.num_classes", num_classes, found, source)
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
        load_exact(model, obj, param, what, source)
    elif fmt == "classification":
        # as Anderson et al. initialised theirs: the trunk (and the C4 res5 head) only
        trunk = f"the trunk of the regions detector ({arch})"
        load_trunk(model, trunk_state(obj, param), arch.endswith("_c4"), param, trunk, source)
        warnings.warn(
            f"regions: {cfg.weights} initialises only the trunk of {arch}; the RPN and the "
            "box predictor are RANDOM, so regions and scores are meaningless until it is "
            "trained (vse train detector)",
            stacklevel=2,
        )
    else:
        raise WeightsError(
            f"{param}: {cfg.weights} is {describe(obj)}; {what} takes a vse-detector "
            "checkpoint, a torchvision detection state dict or an ImageNet ResNet state dict"
        )
    return model.eval()


class RegionExtractor(ImageExtractor):
    """Region features from a torchvision Faster R-CNN, or at given boxes (``given``)."""

    kind = "regions"

    def __init__(self, model: nn.Module, cfg: RegionsConfig, device: torch.device):
        super().__init__(model, cfg, device)
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
        tensor, scale = resize_for_detection(image, self.cfg.min_side, self.cfg.max_side)
        return self._given_boxes({"image": tensor, "scale": scale}, image, row)

    def _given_boxes(self, item: dict, image: Image.Image, row: dict) -> dict:
        """``item`` with the image's height and width and, with ``given`` boxes, the first
        ``max_boxes`` of the manifest row's boxes (original-image pixels)."""
        item["hw"] = image.size[::-1]
        if self.given:
            boxes = np.asarray(row.get("boxes") or np.zeros((0, 4)), dtype=np.float32)
            item["boxes"] = torch.from_numpy(boxes[: self.width]).reshape(-1, 4)
        return item

    @torch.no_grad()
    def forward(self, items: list[dict]) -> HostCopy:
        """The network over a batch, on the device: RoIs per image (resized pixels), their
        pooled box-head features (sum P, D) and class probabilities (sum P, C), on their way
        to host memory."""
        images = batch_images([it["image"] for it in items])
        images = ImageList(to_device(images.tensors, self.device), images.image_sizes)
        with autocast(self.device):
            feature_maps, _ = backbone_with_conv5(self.model, images.tensors)
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
        probs = None if logits is None else F.softmax(logits.float(), dim=-1)
        return HostCopy(
            self.device, rois=[r.float() for r in rois], feats=pooled.float(), probs=probs
        )

    @torch.no_grad()
    def finish(self, items: list[dict], raw: HostCopy) -> list[dict[str, np.ndarray]]:
        """On the host, beside the next batch's forward: each image's selected regions
        (:meth:`select`), packed as its store record (ids -1 past ``n_regions``)."""
        outputs = []
        for it, r in zip(items, self.select(items, raw), strict=True):
            out = self.empty()
            n = len(r["boxes"])
            for name, value in r.items():
                if name.endswith("_id"):
                    out[name][:] = -1
                out[name][:n] = value.numpy()
            out["n_regions"] = np.int32(n)
            out["image_hw"] = np.asarray(it["hw"], dtype=np.int32)
            outputs.append(out)
        return outputs

    def regions(self, items: list[dict]) -> list[dict[str, torch.Tensor]]:
        """The kept regions of each prepared image: its record's fields (``features``
        (R, D) and ``boxes`` (R, 4) in original-image pixels, float32; ids, scores)."""
        return self.select(items, self.forward(items))

    @torch.no_grad()
    def select(self, items: list[dict], raw: HostCopy) -> list[dict[str, torch.Tensor]]:
        """:meth:`regions` from the outputs of :meth:`forward`, on the host."""
        out = raw.wait()
        outputs, start = [], 0
        for it, boxes in zip(items, out["rois"], strict=True):
            part = slice(start, start + len(boxes))
            start += len(boxes)
            outputs.append(self.kept(boxes / it["scale"], part, out))  # original-image pixels
        return outputs

    def kept(self, boxes: torch.Tensor, part: slice, out: dict) -> dict[str, torch.Tensor]:
        """One image's kept regions from its ``boxes`` and its ``part`` of the batch's
        outputs: all of them, without a class, for given boxes; else :func:`butd_select`'s."""
        n = len(boxes)
        if self.given:
            keep = torch.arange(n)
            classes = torch.full((n,), -1, dtype=torch.long)
            confidence = torch.ones(n)
        else:
            keep, classes, confidence = butd_select(boxes, out["probs"][part], self.cfg)
        feats = out["feats"][part][keep]
        return {"features": feats, "boxes": boxes[keep], "classes": classes, "scores": confidence}
