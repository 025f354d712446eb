""":class:`PairData`: training and evaluation batches gathered from the feature stores
(memory-mapped), with the feature statistics for standardisation."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import partialmethod
from pathlib import Path

import numpy as np
import torch

from features.ingest.manifest import caption_key
from models.data.arrays import (
    _KeysAt,
    as_tensors,
    finish,
    floored_std,
    image_arrays,
    phrase_ids,
    put,
    refuse_non_finite_inputs,
    scene_graph_batch,
    text_arrays,
)
from models.data.info import STATS_BLOCK, DataError, DataInfo, FeaturePaths, need_path

TEXT_INPUTS = frozenset({"words", "tokens", "document", "tfidf"})  # read from the text store


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
        class_embedder: Callable[[list[str]], np.ndarray] | None = None,
    ):
        from features.ingest.manifest import read_manifest
        from features.store.reader import Store, join_by_key

        self.inputs = inputs
        manifest = read_manifest(need_path(paths.manifest, "--manifest", "the manifest"))
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
            caption_key(k, i)
            for k, caps in zip(self.image_keys, captions, strict=True)
            for i in range(len(caps))
        ]
        self.captions = [c for caps in captions for c in caps]
        self.caption_image = np.repeat(
            np.arange(len(self.image_keys)), [len(c) for c in captions]
        ).astype(np.int64)

        self.stores: dict[str, Store] = {}
        wanted = {
            "global": ({"image"}, paths.global_, "--global", "the global image store"),
            "regions": ({"regions"}, paths.regions, "--regions", "the region store"),
            "grid": ({"grid"}, paths.grid, "--grid", "the grid store"),
            "text": (TEXT_INPUTS, paths.text, "--text", "the text store"),
        }
        for name, (uses, path, flag, what) in wanted.items():
            if uses & inputs:
                self.stores[name] = Store.open(need_path(path, flag, what))
        if "boxes" in inputs and "boxes" not in self.stores["regions"].fields:
            raise DataError(
                f"{paths.regions}: the region store has no boxes (imported from a precomp "
                "folder?), and this model reads region boxes; import bottom-up-attention "
                "TSVs (vse store import-tsv) or extract the regions (vse extract regions)"
            )
        image_stores = {k: s for k, s in self.stores.items() if k != "text"}
        self.image_rows = join_by_key(image_stores, self.image_keys) if image_stores else {}
        if "text" in self.stores:
            text = {"text": self.stores["text"]}
            join_by_key({**text, **image_stores}, [])  # same manifest
            self.caption_rows = join_by_key(text, self.caption_keys)["text"]

        info: dict = {}
        for use, key, role, name in (
            ("image", "image_dim", "global", "features"),
            ("regions", "region_dim", "regions", "features"),
            ("grid", "grid_dim", "grid", "features"),
            ("tokens", "token_dim", "text", "features"),
            ("document", "document_dim", "text", "document"),
        ):
            if use in inputs:
                info[key] = self.stores[role].fields[name].shape[-1]
        self.word_index: dict[str, int] = {}
        if inputs & {"words", "scene_graph", "tfidf"}:
            vocab = json.loads(need_path(paths.vocab, "--vocab", "the text vocabulary").read_text())
            self.word_index = {w: i for i, w in enumerate(vocab["words"])}
            info["vocab_size"] = len(vocab["words"])
            info["tfidf_dim"] = len(vocab["tfidf_terms"])
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
        self.graphs = None  # an Arrow table: the captions' graphs, in caption order
        if "scene_graph" in inputs:
            from features.scenegraph.files import read_graph_table, read_negatives

            folder = need_path(paths.scenegraphs, "--scenegraphs", "the scene graphs")
            self.graphs = read_graph_table(folder, self.caption_keys)
            negatives = read_negatives(folder)
            info["negatives"] = {
                component: [phrase_ids(p, self.word_index) for p in phrases]
                for component, phrases in negatives.items()
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

    def other_split(self, split: str) -> PairData:
        """The same stores and inputs on ``split``, standardised as this one is."""
        other = PairData(self.paths, split, self.inputs)
        if self.stats:
            other.standardize(self.info.feature_stats)
        return other

    def feature_stats(self, max_images: int = 5000) -> dict[str, list[list[float]]]:
        """Per-dimension mean and std of the image inputs over up to ``max_images`` of this
        split's images (valid regions only), read in blocks merged with Chan et al.'s
        pairwise update (float64), so memory stays one block."""
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
        if kind not in ("image", "text", "pair"):
            raise ValueError(f"unknown batch kind {kind!r}: image, text or pair")
        index = np.asarray(index, dtype=np.int64)
        images = self.caption_image[index] if kind == "pair" else index
        out: dict[str, np.ndarray] = {}
        if kind != "text":
            rows = {role: r[images] for role, r in self.image_rows.items()}
            out = image_arrays(self.inputs, self.stores, rows, alloc)
            if "labels" in self.inputs:
                out["labels"] = put(alloc, self.labels[images])
        if kind != "image":
            if "text" in self.stores:
                rows, dim = self.caption_rows[index], self.info.tfidf_dim
                out.update(text_arrays(self.inputs, self.stores["text"], rows, dim, alloc))
            if self.graphs is not None:
                graphs = scene_graph_batch(self.graphs.take(index).to_pylist(), self.word_index)
                out.update({k: v.numpy() for k, v in graphs.items()})
            if "labels" in self.inputs:
                out["text_labels"] = put(alloc, self.labels[self.caption_image[index]])
        if kind == "pair":
            out["caption_image"] = put(alloc, images)
        refuse_non_finite_inputs(
            out,
            {role: store.url for role, store in self.stores.items()},
            _KeysAt(self.image_keys, images),  # (looked up only for an image-side input)
            _KeysAt(self.caption_keys, index),  # (only for a text-side input)
        )
        return out

    def batch(self, kind: str, index: np.ndarray) -> dict[str, torch.Tensor]:
        """The :meth:`build` of ``kind`` at ``index`` as the models read it (standardised if
        asked); also ``image_batch(images)``, ``text_batch(captions)``, ``pair_batch(captions)``."""
        return finish(as_tensors(self.build(kind, index)), self.stats)

    image_batch = partialmethod(batch, "image")
    text_batch = partialmethod(batch, "text")
    pair_batch = partialmethod(batch, "pair")

    def with_adversarial(self, store: Path | str | None, captions: Path) -> PairData:
        """The fake captions of this split's images (``vse extract adversarial``) as a text
        source: ``text_batch`` reads them, ``attacks`` names each one's attack and
        ``caption_image`` gives the image it was made from (it never matches it)."""
        import copy

        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from features.store.reader import Store, join_by_key

        graph = ["objects", "attributes", "relations"] if self.graphs is not None else []
        table = pq.read_table(  # this split's rows and the columns used, selected in Arrow
            need_path(captions, "--adversarial-captions", "adversarial captions"),
            columns=["key", "image", "attack", "caption", *graph],
        )
        image = pc.index_in(table["image"], value_set=pa.array(self.image_keys))
        ours = image.is_valid()  # made from an image of this split
        table, image = table.filter(ours), image.filter(ours)
        if not table.num_rows:
            raise DataError(
                f"{captions}: no adversarial captions for split {self.split!r}; add it to "
                "adversarial.splits in params.yaml"
            )
        fake = copy.copy(self)
        fake.stores = dict(self.stores)
        fake.caption_keys = table["key"].to_pylist()
        fake.captions = table["caption"].to_pylist()
        fake.attacks = np.array(table["attack"].to_pylist())
        fake.caption_image = image.to_numpy().astype(np.int64)
        if self.inputs & TEXT_INPUTS:
            text = Store.open(need_path(store, "--adversarial", "the adversarial text store"))
            join_by_key({"text": self.stores["text"], "adversarial": text}, [])  # one manifest
            fake.stores["text"] = text
            fake.caption_rows = join_by_key({"text": text}, fake.caption_keys)["text"]
        if self.graphs is not None:
            fake.graphs = table.select(["key", *graph])
        return fake
