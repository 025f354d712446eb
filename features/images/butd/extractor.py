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

    def finish(self, items: list[dict], raw: HostCopy) -> list[dict[str, np.ndarray]]:
        """Each image's selected regions as its store record (-1 ids past ``n_regions``)."""
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
        """The kept regions of each prepared image, in float32: ``features`` (R, D),
        ``boxes`` (R, 4) in original-image pixels, ``objects_id``/``objects_conf`` (R,)
        object id and confidence, ``attrs_id``/``attrs_conf`` (R,) where the model has an
        attribute head; the records of :meth:`__call__` are these, packed."""
        return self.select(items, self.forward(items))

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

    @torch.no_grad()
    def select(self, items: list[dict], raw: HostCopy) -> list[dict[str, torch.Tensor]]:
        """:meth:`regions` from the outputs of :meth:`forward`, on the host."""
        out = raw.wait()
        feats, probs, attrs = out["feats"], out["probs"], out["attrs"]
        outputs, start = [], 0
        for it, boxes in zip(items, out["rois"], strict=True):
            part = slice(start, start + len(boxes))
            start += len(boxes)
            boxes = boxes / it["scale"]  # original-image pixels
            if self.given:
                keep = torch.arange(len(boxes))
                confidence, classes = probs[part, 1:].max(dim=1)
            else:
                keep, classes, confidence = butd_select(boxes, probs[part], self.cfg)
                classes = classes - 1  # background was column 0
            r = {
                "features": feats[part][keep],
                "boxes": boxes[keep],
                "objects_id": classes,
                "objects_conf": confidence,
            }
            if attrs is not None:
                r["attrs_conf"], r["attrs_id"] = attrs[part][keep].max(dim=1)
            outputs.append(r)
        return outputs

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
