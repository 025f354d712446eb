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
:class:`ShardData` (WebDataset shards built from the same stores).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from features.config import UserError
from models.common import lengths_mask

STATS_BLOCK = 128  # images read at a time for the feature statistics
IMAGE_INPUTS = frozenset({"image", "regions", "boxes", "grid", "labels"})
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


# batch key -> (store role, field) of the float inputs checked for NaN and infinities
FLOAT_INPUTS = {
    "image": ("global", "features"),
    "regions": ("regions", "features"),
    "grid": ("grid", "features"),
    "tokens": ("text", "features"),
    "document": ("text", "document"),
    "tfidf": ("text", "tfidf_values"),
}


class _KeysAt:
    """``keys[positions[i]]``, looked up only when an error names one."""

    def __init__(self, keys, positions):
        self.keys, self.positions = keys, positions

    def __getitem__(self, i: int) -> str:
        return self.keys[int(self.positions[i])]


def refuse_non_finite(batch: dict, urls: dict, image_keys, caption_keys) -> None:
    """One line naming the store, field and key of the first sample of ``batch`` (a raw
    batch, rows aligned with ``image_keys`` / ``caption_keys``) whose float input holds NaN
    or infinite values: a model never trains or is evaluated on them. One vectorised pass
    per array, where the batch is built (off the training step)."""
    from features.finite import check_finite

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
    """Per-dimension ``std`` floored at ``ratio`` of the typical (root-mean-square) one, so
    that standardising scales no dimension up more than ``1 / ratio`` times the others.

    A dimension that barely varies on train (a ReLU unit of the detector's box head that
    never fires there) must not dominate when it fires on a test image: with the earlier
    floor of 1e-3 of the mean std, one such region value became ~500 standard units, and
    that one test image was the nearest of every caption (the demo's MV-VSE and CAMERA
    text-to-image R@1 sat at 1.0%, its five captions)."""
    return np.maximum(std, ratio * np.sqrt(np.mean(np.square(std))) + 1e-12)


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
        self.manifest_digest = manifest.digest
        self.paths = paths
        table = manifest.split(split)
        if table.num_rows == 0:
            raise DataError(f"{paths.manifest}: split {split!r} has no images")
        self.split = split
        self.image_keys = table["key"].to_pylist()
        labels = table["label"].fill_null(-1)  # -1: no class (datasets without labels)
        self.labels = np.asarray(labels.to_numpy(zero_copy_only=False), dtype=np.int64)
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
        if "boxes" in inputs and "boxes" not in self.stores["regions"].fields:
            raise DataError(
                f"{paths.regions}: the region store has no boxes (imported from a precomp "
                "folder?), and this model reads region boxes; import bottom-up-attention "
                "TSVs (vse store import-tsv) or extract the regions (vse extract regions)"
            )
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
            std = floored_std(np.sqrt(m2 / max(n - 1, 1)))  # unbiased, as torch.std
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
            images, captions = index, None
            out = self._image_arrays(index, alloc)
        elif kind == "text":
            images, captions = None, index
            out = self._text_arrays(index, alloc)
        elif kind == "pair":
            images, captions = self.caption_image[index], index
            out = {
                **self._image_arrays(images, alloc),
                **self._text_arrays(index, alloc),
                "caption_image": _put(alloc, images),
            }
        else:
            raise ValueError(f"unknown batch kind {kind!r}: image, text or pair")
        refuse_non_finite(
            out,
            {role: store.url for role, store in self.stores.items()},
            _KeysAt(self.image_keys, images),
            _KeysAt(self.caption_keys, captions),
        )
        return out

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


