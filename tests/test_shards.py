"""WebDataset shards: packing from manifest + stores, sizes.json, streaming loader."""

import hashlib

import numpy as np
import pytest
from torch.utils.data import DataLoader

from features.demo import DemoConfig, build_dataset
from features.ingest import READERS, PrepareConfig, read_manifest, validate, write_manifest
from features.shards import build_shards, read_sizes, stream
from features.store import (
    FieldSpec,
    Provenance,
    Store,
    StoreConfig,
    StoreError,
    StoreWriter,
    ragged_fields,
)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A 40/6/6 demo manifest, a global store and a ragged store, packed in shards of 7."""
    root = tmp_path_factory.mktemp("shards")
    build_dataset(DemoConfig(n_train=40, n_val=6, n_test=6), root / "demo")
    cfg = PrepareConfig()
    dataset = READERS["demo"](root / "demo/dataset.json", root / "demo/images", cfg)
    records, _ = validate(dataset, root / "demo/images", 5)
    write_manifest(records, dataset, 5, root / "manifest.parquet")
    manifest = read_manifest(root / "manifest.parquet")
    keys = manifest.table["key"].to_pylist()
    provenance = Provenance("test", "1", {}, None, manifest.digest)
    layout = StoreConfig(samples_per_shard=16, samples_per_chunk=8)
    with StoreWriter(
        root / "g.zarr",
        "global",
        {"features": FieldSpec((4,), "float32")},
        keys,
        provenance,
        layout,
    ) as w:
        for shard in w.pending_shards():
            start, stop = w.shard_range(shard)
            w.write_shard(shard, {"features": np.arange(start, stop)[:, None] * np.ones(4)})
    with StoreWriter(root / "t.zarr", "tokens", ragged_fields(3), keys, provenance, layout) as w:
        for shard in w.pending_shards():
            start, stop = w.shard_range(shard)
            w.write_shard(
                shard, {"features": [np.full((i % 3 + 1, 3), i) for i in range(start, stop)]}
            )
    stores = {"global": Store.open(root / "g.zarr"), "tokens": Store.open(root / "t.zarr")}
    sizes = build_shards(manifest, stores, root / "out", samples_per_shard=7)
    return root, manifest, sizes


def test_sizes_and_sample_contents(packed):
    root, manifest, sizes = packed
    assert sizes == read_sizes(root / "out")
    assert sum(v for k, v in sizes.items() if k.startswith("train-")) == 40
    assert sizes["train-000005.tar"] == 5 and sizes["val-000000.tar"] == 6
    batches = list(stream(root / "out", "val", 4, shuffle_buffer=1))
    batch = batches[0]
    rows = {r["key"]: r for r in manifest.table.to_pylist()}
    key = batch["key"][0]
    index = list(rows).index(key)
    assert batch["captions"][0] == rows[key]["captions"]
    assert int(batch["label"][0]) == rows[key]["label"]
    assert batch["global.features"][0].tolist() == [float(index)] * 4
    n_boxes = int(batch["gt_boxes_lengths"][0])
    np.testing.assert_allclose(batch["gt_boxes"][0, :n_boxes].numpy(), rows[key]["boxes"])
    assert batch["tokens.features"].shape[-1] == 3 and "tokens.features_lengths" in batch
    assert sorted(k for b in batches for k in b["key"]) == sorted(
        r["key"] for r in manifest.split("val").to_pylist()
    )


def test_rebuild_is_bitwise_identical(packed, tmp_path):
    root, manifest, _ = packed
    stores = {"global": Store.open(root / "g.zarr")}
    digests = []
    for run in ("a", "b"):
        build_shards(manifest, stores, tmp_path / run, samples_per_shard=7)
        digests.append(
            {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / run).iterdir()}
        )
    assert digests[0] == digests[1]


def test_refuses_stores_of_another_manifest(packed, tmp_path):
    root, manifest, _ = packed
    keys = manifest.table["key"].to_pylist()
    other = Provenance("test", "1", {}, None, "0" * 64)
    with StoreWriter(
        tmp_path / "o.zarr", "global", {"x": FieldSpec((), "int32")}, keys, other
    ) as w:
        w.write_shard(0, {"x": np.zeros(len(keys))})
    with pytest.raises(StoreError, match="not from this one"):
        build_shards(manifest, {"o": Store.open(tmp_path / "o.zarr")}, tmp_path / "s")


def keys_of(pipeline):
    return [k for batch in pipeline for k in batch["key"]]


def test_epoch_covers_train_once_and_shuffles(packed):
    root, manifest, _ = packed
    first = keys_of(stream(root / "out", "train", 8, shuffle_buffer=20, seed=1))
    assert sorted(first) == sorted(r["key"] for r in manifest.split("train").to_pylist())
    assert first != sorted(first)


def test_split_by_node_and_worker(packed, monkeypatch):
    root, _, _ = packed
    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loader = DataLoader(
            stream(root / "out", "train", 4),
            batch_size=None,
            num_workers=2,
            multiprocessing_context="spawn",
        )  # see test_loader
        per_rank.append(keys_of(loader))
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(per_rank[0]) + len(per_rank[1]) == 40


def test_resampled_gives_fixed_epochs(packed):
    root, _, _ = packed
    pipeline = stream(root / "out", "train", 4, resampled=True, batches_per_epoch=25)
    batches = list(pipeline)
    assert len(batches) == 25 and all(len(b["key"]) == 4 for b in batches)


def test_token_ids_and_scene_graphs_per_caption(packed, tmp_path):
    root, manifest, _ = packed
    caption_keys = [
        f"{r['key']}#{j}" for r in manifest.table.to_pylist() for j in range(len(r["captions"]))
    ]
    fields = {
        "word_ids": FieldSpec((), "int32", ragged=True),
        "wordpiece_ids": FieldSpec((), "int32", ragged=True),
    }
    provenance = Provenance("test", "1", {}, None, manifest.digest)
    with StoreWriter(
        tmp_path / "text.zarr",
        "text",
        fields,
        caption_keys,
        provenance,
        StoreConfig(samples_per_shard=64, samples_per_chunk=16),
    ) as w:
        for shard in w.pending_shards():
            lo, hi = w.shard_range(shard)
            w.write_shard(
                shard,
                {
                    "word_ids": [np.arange(i % 4 + 1) + i for i in range(lo, hi)],
                    "wordpiece_ids": [np.array([101, i, 102]) for i in range(lo, hi)],
                },
            )
    graphs = {
        k: {"objects": [{"lemma": k}], "attributes": [], "relations": []} for k in caption_keys
    }
    build_shards(
        manifest,
        {},
        tmp_path / "s",
        samples_per_shard=7,
        text=Store.open(tmp_path / "text.zarr"),
        scene_graphs=graphs,
    )
    batch = next(iter(stream(tmp_path / "s", "test", 6, shuffle_buffer=1)))
    key = batch["key"][0]
    first = caption_keys.index(f"{key}#0")
    assert batch["wordpiece_ids"][0][2] == [101, first + 2, 102]
    assert batch["word_ids"][0][0] == (np.arange(first % 4 + 1) + first).tolist()
    assert batch["scene_graphs"][0][4]["objects"][0]["lemma"] == f"{key}#4"
