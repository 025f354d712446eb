"""Training and evaluation batches from the feature stores.

Every model reads the same kind of batch: a dict of tensors whose keys depend on what the
model declares in ``inputs``. Image-side keys are indexed by image, text-side keys by
caption; a training batch pairs caption ``c`` with its image, so row ``b`` of both sides is
a positive pair.

Image side::

    image            (B, Di)        global CNN feature (global store)
    regions          (B, R, Dr)     region features, zero-padded (regions store)
    region_lengths   (B,)           valid regions
    boxes            (B, R, 4)      x1, y1, x2, y2 divided by the image width/height
    grid             (B, G, Dg)     grid features, G = rows * cols (grid store)
    labels           (B,)           class id (manifest), also given with the text side

Text side::

    words, word_lengths        (B, L), (B,)       <start> w1 .. wn <end> vocabulary ids
    tokens, token_lengths      (B, T, Dt), (B,)   frozen BERT token features
    document                   (B, Dd)            HUSE document feature
    tfidf                      (B, V)             dense TF-IDF vector
    objects, attributes, relations                (B, N, W) word ids of each scene-graph
                                                  component's phrase (0-padded), with
    object_mask, attribute_mask, relation_mask    (B, N)
    attribute_objects                             (B, N) index of the modified object
    relation_subjects, relation_objects           (B, N) object indices
    text_labels                (B,)               class id of the caption's image

``DataInfo`` carries the dimensions a model is built with; it is plain data so that a
checkpoint can rebuild the model without the stores.

Two steps make a batch. A source *builds* a raw batch (``build(kind, index, alloc)``):
numpy arrays in the stored dtypes (float16 features, int32 ids widened to int64),
gathered with one vectorised copy per field (:meth:`features.store.Store.gather`),
into memory the caller provides. :func:`finish` makes it what the models read: float32,
image inputs standardised, on the device; it runs once, on the GPU when there is one
(:mod:`models.batches` runs both steps ahead of the training loop). The sources:
:class:`PairData` (the feature stores, memory-mapped) and
:class:`models.shard_data.ShardData` (WebDataset shards built from the same stores).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from features.config import UserError
from models.common import lengths_mask

STATS_BLOCK = 128  # images read at a time for the feature statistics
IMAGE_INPUTS = frozenset({"image", "regions", "grid", "labels"})
TEXT_INPUTS = frozenset({"words", "tokens", "document", "tfidf", "scene_graph", "labels"})


@dataclass(frozen=True)
class DataInfo:
    """Sizes of the inputs a model is built for (0 where the model does not use one)."""

    image_dim: int = 0
    region_dim: int = 0
    grid_dim: int = 0
    token_dim: int = 0
    document_dim: int = 0
    vocab_size: int = 0
    tfidf_dim: int = 0
    n_classes: int = 0
    # HUSE's semantic graph A[c, c']: cosine distance between class-name embeddings
    class_distances: list[list[float]] | None = None
    # UniVSE's negative-sampling vocabularies as word-id phrases: nouns, adjectives, relations
    negatives: dict[str, list[list[int]]] = field(default_factory=dict)
    # per-dimension [mean, std] of image inputs over train images, when standardised
    feature_stats: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FeaturePaths:
    """Where the stage's inputs are; every path comes from dvc.yaml via the CLI."""

    manifest: Path
    global_: Path | None = None
    regions: Path | None = None
    grid: Path | None = None
    text: Path | None = None
    vocab: Path | None = None
    scenegraphs: Path | None = None  # folder: graphs.parquet and negatives.json


class DataError(UserError):
    """A missing or inconsistent input, named with what to do about it."""


def _need(path: Path | None, flag: str, what: str) -> Path:
    if path is None:
        raise DataError(f"this model reads {what}: pass {flag} PATH")
    if not Path(path).exists() and "://" not in str(path):
        raise DataError(f"{path}: not found ({what}); run `dvc repro` to build it")
    return Path(path)


def phrase_ids(text: str, index: dict[str, int]) -> list[int]:
    """Vocabulary ids of a phrase's words (no <start>/<end>); unknown words are <unk>."""
    from features.text import words

    unk = index["<unk>"]
    return [index.get(w, unk) for w in words(text)] or [unk]


