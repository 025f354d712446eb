"""Region records of the native bottom-up-attention model: per region its 2048-d feature,
box, object id and confidence, attribute id and confidence (the fields of the BUTD
feature files: ``generate_tsv.py``'s and LXMERT's ``obj36``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from features.images.butd.model import ButdModel
from features.images.config import RegionsConfig
from features.images.extractor import HostCopy, to_device
from features.images.regions import RegionExtractor
from features.images.select import butd_select
from features.store.spec import FieldSpec, regions_fields

VISUAL_GENOME = {1601: "visual-genome-1600", 401: "visual-genome-400"}


def resize_caffe(image: Image.Image, min_side: int, max_side: int):
    """Shorter side to ``min_side`` unless the longer would pass ``max_side`` (sizes rounded
    half up, as detectron2's ResizeShortestEdge, which py-bottom-up-attention uses)."""
    w, h = image.size
    scale = min_side / min(w, h)
    if max(w, h) * scale > max_side:
        scale = max_side / max(w, h)
    size = (int(w * scale + 0.5), int(h * scale + 0.5))
    return image.resize(size, Image.BILINEAR), (size[0] / w, size[1] / h)


def to_caffe(image: Image.Image, mean: torch.Tensor) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) BGR 0..255 minus the Caffe pixel means."""
    bgr = np.ascontiguousarray(np.asarray(image, dtype=np.float32)[:, :, ::-1])
    return torch.from_numpy(bgr).permute(2, 0, 1) - mean


class ButdRegionExtractor(RegionExtractor):
    """:class:`RegionExtractor` on :class:`ButdModel`: the same selection
    (:func:`butd_select`); object ids are 0-based in the checkpoint's vocabulary
    (background excluded: 0..1599 for Visual Genome), as in obj36 files."""

    def __init__(self, model: ButdModel, cfg: RegionsConfig, device: torch.device):
        super().__init__(model, cfg, device)
        self.attributes = model.spec.num_attrs > 0

    def fields(self) -> dict[str, FieldSpec]:
        """obj36's fields (as :mod:`features.exchange.butd_tsv` imports them, so the store
        exports to obj36): ``objects_id``/``objects_conf`` and, with the attribute head,
        ``attrs_id``/``attrs_conf`` (-1 past ``n_regions``)."""
        labels = ("objects", "attrs") if self.attributes else ("objects",)
        return regions_fields(self.width, self.dim, labels=labels)

    def prepare(self, image: Image.Image, row: dict) -> dict[str, Any]:
        resized, (sx, sy) = resize_caffe(image, self.cfg.min_side, self.cfg.max_side)
        image_tensor = to_caffe(resized, self.model.pixel_mean.cpu())
        item = {"image": image_tensor, "scale": torch.tensor([sx, sy, sx, sy])}
        return self._given_boxes(item, image, row)

    @torch.no_grad()
    def forward(self, items: list[dict]) -> HostCopy:
        """The model over a batch, on the device: RoIs per image (resized pixels), their
        features, class and attribute probabilities, on their way to host memory."""
        given = None
        if self.given:
            given = [(it["boxes"] * it["scale"]).to(self.device) for it in items]
        images = [to_device(it["image"], self.device) for it in items]
        rois, feats, probs, attrs = self.model(images, given)
        return HostCopy(
            self.device,
            rois=[r.float() for r in rois],
            feats=feats.float(),
            probs=probs,
            attrs=attrs,
        )

    def kept(self, boxes: torch.Tensor, part: slice, out: dict) -> dict[str, torch.Tensor]:
        """One image's kept regions: ``features`` (R, D), ``boxes`` (R, 4),
        ``objects_id``/``objects_conf`` (R,) object id and confidence and, where the model
        has an attribute head, ``attrs_id``/``attrs_conf`` (R,); for given boxes, each one
        with its most likely object."""
        probs, attrs = out["probs"][part], out["attrs"]
        if self.given:
            keep = torch.arange(len(boxes))
            confidence, classes = probs[:, 1:].max(dim=1)
        else:
            keep, classes, confidence = butd_select(boxes, probs, self.cfg)
            classes = classes - 1  # background was column 0
        r = {
            "features": out["feats"][part][keep],
            "boxes": boxes[keep],
            "objects_id": classes,
            "objects_conf": confidence,
        }
        if attrs is not None:
            r["attrs_conf"], r["attrs_id"] = attrs[part][keep].max(dim=1)
        return r

    def provenance_params(self) -> dict:
        """The params, plus the vocabularies the ids index (Visual Genome's 1600 objects
        and 400 attributes for the published checkpoints; else their sizes)."""
        spec = self.model.spec
        objects = VISUAL_GENOME.get(spec.num_classes, f"{spec.num_classes - 1}-objects")
        attributes = VISUAL_GENOME.get(spec.num_attrs, f"{max(spec.num_attrs - 1, 0)}-attrs")
        return {
            **super().provenance_params(),
            "object_vocabulary": objects,
            "attribute_vocabulary": attributes if spec.num_attrs else None,
        }