class ShardData:
    """The training pairs of ``data`` (a :class:`PairData` of the train split: sizes,
    vocabulary, feature statistics) streamed from WebDataset shards (``url``: a folder or
    an fsspec URL such as ``s3://bucket/shards``) that ``vse shards build`` made from the
    same stores; they are checked against them (manifest digest, store fingerprints, scene
    graphs). Same batch contract as :class:`PairData` (:meth:`stream` yields raw "pair"
    batches, built by the same code from the shards' groups).

    Epoch ``e``: the train shards in an order seeded by ``(seed, e)`` are dealt to the
    ``world x workers`` streams; each stream shuffles captions in a buffer of
    ``shuffle_buffer`` captions (whole groups, seeded by ``(seed, e, rank, worker)``) and
    yields full batches; every rank takes the same number of steps (the smallest over
    ranks and epochs), so collectives never wait on a rank that ran out. A batch's rows
    are in storage order (its captions are a random set; the order within it is not).
    """

    def __init__(self, url: str, data: PairData, cfg, storage_options: dict | None = None):
        from features.scenegraph_files import GRAPHS
        from features.shards import check_sources, file_digest, read_sizes, shard_names

        self.url, self.storage_options, self.data = str(url), storage_options, data
        sizes = read_sizes(self.url, storage_options)
        graphs = None
        if data.graphs is not None:
            graphs = file_digest(Path(data.paths.scenegraphs) / GRAPHS)
        names = check_sources(self.url, sizes, data.manifest_digest, data.stores, graphs)
        self.names = names  # role ("regions", "text", ...) -> packed store name
        self.fields = {role: sizes["stores"][name]["fields"] for role, name in names.items()}
        self.shards = shard_names(sizes, "train")
        if not self.shards:
            raise DataError(f"{self.url}: no train shards; rebuild with `vse shards build`")
        self.captions = np.array([sizes["shards"][n]["captions"] for n in self.shards])
        self.batch_size, self.seed, self.epochs = cfg.batch_size, cfg.seed, cfg.epochs
        self.buffer = max(cfg.shuffle_buffer, cfg.batch_size)
        self.workers = max(1, cfg.num_workers)

    # the sizes, vocabulary and statistics are the stores'
    @property
    def info(self) -> DataInfo:
        return self.data.info

    @property
    def stats(self) -> dict:
        return self.data.stats

    @property
    def inputs(self) -> frozenset[str]:
        return self.data.inputs

    @property
    def word_index(self) -> dict[str, int]:
        return self.data.word_index

    def feature_stats(self, max_images: int = 5000) -> dict:
        return self.data.feature_stats(max_images)

    def standardize(self, stats: dict) -> None:
        self.data.standardize(stats)

    def __len__(self) -> int:
        return int(self.captions.sum())

    def __getstate__(self) -> dict:  # workers need the shards, not the stores' readers
        state = dict(self.__dict__)
        state["data"] = copy.copy(self.data)
        state["data"].stores, state["data"].graphs = {}, None
        state["data"].captions = state["data"].caption_keys = []
        return state

    # -- epochs

    def _mine(self, epoch: int, rank: int, world: int, worker: int) -> np.ndarray:
        """This stream's shards (positions in ``self.shards``) for ``epoch``."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        return order[rank * self.workers + worker :: world * self.workers]

    def steps(self, world: int) -> int:
        """Steps per epoch on every rank: full batches the shards give the rank that gets
        the fewest, in the epoch where that is smallest."""
        fewest = min(
            sum(
                int(self.captions[self._mine(e, r, world, w)].sum()) // self.batch_size
                for w in range(self.workers)
            )
            for e in range(self.epochs)
            for r in range(world)
        )
        if fewest == 0:
            raise DataError(
                f"{self.url}: {len(self.shards)} train shards of {len(self)} captions fill no "
                f"batch of {self.batch_size} on some of {world} ranks x {self.workers} workers; "
                "rebuild with a smaller shards.samples_per_shard or lower train.num_workers"
            )
        return fewest

    def epoch_stream(self, epoch: int, rank: int, world: int):
        from models.batches import Stream

        return Stream((epoch, rank, world), self.steps(world))

    def stream(self, spec: tuple, worker: int, n_workers: int, alloc) -> Iterator[dict]:
        """Raw pair batches of one stream (see the class docstring)."""
        from features.shards import read_groups

        epoch, rank, world = spec
        rng = np.random.default_rng([self.seed, epoch, rank, worker])
        held: list = []
        refs = np.empty((0, 2), np.int64)  # (group in held, caption in group)
        for position in self._mine(epoch, rank, world, worker):
            url = f"{self.url.rstrip('/')}/{self.shards[position]}"
            for group in read_groups(url, self.storage_options):
                n = int(group.caption_image.shape[0])
                pairs = np.stack([np.full(n, len(held)), np.arange(n)], 1)
                held.append(group)
                refs = np.concatenate([refs, pairs])
                if len(refs) >= self.buffer:
                    # at this point the buffer holds >= shuffle_buffer captions
                    refs = refs[rng.permutation(len(refs))]
                    yield from self._emit(held, refs, alloc)
                    held, refs = self._carry(
                        held, refs[len(refs) // self.batch_size * self.batch_size :]
                    )
        refs = refs[rng.permutation(len(refs))]  # the stream's last captions
        yield from self._emit(held, refs, alloc)

    def _emit(self, held: list, refs: np.ndarray, alloc) -> Iterator[dict]:
        """The full batches of ``refs`` (in order) from the ``held`` groups."""
        from features.shards import GroupColumns

        images = {
            role: GroupColumns(held, self.names[role], self.fields[role], "images")
            for role in self.names
            if role != "text"
        }
        text = None
        if "text" in self.names:
            text = GroupColumns(held, "text", self.fields["text"], "captions")
        image_base = np.concatenate([[0], np.cumsum([g.n_images for g in held])[:-1]])
        caption_image = [g.caption_image for g in held]
        caption_base = np.concatenate([[0], np.cumsum([len(c) for c in caption_image])[:-1]])
        flat_image = np.concatenate(caption_image) if held else np.empty(0, np.int64)
        for start in range(0, len(refs) // self.batch_size * self.batch_size, self.batch_size):
            chosen = refs[start : start + self.batch_size]
            # a random set of captions; in storage order, each group's rows are copied
            # into the batch in one slice
            chosen = chosen[np.lexsort((chosen[:, 1], chosen[:, 0]))]
            captions = caption_base[chosen[:, 0]] + chosen[:, 1]  # rows among held captions
            rows = image_base[chosen[:, 0]] + flat_image[captions]  # rows among held images
            yield self._batch(held, images, text, rows, captions, alloc)

    def _batch(self, held, images, text, rows, captions, alloc) -> dict[str, np.ndarray]:
        out = image_arrays(self.inputs, images, {role: rows for role in images}, alloc)
        if text is not None:
            out.update(text_arrays(self.inputs, text, captions, self.info.tfidf_dim, alloc))
        index = np.concatenate([g.meta["index"] for g in held])[rows]
        if "labels" in self.inputs:
            labels = np.concatenate([np.asarray(g.meta["labels"], np.int64) for g in held])
            out["labels"] = out["text_labels"] = _put(alloc, labels[rows])
        if "scene_graph" in self.inputs:
            graphs = [graph for g in held for graph in g.meta["scene_graphs"]]
            batch = scene_graph_batch([graphs[c] for c in captions], self.word_index)
            out.update({k: v.numpy() for k, v in batch.items()})
        out["caption_image"] = _put(alloc, index)
        keys = _KeysAt(self.data.image_keys, index)  # a caption is named by its image
        refuse_non_finite(out, {role: self.url for role, _ in FLOAT_INPUTS.values()}, keys, keys)
        return out

    @staticmethod
    def _carry(held: list, refs: np.ndarray) -> tuple[list, np.ndarray]:
        """The groups still referenced by the captions left over (fewer than a batch)."""
        kept = np.unique(refs[:, 0])
        remap = np.full(len(held), -1, np.int64)
        remap[kept] = np.arange(len(kept))
        return [held[k] for k in kept], np.stack([remap[refs[:, 0]], refs[:, 1]], 1)
