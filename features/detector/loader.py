"""Training and evaluation images of the detector as a torch Dataset: resized, flipped,
with their box, class and attribute targets; epochs of seeded jobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from features.decode import BadImage, load_image
from features.detector.config import DetectorConfig
from features.detector.data import DetectionImage
from features.detector.inputs import resize_for_detection
from infra.resume import init_worker


def attribute_targets(attributes: list[list[str]], names: list[str]) -> torch.Tensor:
    """(G, 1 + A) targets of G objects' ``attributes``: uniform over each object's
    attributes among ``names``, or "no attribute"."""
    index = {a: i + 1 for i, a in enumerate(names)}
    out = torch.zeros(len(attributes), len(names) + 1)
    for g, own_names in enumerate(attributes):
        own = [index[a] for a in own_names if a in index]
        if own:
            out[g, own] = 1.0 / len(own)
        else:
            out[g, 0] = 1.0
    return out


class DetectionItems(Dataset):
    """(image index, flip) -> the resized, normalised image and its targets; a bad image
    gives ``None`` (reported once, skipped)."""

    def __init__(
        self,
        images: list[DetectionImage],
        root: Path,
        cfg: DetectorConfig,
        classes: list[str],
        attributes: list[str],
    ):
        self.images, self.root, self.cfg = images, root, cfg
        self.class_index = {c: i + 1 for i, c in enumerate(classes)}
        self.attributes = attributes

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, job: tuple[int, bool]) -> dict:
        i, flip = job
        record = self.images[i]
        try:
            image = load_image(self.root / record.path)  # Pillow's decompression-bomb limit
        except BadImage as err:
            return {"index": i, "error": f"{record.path}: {err.reason} ({err.detail})"}
        tensor, scale = resize_for_detection(image, self.cfg.min_side, self.cfg.max_side)
        boxes = torch.tensor(record.boxes, dtype=torch.float32).reshape(-1, 4) * scale
        w = tensor.shape[2]
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, tensor.shape[1])
        if flip:
            tensor = tensor.flip(2)
            boxes = torch.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], 1)
        labels = torch.tensor([self.class_index.get(n, 0) for n in record.names], dtype=torch.long)
        # names outside the class list are not trained on; nor are boxes that clipping to
        # the image left empty
        known = (labels > 0) & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        target = {"boxes": boxes[known], "labels": labels[known]}
        if self.attributes:
            attrs = record.attributes or [[] for _ in record.names]
            kept = [a for a, k in zip(attrs, known.tolist(), strict=True) if k]
            target["attributes"] = attribute_targets(kept, self.attributes)
        return {"index": i, "error": None, "image": tensor, "target": target}


def epoch_jobs(n: int, cfg: DetectorConfig, epoch: int) -> list[list[tuple[int, bool]]]:
    """Batches of (image index, flip) for ``epoch``: a permutation and flips seeded by
    ``(seed, epoch)``; the tail that does not fill a batch is dropped."""
    rng = np.random.default_rng([cfg.seed, epoch])
    order = rng.permutation(n)
    flips = rng.random(n) < 0.5 if cfg.hflip else np.zeros(n, dtype=bool)
    steps = n // cfg.batch_size
    return [
        [(int(i), bool(flips[i])) for i in order[s * cfg.batch_size : (s + 1) * cfg.batch_size]]
        for s in range(steps)
    ]


def make_loader(items: DetectionItems, batches, cfg: DetectorConfig, seed: int) -> DataLoader:
    """``batches`` (lists of jobs) of ``items``, read by ``cfg.num_workers`` processes.
    The workers' seeds come from ``seed``, not torch's global generator (which the
    detector's samplers draw from); they start with :func:`infra.resume.init_worker`."""
    return DataLoader(
        items,
        batch_sampler=batches,
        num_workers=cfg.num_workers,
        collate_fn=list,  # images differ in size: the model batches them
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=init_worker,
    )
