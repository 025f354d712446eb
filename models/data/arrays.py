"""Batches as arrays: what the sources gather (image and text fields, scene-graph phrases)
and :func:`finish`, which makes a raw batch what the models read."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from models.common import lengths_mask
from models.data.info import FLOAT_INPUTS


def phrase_ids(text: str, index: dict[str, int]) -> list[int]:
    """Vocabulary ids of a phrase's words (no <start>/<end>); unknown words are <unk>."""
    from features.text.vocab import words

    unk = index["<unk>"]
    return [index.get(w, unk) for w in words(text)] or [unk]


def scene_graph_batch(graphs: Sequence[dict], index: dict[str, int]) -> dict[str, torch.Tensor]:
    """Scene graphs (rows of scenegraphs.parquet) -> the padded component tensors."""
    out = {}
    for name, text in (("objects", "span"), ("attributes", "attribute"), ("relations", "relation")):
        rows = [[phrase_ids(c[text], index) for c in g[name]] for g in graphs]
        n = max([len(r) for r in rows] + [1])
        w = max([len(p) for r in rows for p in r] + [1])
        ids = np.zeros((len(rows), n, w), dtype=np.int64)  # (B, N, W)
        mask = np.zeros((len(rows), n), dtype=bool)  # (B, N)
        for b, row in enumerate(rows):
            for i, phrase in enumerate(row):
                ids[b, i, : len(phrase)] = phrase
                mask[b, i] = True
        out[name], out[f"{name[:-1]}_mask"] = torch.from_numpy(ids), torch.from_numpy(mask)
    for key, component, field in (
        ("attribute_objects", "attributes", "object"),
        ("relation_subjects", "relations", "subject"),
        ("relation_objects", "relations", "object"),
    ):
        pointers = np.zeros(out[component].shape[:2], dtype=np.int64)  # (B, N)
        for b, g in enumerate(graphs):
            pointers[b, : len(g[component])] = [item[field] for item in g[component]]
        out[key] = torch.from_numpy(pointers)
    return out


def put(alloc, values: np.ndarray, dtype=None) -> np.ndarray:
    """A copy of a (small) array in memory from ``alloc``."""
    values = np.asarray(values, dtype=dtype)
    out = alloc(values.shape, values.dtype)
    out[...] = values
    return out


def image_arrays(inputs, stores, rows, alloc=np.empty) -> dict[str, np.ndarray]:
    """The image side of a raw batch (stored dtypes): ``stores`` by role ("global",
    "regions", "grid"; a :class:`features.store.Store` or anything with its ``gather`` and
    ``fields``) and each role's sample ``rows``."""
    out: dict[str, np.ndarray] = {}
    if "image" in inputs:
        out["image"] = stores["global"].gather("features", rows["global"], alloc)  # (B, Di)
    if "regions" in inputs:
        store, r = stores["regions"], rows["regions"]
        out["regions"] = store.gather("features", r, alloc)  # (B, R, Dr)
        lengths = alloc((len(r),), np.int64)
        np.maximum(store.gather("n_regions", r), 1, out=lengths)
        out["region_lengths"] = lengths  # (B,)
        if "boxes" in inputs:
            hw = np.maximum(store.gather("image_hw", r).astype(np.float32), 1)  # (B, 2): h, w
            boxes = store.gather("boxes", r, alloc).astype(np.float32, copy=False)  # (B, R, 4)
            np.divide(boxes, hw[:, [1, 0, 1, 0]][:, None, :], out=boxes)
            out["boxes"] = boxes  # x1, y1, x2, y2 over the image width / height
            out["image_aspect"] = hw[:, 1] / hw[:, 0]  # (B,) width / height
    if "grid" in inputs:
        grid = stores["grid"].gather("features", rows["grid"], alloc)  # (B, g, g, Dg)
        out["grid"] = grid.reshape(len(grid), -1, grid.shape[-1])  # (B, G, Dg)
    return out


