"""Small feature stores for data-path tests, made in code: a manifest (train/val/test,
1..4 captions per image, class labels), a regions, grid and global store and a
caption-level text store (every field a model reads, ragged ones with empty rows), in
shards of 8 samples with chunks of 4 so that reads cross shard files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from features.ingest.manifest import Dataset, Record, read_manifest, write_manifest
from features.store.spec import FieldSpec, Provenance, StoreConfig
from features.store.writer import StoreWriter
from models.data.info import FeaturePaths

R, REGION_DIM, GRID, GRID_DIM, IMAGE_DIM = 5, 8, 2, 4, 7
TOKEN_DIM, DOC_DIM, VOCAB, TERMS = 6, 5, 30, 9
LAYOUT = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
WORDS = ["<pad>", "<start>", "<end>", "<unk>", *[f"w{i}" for i in range(VOCAB - 4)]]


def _write(path: Path, kind: str, fields: dict, keys: list[str], digest: str, make) -> None:
    provenance = Provenance(f"test-{kind}", "1", {}, None, digest)
    with StoreWriter(path, kind, fields, keys, provenance, LAYOUT, log=lambda m: None) as w:
        for shard in w.pending_shards():
            w.write_shard(shard, make(*w.shard_range(shard)))


def make_stores(root: Path, n_train: int = 30, n_val: int = 6, n_test: int = 5) -> FeaturePaths:
    rng = np.random.default_rng(0)
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * n_test
    records = [
        Record(
            f"img{i:03d}",
            f"img{i:03d}.jpg",
            split,
            [f"caption {i} {j}" for j in range(1 + i % 4)],
            label=i % 3,
        )
        for i, split in enumerate(splits)
    ]
    dataset = Dataset("test", records, ["circle", "square", "star"])
    write_manifest(records, dataset, 4, root / "manifest.parquet")
    manifest = read_manifest(root / "manifest.parquet")
    keys = manifest.table["key"].to_pylist()
    n = len(keys)
    features = rng.standard_normal((n, R, REGION_DIM)).astype(np.float16) + 3.0
    n_regions = rng.integers(1, R + 1, n)
    corners = np.sort(rng.uniform(0, 100, (n, R, 2, 2)), axis=2)  # (x1, y1), (x2, y2)
    boxes = corners.reshape(n, R, 4)  # x1, y1, x2, y2
    hw = rng.integers(50, 120, (n, 2))
    _write(
        root / "regions.zarr",
        "regions",
        {
            "features": FieldSpec((R, REGION_DIM), "float16"),
            "boxes": FieldSpec((R, 4), "float32"),
            "n_regions": FieldSpec((), "int32"),
            "image_hw": FieldSpec((2,), "int32"),
        },
        keys,
        manifest.digest,
        lambda a, b: {
            "features": features[a:b],
            "boxes": boxes[a:b],
            "n_regions": n_regions[a:b],
            "image_hw": hw[a:b],
        },
    )
    grid = rng.standard_normal((n, GRID, GRID, GRID_DIM)).astype(np.float16)
    _write(
        root / "grid.zarr",
        "grid",
        {"features": FieldSpec((GRID, GRID, GRID_DIM), "float16")},
        keys,
        manifest.digest,
        lambda a, b: {"features": grid[a:b]},
    )
    image = rng.standard_normal((n, IMAGE_DIM)).astype(np.float32)
    _write(
        root / "global.zarr",
        "global",
        {"features": FieldSpec((IMAGE_DIM,), "float32")},
        keys,
        manifest.digest,
        lambda a, b: {"features": image[a:b]},
    )
    caption_keys, _, _ = manifest.caption_rows()
    m = len(caption_keys)
    lengths = rng.integers(0, 7, m)  # some captions without tokens
    words = [rng.integers(1, VOCAB, k + 2).astype(np.int32) for k in lengths]
    tokens = [rng.standard_normal((k, TOKEN_DIM)).astype(np.float16) for k in lengths]
    terms = [
        np.sort(rng.choice(TERMS, min(k, TERMS), replace=False)).astype(np.int32) for k in lengths
    ]
    _write(
        root / "text.zarr",
        "text",
        {
            "features": FieldSpec((TOKEN_DIM,), "float16", ragged=True),
            "wordpiece_ids": FieldSpec((), "int32", ragged=True),
            "document": FieldSpec((DOC_DIM,), "float16"),
            "word_ids": FieldSpec((), "int32", ragged=True),
            "tfidf_indices": FieldSpec((), "int32", ragged=True),
            "tfidf_values": FieldSpec((), "float32", ragged=True),
        },
        caption_keys,
        manifest.digest,
        lambda a, b: {
            "features": tokens[a:b],
            "wordpiece_ids": [w + 100 for w in words[a:b]],
            "document": rng.standard_normal((b - a, DOC_DIM)).astype(np.float16),
            "word_ids": words[a:b],
            "tfidf_indices": terms[a:b],
            "tfidf_values": [np.linspace(0.1, 1, len(t)).astype(np.float32) for t in terms[a:b]],
        },
    )
    (root / "vocab.json").write_text(
        json.dumps({"words": WORDS, "tfidf_terms": [f"t{i}" for i in range(TERMS)]})
    )
    return FeaturePaths(
        manifest=root / "manifest.parquet",
        global_=root / "global.zarr",
        regions=root / "regions.zarr",
        grid=root / "grid.zarr",
        text=root / "text.zarr",
        vocab=root / "vocab.json",
    )