def _pad_phrases(rows: list[list[list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-caption lists of phrases -> ``(B, N, W)`` ids and ``(B, N)`` mask."""
    n = max([len(r) for r in rows] + [1])
    w = max([len(p) for r in rows for p in r] + [1])
    ids = np.zeros((len(rows), n, w), dtype=np.int64)
    mask = np.zeros((len(rows), n), dtype=bool)
    for b, row in enumerate(rows):
        for i, phrase in enumerate(row):
            ids[b, i, : len(phrase)] = phrase
            mask[b, i] = True
    return ids, mask


def _pad_index(rows: list[list[int]], n: int) -> np.ndarray:
    out = np.zeros((len(rows), n), dtype=np.int64)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out


def scene_graph_batch(graphs: Sequence[dict], index: dict[str, int]) -> dict[str, torch.Tensor]:
    """Scene graphs (rows of scenegraphs.parquet) -> the padded component tensors."""
    objects = [[phrase_ids(o["span"], index) for o in g["objects"]] for g in graphs]
    attributes = [[phrase_ids(a["attribute"], index) for a in g["attributes"]] for g in graphs]
    relations = [[phrase_ids(r["relation"], index) for r in g["relations"]] for g in graphs]
    out = {}
    for name, rows in (("objects", objects), ("attributes", attributes), ("relations", relations)):
        ids, mask = _pad_phrases(rows)
        out[name], out[f"{name[:-1]}_mask"] = torch.from_numpy(ids), torch.from_numpy(mask)
    n_attr, n_rel = out["attributes"].shape[1], out["relations"].shape[1]
    out["attribute_objects"] = torch.from_numpy(
        _pad_index([[a["object"] for a in g["attributes"]] for g in graphs], n_attr)
    )
    out["relation_subjects"] = torch.from_numpy(
        _pad_index([[r["subject"] for r in g["relations"]] for g in graphs], n_rel)
    )
    out["relation_objects"] = torch.from_numpy(
        _pad_index([[r["object"] for r in g["relations"]] for g in graphs], n_rel)
    )
    return out


def _put(alloc, values: np.ndarray, dtype=None) -> np.ndarray:
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
        if "boxes" in store.fields:
            hw = store.gather("image_hw", r).astype(np.float32)  # (B, 2): height, width
            boxes = store.gather("boxes", r, alloc).astype(np.float32, copy=False)  # (B, R, 4)
            np.divide(boxes, np.maximum(hw[:, [1, 0, 1, 0]], 1)[:, None, :], out=boxes)
            out["boxes"] = boxes  # x1, y1, x2, y2 over the image width / height
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
        out["words"] = _put(alloc, ids, np.int64)
        out["word_lengths"] = _put(alloc, lengths)  # (B,)
    if "tokens" in inputs:
        out["tokens"], lengths = text.gather_ragged("features", rows, alloc)  # (B, T, Dt)
        out["token_lengths"] = _put(alloc, lengths)
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


class PairData:
    """The images and captions of one split, read from the stores batch by batch.

    ``caption_image[c]`` is the position (within this split's images) of caption ``c``'s
    image; stores are joined by key, never by row position.
    """

    def __init__(
        self,
        paths: FeaturePaths,
        split: str,
        inputs: frozenset[str],
        *,
        text: FeaturePaths | None = None,
        class_embedder: Callable[[list[str]], np.ndarray] | None = None,
    ):
        from features.ingest import read_manifest
        from features.store import Store, join_by_key

        self.inputs = inputs
        manifest = read_manifest(_need(paths.manifest, "--manifest", "the manifest"))
        table = manifest.split(split)
        if table.num_rows == 0:
            raise DataError(f"{paths.manifest}: split {split!r} has no images")
        self.split = split
        self.image_keys = table["key"].to_pylist()
        self.labels = np.asarray(table["label"].to_numpy(zero_copy_only=False), dtype=np.int64)
        captions = table["captions"].to_pylist()
        self.caption_keys = [
            f"{k}#{i}"
            for k, caps in zip(self.image_keys, captions, strict=True)
            for i in range(len(caps))
        ]
        self.captions = [c for caps in captions for c in caps]
        self.caption_image = np.repeat(
            np.arange(len(self.image_keys)), [len(c) for c in captions]
        ).astype(np.int64)

        self.stores: dict[str, Store] = {}
        wanted = {
            "global": ("image", paths.global_, "--global", "the global image store"),
            "regions": ("regions", paths.regions, "--regions", "the region store"),
            "grid": ("grid", paths.grid, "--grid", "the grid store"),
            "text": (
                {"words", "tokens", "document", "tfidf"},
                paths.text,
                "--text",
                "the text store",
            ),
        }
        for name, (uses, path, flag, what) in wanted.items():
            uses = {uses} if isinstance(uses, str) else uses
            if uses & inputs:
                self.stores[name] = Store.open(_need(path, flag, what))
        image_stores = {k: s for k, s in self.stores.items() if k != "text"}
        self.image_rows = join_by_key(image_stores, self.image_keys) if image_stores else {}
        if "text" in self.stores:
            join_by_key({"text": self.stores["text"], **image_stores}, [])  # same manifest
            self.caption_rows = join_by_key({"text": self.stores["text"]}, self.caption_keys)[
                "text"
            ]

        info: dict = {}
        if "image" in inputs:
            info["image_dim"] = self.stores["global"].fields["features"].shape[-1]
        if "regions" in inputs:
            info["region_dim"] = self.stores["regions"].fields["features"].shape[-1]
        if "grid" in inputs:
            info["grid_dim"] = self.stores["grid"].fields["features"].shape[-1]
        self.word_index: dict[str, int] = {}
        if inputs & {"words", "scene_graph", "tfidf"}:
            vocab = json.loads(_need(paths.vocab, "--vocab", "the text vocabulary").read_text())
            self.word_index = {w: i for i, w in enumerate(vocab["words"])}
            info["vocab_size"] = len(vocab["words"])
            info["tfidf_dim"] = len(vocab["tfidf_terms"])
        if "tokens" in inputs:
            info["token_dim"] = self.stores["text"].fields["features"].shape[-1]
        if "document" in inputs:
            info["document_dim"] = self.stores["text"].fields["document"].shape[-1]
        if "labels" in inputs:
            names = manifest.class_names
            if not names:
                raise DataError(
                    f"{paths.manifest}: this model needs class labels; the manifest has none"
                )
            info["n_classes"] = len(names)
            if class_embedder is not None:
                emb = np.asarray(class_embedder(names), dtype=np.float64)
                emb /= np.linalg.norm(emb, axis=1, keepdims=True)
                info["class_distances"] = np.round(1.0 - emb @ emb.T, 6).tolist()
        self.graphs: list[dict] | None = None
        if "scene_graph" in inputs:
            from features.scenegraph_files import read_graphs, read_negatives

            folder = _need(paths.scenegraphs, "--scenegraphs", "the scene graphs")
            self.graphs = read_graphs(folder, self.caption_keys)
            negatives = read_negatives(folder)
            info["negatives"] = {
                kind: [phrase_ids(p, self.word_index) for p in phrases]
                for kind, phrases in negatives.items()
            }
        self.info = DataInfo(**info)
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # see standardize

    def standardize(self, stats: dict[str, list[list[float]]]) -> None:
        """From now on, image inputs come as ``(x - mean) / std`` with ``stats`` (from
        :meth:`feature_stats` on the train split; a checkpoint's ``info`` carries them)."""
        self.stats = {
            k: tuple(torch.tensor(x, dtype=torch.float32) for x in v) for k, v in stats.items()
        }
        self.info = replace(self.info, feature_stats=stats)

    def feature_stats(self, max_images: int = 5000) -> dict[str, list[list[float]]]:
        """Per-dimension mean and std of the image inputs over (up to ``max_images``) of
        this split's images; regions count only valid ones. Random-init features are
        dominated by one shared mean vector; standardising them restores contrast.
        Read in blocks, merged with Chan et al.'s pairwise update (float64), so memory
        stays one block."""
        n_images = min(self.n_images, max_images)
        moments: dict[str, tuple[float, np.ndarray, np.ndarray]] = {}  # count, mean, M2
        for start in range(0, n_images, STATS_BLOCK):
            raw = self.build("image", np.arange(start, min(n_images, start + STATS_BLOCK)))
            for key in ("image", "regions", "grid"):
                if key not in raw:
                    continue
                x = raw[key]
                if key == "regions":
                    x = x[np.arange(x.shape[1])[None, :] < raw["region_lengths"][:, None]]
                x = x.reshape(-1, x.shape[-1]).astype(np.float64)  # (n, D)
                n_b, mean_b = len(x), x.mean(0)
                m2_b = np.square(x - mean_b).sum(0)
                if key not in moments:
                    moments[key] = (n_b, mean_b, m2_b)
                    continue
                n_a, mean_a, m2_a = moments[key]
                n, delta = n_a + n_b, mean_b - mean_a
                moments[key] = (
                    n,
                    mean_a + delta * n_b / n,
                    m2_a + m2_b + np.square(delta) * n_a * n_b / n,
                )
        out = {}
        for key, (n, mean, m2) in moments.items():
            std = np.sqrt(m2 / max(n - 1, 1))  # unbiased, as torch.std
            std = np.maximum(std, 1e-3 * std.mean() + 1e-12)
            out[key] = [mean.astype(np.float32).tolist(), std.astype(np.float32).tolist()]
        return out

    def __len__(self) -> int:
        return len(self.caption_keys)

    @property
    def n_images(self) -> int:
        return len(self.image_keys)

    def build(self, kind: str, index, alloc=np.empty) -> dict[str, np.ndarray]:
        """A raw batch (see the module docstring) in memory from ``alloc``: ``kind``
        "image" (split image positions ``index``), "text" (split caption positions) or
        "pair" (captions ``index``, each with its image in the same row: positives on the
        diagonal)."""
        index = np.asarray(index, dtype=np.int64)
        if kind == "image":
            return self._image_arrays(index, alloc)
        if kind == "text":
            return self._text_arrays(index, alloc)
        if kind != "pair":
            raise ValueError(f"unknown batch kind {kind!r}: image, text or pair")
        images = self.caption_image[index]
        return {
            **self._image_arrays(images, alloc),
            **self._text_arrays(index, alloc),
            "caption_image": _put(alloc, images),
        }

    def _image_arrays(self, images: np.ndarray, alloc) -> dict[str, np.ndarray]:
        rows = {role: r[images] for role, r in self.image_rows.items()}
        out = image_arrays(self.inputs, self.stores, rows, alloc)
        if "labels" in self.inputs:
            out["labels"] = _put(alloc, self.labels[images])
        return out

    def _text_arrays(self, captions: np.ndarray, alloc) -> dict[str, np.ndarray]:
        out: dict = {}
        if "text" in self.stores:
            rows = self.caption_rows[captions]
            out = text_arrays(self.inputs, self.stores["text"], rows, self.info.tfidf_dim, alloc)
        if self.graphs is not None:
            graphs = scene_graph_batch([self.graphs[c] for c in captions], self.word_index)
            out.update({k: v.numpy() for k, v in graphs.items()})
        if "labels" in self.inputs:
            out["text_labels"] = _put(alloc, self.labels[self.caption_image[captions]])
        return out

    def image_batch(self, images: np.ndarray) -> dict[str, torch.Tensor]:
        """Image-side tensors for split positions ``images``, ready (standardised if asked)."""
        return finish(_tensors(self.build("image", images)), self.stats)

    def text_batch(self, captions: np.ndarray) -> dict[str, torch.Tensor]:
        """Text-side tensors for split caption positions ``captions``, ready."""
        return finish(_tensors(self.build("text", captions)), self.stats)

    def with_adversarial(self, store: Path, captions: Path) -> PairData:
        """The fake captions of this split's images (``vse extract adversarial``) as a text
        source: ``text_batch`` reads them, ``attacks`` names each one's attack and
        ``caption_image`` gives the image it was made from (it never matches it)."""
        import copy

        import pyarrow.parquet as pq

        from features.store import Store, join_by_key

        table = pq.read_table(_need(captions, "--adversarial-captions", "adversarial captions"))
        position = {k: i for i, k in enumerate(self.image_keys)}
        rows = [r for r in table.to_pylist() if r["image"] in position]
        if not rows:
            raise DataError(
                f"{captions}: no adversarial captions for split {self.split!r}; add it to "
                "adversarial.splits in params.yaml"
            )
        fake = copy.copy(self)
        fake.stores = dict(self.stores)
        fake.caption_keys = [r["key"] for r in rows]
        fake.captions = [r["caption"] for r in rows]
        fake.attacks = np.array([r["attack"] for r in rows])
        fake.caption_image = np.array([position[r["image"]] for r in rows], dtype=np.int64)
        if self.inputs & {"words", "tokens", "document", "tfidf"}:
            text = Store.open(_need(store, "--adversarial", "the adversarial text store"))
            join_by_key({"text": self.stores["text"], "adversarial": text}, [])  # one manifest
            fake.stores["text"] = text
            fake.caption_rows = join_by_key({"text": text}, fake.caption_keys)["text"]
        if self.graphs is not None:
            fake.graphs = rows
        return fake

    def pair_batch(self, captions: np.ndarray) -> dict[str, torch.Tensor]:
        """Caption ``captions[b]`` with its image in row ``b``, ready: positives on the
        diagonal."""
        return finish(_tensors(self.build("pair", captions)), self.stats)


def _tensors(batch: dict) -> dict:
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
