"""Stage ``graph_rise`` (``vse train graph-rise``): labels, graph, head, embedding store.

1. Labels of every image from its captions' scene graphs (:mod:`.labels`); the vocabulary
   (train images, ``min_images`` floor) is written as JSON.
2. The kNN graph over the train images (:mod:`.graph`) from the captions' sentence
   embeddings: the text store's ``document`` field ends with the mean over tokens of the
   text model's last layer, which is Sentence-BERT's own (mean) pooling when ``text.model``
   is a Sentence-BERT model (the demo's all-MiniLM-L6-v2), so nothing is encoded again;
   ``caption_embedding: sbert`` encodes the captions with the ``sbert`` model instead.
   Written as parquet ``src, dst, weight`` (image keys).
3. The head (:mod:`.model`) on the regions store's regions (``input: regions``: each
   region's feature, its box over the image size and its area) or on the global store's
   pooled ``features`` (``input: global``, a set of one), its labels weighted by
   ``label_weighting``, with ``alpha`` and, for the metrics, with ``alpha = 0`` or, when
   ``alpha`` is 0, with ``compare_alpha`` (the graph's contribution, measured either way).
4. A ``global``-kind store: ``features`` (dim,) the L2-normalised embedding (zeros where
   the global store's image is invalid) and ``valid``; its fingerprint names the label
   vocabulary, the graph and the checkpoint. ``output: pca`` writes the global store's
   PCA-64 ``projected`` field there instead (HUSE's ablation, one param away).

Metrics: kNN label precision@k among the val images and among the test images
(:func:`.graph.label_precision`) for the trained embedding, the graph on/off comparison,
PCA-64, the pooled feature itself and random neighbours. Settings are chosen by val; test
is the figure reported.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt

from features.images.graph_rise import graph as G
from features.images.graph_rise.labels import (
    KINDS,
    ImageLabels,
    WeightedLabels,
    idf_weights,
    label_vocabulary,
    multi_hot,
)
from features.images.graph_rise.model import ItemSets
from features.ingest.manifest import Manifest
from features.scenegraph.files import read_graph_table
from features.store.reader import Store
from features.store.spec import FieldSpec, Provenance, StoreConfig
from features.store.writer import StoreWriter
from infra.config import Section, UserError
from infra.device import Device
from infra.files import save_torch, sha256_file, write_json

VERSION = "1"
HEAD = "head.pt"
BLOCK = 8192  # captions read at a time: 8,192 x 4H floats of `document` is 100 MB at H = 768


class GraphRiseConfig(Section):
    """``graph_rise`` section of params.yaml."""

    min_images: PositiveInt = 5  # label frequency floor: train images carrying the label
    neighbours: PositiveInt = 10  # k of the kNN graph
    caption_embedding: Literal["text", "sbert"] = "text"  # see the module docstring
    dim: PositiveInt = 64  # embedding size (HUSE and Graph-RISE: 64)
    input: Literal["regions", "global"] = "regions"  # the head's input: see the docstring
    hidden: PositiveInt = 256
    alpha: NonNegativeFloat = 0.0  # graph regulariser weight (eq. 1)
    # L_s's labels: none (equal shares) | idf (each label by its smooth IDF over the train
    # images, labels.idf_weights)
    label_weighting: Literal["none", "idf"] = "idf"
    # the other side of the graph on/off comparison in the metrics: the head is trained
    # again with alpha 0 when alpha > 0, else with this alpha
    compare_alpha: PositiveFloat = 0.01
    packed: int = Field(2, ge=0)  # neighbours packed into the batch per seed image
    epochs: PositiveInt = 40
    batch_size: PositiveInt = 64  # seed images per batch
    lr: PositiveFloat = 0.003
    weight_decay: NonNegativeFloat = 0.0001
    # before each layer of the item MLP (not in the paper; 0: none)
    dropout: float = Field(0.0, ge=0, lt=1)
    seed: int = Field(0, ge=0)
    device: Device = "auto"
    precision_k: PositiveInt = 10  # kNN label precision@k on val and test
    output: Literal["trained", "pca"] = "trained"  # what HUSE reads: see the docstring


class GraphRiseError(UserError):
    """An input the stage cannot use, named with what to do."""


def caption_vectors(text: Store, keys: list[str], dim: int) -> np.ndarray:
    """(C, dim) L2-normalised last ``dim`` values of the text store's ``document`` for
    the caption ``keys`` (the mean-pooled last layer; see the module docstring)."""
    if "document" not in text.fields:
        raise GraphRiseError(f"{text.url}: no `document` field; rebuild it with `vse extract text`")
    rows = np.array([text.index(k) for k in keys], dtype=np.int64)
    out = np.concatenate(  # in blocks: the whole 4H-wide field may not fit in memory
        [
            text.gather("document", rows[i : i + BLOCK])[:, -dim:].astype(np.float32)
            for i in range(0, len(rows), BLOCK)
        ]
    )  # (C, dim)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def region_sets(store: Store) -> tuple[ItemSets, np.ndarray]:
    """The regions store as item sets, read on demand (:class:`.model.ItemSets`): each
    region's feature, its box ``x1, y1, x2, y2`` over the image's width and height, and its
    area (of the image), ``(B, R, D + 5)``, with the ``(B, R)`` mask of its detected regions;
    and ``(N,)`` valid (a valid image with at least one region)."""
    meta = store.read(0, len(store), ["n_regions", "valid"])
    n_regions = meta["n_regions"]

    def load(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hw = store.gather("image_hw", rows).astype(np.float32)  # (B, 2): height, width
        h, w = hw[:, 0:1], hw[:, 1:2]
        size = np.maximum(np.concatenate([w, h, w, h], 1), 1)[:, None, :]  # (B, 1, 4)
        box = store.gather("boxes", rows).astype(np.float32) / size  # (B, R, 4)
        area = ((box[..., 2] - box[..., 0]) * (box[..., 3] - box[..., 1]))[..., None]
        mask = np.arange(box.shape[1])[None] < n_regions[rows][:, None]  # (B, R)
        feats = store.gather("features", rows).astype(np.float32)  # (B, R, D)
        items = np.concatenate([feats, box, area], -1)  # (B, R, D + 5)
        items[~mask] = 0
        return items, mask

    dim = store.fields["features"].shape[-1] + 5
    return ItemSets(load, dim), meta["valid"].astype(bool) & (n_regions > 0)


def _ratio(precision: dict | None) -> float | None:
    """Trained over PCA-64 precision, when both were measured."""
    return precision["trained"] / precision["pca"] if precision and "pca" in precision else None


def train_graph_rise(
    manifest: Manifest,
    global_path: Path,
    regions_path: Path | None,
    text_path: Path,
    scenegraphs: Path,
    cfg: GraphRiseConfig,
    out: Path,
    model_dir: Path,
    labels_path: Path,
    graph_path: Path,
    store_cfg: StoreConfig,
    sbert_embed: Callable | None = None,
    resume: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """The stage (see the module docstring); returns its metrics."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch

    from features.images.graph_rise.model import Graph, embed, train_head
    from infra.device import resolve_device

    table = manifest.table
    keys = table["key"].to_pylist()
    split = np.asarray(table["split"].to_pylist())
    counts = pc.list_value_length(table["captions"]).to_numpy().astype(np.int64)  # (N,)
    caption_keys, captions, _ = manifest.caption_rows()
    images = ImageLabels.of_graphs(read_graph_table(scenegraphs, caption_keys), counts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    train = np.flatnonzero(split == "train")
    test = np.flatnonzero(split == "test")
    if len(train) < 2 or len(test) < 2:
        raise GraphRiseError(
            f"manifest: {len(train)} train and {len(test)} test images; "
            "graph_rise needs at least 2 of each"
        )
    vocabulary = label_vocabulary(images[train], cfg.min_images)
    if not vocabulary:
        raise GraphRiseError(
            f"graph_rise.min_images {cfg.min_images}: no scene-graph label reaches it on "
            f"{len(train)} train images; lower it"
        )
    write_json(labels_path, vocabulary, indent=1)
    targets = multi_hot(images, vocabulary)  # (N, L)

    # the graph over the train images
    train_captions = [k for i in train for k in caption_keys[starts[i] : starts[i + 1]]]
    if cfg.caption_embedding == "sbert":
        if sbert_embed is None:
            raise GraphRiseError("graph_rise.caption_embedding is sbert: no encoder was given")
        by_key = dict(zip(caption_keys, captions, strict=True))
        cap = np.asarray(sbert_embed([by_key[k] for k in train_captions]), np.float32)
    else:
        text = Store.open(text_path, manifest_digest=manifest.digest)
        hidden = text.fields["document"].shape[-1] // 4
        cap = caption_vectors(text, train_captions, hidden)
    vectors = G.image_vectors(cap, counts[train])  # (Ntr, Dt)
    src, dst, weight = G.knn_graph(vectors, cfg.neighbours)
    stats = G.graph_statistics(src, dst, weight, targets[train], len(train))
    train_keys = np.asarray(keys)[train]
    edges = pa.table(
        {"src": train_keys[src].tolist(), "dst": train_keys[dst].tolist(), "weight": weight}
    )
    graph_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(edges, graph_path)

    # the head
    source = Store.open(global_path, manifest_digest=manifest.digest)
    names = ["features", "valid", *(["projected"] if "projected" in source.fields else [])]
    data = source.read(0, len(source), names)
    pooled, pooled_valid = data["features"].astype(np.float32), data["valid"].astype(bool)
    if cfg.input == "regions":
        if regions_path is None:
            raise GraphRiseError("graph_rise.input is regions: pass --regions (a regions store)")
        inputs = Store.open(regions_path, manifest_digest=manifest.digest)
        items, valid = region_sets(inputs)
        valid &= pooled_valid  # one test set for every vector compared below
    else:
        inputs, valid = source, pooled_valid
        items = ItemSets.of_arrays(pooled[:, None, :], np.ones((len(pooled), 1), bool))
    fit = train[valid[train]]  # valid train images; graph rows re-indexed onto them
    remap = np.full(len(train), -1)
    remap[valid[train]] = np.arange(len(fit))
    keep = (remap[src] >= 0) & (remap[dst] >= 0)
    g = Graph(remap[src[keep]], remap[dst[keep]], weight[keep], len(fit))
    identity = {
        "config": cfg.model_dump(
            mode="json", exclude={"device", "precision_k", "output", "compare_alpha"}
        ),
        "labels": hashlib.sha256(json.dumps(vocabulary, sort_keys=True).encode()).hexdigest(),
        "graph": hashlib.sha256(weight.tobytes() + src.tobytes() + dst.tobytes()).hexdigest(),
        "features": inputs.fingerprint,
        "global": source.fingerprint,
    }
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        # a head this small gains nothing from intra-op threads, which slow it on shared cores
        torch.set_num_threads(1)
    fit_targets = targets[fit]  # (Nfit, L)
    if cfg.label_weighting == "idf":
        fit_targets = WeightedLabels(fit_targets, idf_weights(fit_targets))
    data_args = (items, fit, fit_targets, g, cfg)  # the same data for both heads
    model, history = train_head(*data_args, cfg.alpha, identity, model_dir, resume, device, log)
    save_torch({**identity, "state_dict": model.state_dict(), "history": history}, model_dir / HEAD)
    embedding = np.zeros((len(keys), cfg.dim), np.float32)  # zeros where invalid
    embedding[valid] = embed(model, items, np.flatnonzero(valid))

    other = 0.0 if cfg.alpha > 0 else cfg.compare_alpha
    compared, _ = train_head(*data_args, other, identity, None, False, device, log)
    k = cfg.precision_k

    def precision(rows: np.ndarray) -> dict[str, float]:
        """kNN label precision@k among ``rows`` of each embedding compared."""
        out = {"trained": G.label_precision(embedding[rows], targets[rows], k)}
        out[f"alpha_{other:g}"] = G.label_precision(embed(compared, items, rows), targets[rows], k)
        if "projected" in data:
            out["pca"] = G.label_precision(data["projected"][rows], targets[rows], k)
        out["pooled"] = G.label_precision(pooled[rows], targets[rows], k)
        rng = np.random.default_rng(0)
        out["random"] = G.label_precision(
            rng.standard_normal((len(rows), cfg.dim)).astype(np.float32), targets[rows], k
        )
        return out

    # val: where graph_rise's settings are chosen; test: the figure reported
    val = np.flatnonzero(split == "val")
    per_split = {"val": val[valid[val]], "test": test[valid[test]]}
    precisions = {name: precision(rows) for name, rows in per_split.items() if len(rows) >= 2}

    if cfg.output == "pca":
        if "projected" not in data:
            raise GraphRiseError(
                f"{global_path}: no `projected` field for graph_rise.output pca; "
                "set global.projection_dim"
            )
        written, valid, upstream = data["projected"], pooled_valid, source
    else:
        written, upstream = embedding, inputs
    provenance = Provenance(
        f"graph-rise-{cfg.output}",
        VERSION,
        {
            "config": cfg.model_dump(
                mode="json", exclude={"device", "precision_k", "compare_alpha"}
            ),
            "labels": identity["labels"],
            "graph": identity["graph"],
            "checkpoint": sha256_file(model_dir / HEAD),
        },
        upstream.fingerprint,
        manifest.digest,
    )
    fields = {
        "features": FieldSpec((written.shape[1],), "float32"),
        "valid": FieldSpec((), "uint8"),
    }
    with StoreWriter(out, "global", fields, keys, provenance, store_cfg, log=log) as w:
        for shard in w.pending_shards():
            lo, hi = w.shard_range(shard)
            w.write_shard(
                shard, {"features": written[lo:hi], "valid": valid[lo:hi].astype(np.uint8)}
            )
    return {
        "labels": {
            "vocabulary": len(vocabulary),
            **{kind: sum(v["kind"] == kind for v in vocabulary) for kind in KINDS},
            "per_train_image": float(targets[train].sum(1).mean()),
        },
        "graph": stats,
        **{f"{name}_label_precision_at_{k}": p for name, p in precisions.items()},
        "trained_over_pca": _ratio(precisions.get("test")),
        "val_trained_over_pca": _ratio(precisions.get("val")),
        "history": history[-1] if history else None,
        "output": cfg.output,
    }