def text_arrays(inputs, text, rows, tfidf_dim: int = 0, alloc=np.empty) -> dict[str, np.ndarray]:
    """The text side of a raw batch from the caption-level text store (or anything with
    its ``gather``, ``gather_ragged``) at caption ``rows``; ragged fields zero-padded."""
    out: dict[str, np.ndarray] = {}
    if "words" in inputs:
        ids, lengths = text.gather_ragged("word_ids", rows)  # (B, L) int32
        out["words"] = put(alloc, ids, np.int64)
        out["word_lengths"] = put(alloc, lengths)  # (B,)
    if "tokens" in inputs:
        out["tokens"], lengths = text.gather_ragged("features", rows, alloc)  # (B, T, Dt)
        out["token_lengths"] = put(alloc, lengths)
    if "document" in inputs:
        out["document"] = text.gather("document", rows, alloc)  # (B, Dd)
    if "tfidf" in inputs:
        terms, counts = text.gather_ragged("tfidf_indices", rows)  # (B, K)
        values, _ = text.gather_ragged("tfidf_values", rows)
        dense = alloc((len(counts), tfidf_dim), np.float32)  # (B, V)
        dense.fill(0)
        valid = np.arange(terms.shape[1])[None, :] < counts[:, None]
        dense[np.nonzero(valid)[0], terms[valid]] = values[valid]
        out["tfidf"] = dense
    return out


class _KeysAt:
    """``keys[positions[i]]``, looked up only when an error names one."""

    def __init__(self, keys, positions):
        self.keys, self.positions = keys, positions

    def __getitem__(self, i: int) -> str:
        return self.keys[int(self.positions[i])]


def refuse_non_finite_inputs(batch: dict, urls: dict, image_keys, caption_keys) -> None:
    """One line naming the store, field and key of the first sample of ``batch`` (a raw
    batch, rows aligned with ``image_keys`` / ``caption_keys``) whose float input holds NaN
    or infinite values: a model never trains or is evaluated on them. One vectorised pass
    per array, where the batch is built (off the training step)."""
    from infra.finite import check_finite

    for key, (role, name) in FLOAT_INPUTS.items():
        value = batch.get(key)
        if value is None or value.dtype.kind != "f" or np.isfinite(value).all():
            continue
        keys = caption_keys if role == "text" else image_keys
        check_finite(value, urls.get(role, role), name, keys)


def finish(batch: dict, stats: dict, alloc=None) -> dict:
    """A raw batch (tensors, on the CPU or a device) as the models read it: every
    floating tensor in float32, the image inputs named in ``stats`` standardised as ``(x -
    mean) / std`` (``stats[key] = (mean, std)``, on the batch's device) with padded
    regions kept zero. One pass per array, in place; CPU outputs in memory from
    ``alloc`` when given."""
    out = dict(batch)
    for key, value in batch.items():
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        if value.dtype == torch.float32 and key not in stats:
            continue
        if alloc is not None and value.device.type == "cpu":
            target = torch.from_numpy(alloc(tuple(value.shape), np.float32))
        else:
            target = torch.empty(value.shape, dtype=torch.float32, device=value.device)
        target.copy_(value)
        if key in stats:
            mean, std = stats[key]
            target.sub_(mean).div_(std)
        out[key] = target
    if "regions" in stats and "region_lengths" in out:
        lengths = out["region_lengths"]
        width = out["regions"].shape[1]
        host = getattr(lengths, "host", lengths)  # decided on the host: no device sync
        if len(host) and int(host.min()) < width:
            valid = lengths_mask(lengths, width)  # (B, R)
            out["regions"].masked_fill_(~valid.unsqueeze(-1), 0)  # padding stays zero
    return out


def floored_std(std: np.ndarray, ratio: float = 0.1) -> np.ndarray:
    """Per-dimension ``std`` floored at ``ratio`` of the root-mean-square one: a dimension
    that barely varies on train (a ReLU unit that never fires there) must not dominate
    when it fires on a test image."""
    return np.maximum(std, ratio * np.sqrt(np.mean(np.square(std))) + 1e-12)


def as_tensors(batch: dict) -> dict:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to ``device`` without blocking (from pinned memory the copy is
    asynchronous). A ``*_lengths`` tensor that moves keeps its host copy as ``.host``
    (:func:`models.common.host_lengths`): packing a sequence needs lengths on the host,
    and fetching them back would wait for the device."""
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            moved = value.to(device, non_blocking=True)
            if key.endswith("_lengths") and moved is not value:
                moved.host = value
            value = moved
        out[key] = value
    return out
