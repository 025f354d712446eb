"""Training loader: every sample once per epoch, seeded two-level shuffle, DDP and workers."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from features.loader import BlockShuffleLoader

sys.path.insert(0, str(Path(__file__).parent))
import store_writer_job as job  # noqa: E402

N = 100  # 13 chunks of 8 (store_writer_job uses 4-sample chunks; blocks of 8 here)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    job.run(root / "regions.zarr", "regions", N, 16)
    job.run(root / "tokens.zarr", "tokens", N, 16)
    return root


def epoch_indices(loader, epoch=0):
    loader.set_epoch(epoch)
    return [b["index"].tolist() for b in loader]


def test_each_sample_once_with_features_matching_the_store(stores):
    loader = BlockShuffleLoader(
        stores / "regions.zarr",
        ["features", "boxes"],
        16,
        block_size=8,
        buffer_size=32,
        drop_last=False,
    )
    batches = list(loader)
    seen = np.concatenate([b["index"].numpy() for b in batches])
    assert sorted(seen.tolist()) == list(range(N))
    assert [len(b["index"]) for b in batches[:-1]] == [16] * (len(batches) - 1)
    store = loader.store
    b = batches[2]
    np.testing.assert_array_equal(b["features"].numpy(), store.read_indices(b["index"])["features"])
    assert b["features"].dtype == torch.float16 and b["boxes"].shape[1:] == (6, 4)


def test_shuffle_is_seeded_by_seed_and_epoch(stores):
    make = lambda seed: BlockShuffleLoader(  # noqa: E731
        stores / "regions.zarr", ["n_regions"], 10, block_size=8, buffer_size=40, seed=seed
    )
    a, b = make(0), make(0)
    assert epoch_indices(a, 0) == epoch_indices(b, 0)
    assert epoch_indices(a, 0) != epoch_indices(a, 1)
    assert epoch_indices(a, 0) != epoch_indices(make(1), 0)
    first = epoch_indices(a, 0)[0]
    assert first != sorted(first)  # shuffled within the buffer, not just block order


def test_ranks_are_disjoint_and_equal_in_length(stores):
    per_rank, counts = [], []
    for rank in range(3):
        loader = BlockShuffleLoader(
            stores / "regions.zarr", ["n_regions"], 8, block_size=8, rank=rank, world_size=3
        )
        batches = epoch_indices(loader, 5)
        assert len(batches) == len(loader)
        counts.append(len(batches))
        per_rank.append({i for b in batches for i in b})
    assert counts[0] == counts[1] == counts[2] == 3  # the rank with the 4-sample block: 28 // 8
    assert not (per_rank[0] & per_rank[1] or per_rank[1] & per_rank[2] or per_rank[0] & per_rank[2])


def test_dataloader_workers_split_blocks(stores):
    loader = BlockShuffleLoader(
        stores / "tokens.zarr", ["features"], 8, block_size=8, buffer_size=16, drop_last=False
    )
    # spawn, not fork: an earlier in-process Prefect run leaves threads that a fork copies
    dl = DataLoader(loader, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    batches = list(dl)
    seen = sorted(i for b in batches for i in b["index"].tolist())
    assert seen == list(range(N))
    b = batches[0]
    lengths = b["features_lengths"]
    assert b["features"].shape[:2] == (len(lengths), max(int(lengths.max()), 1))
    row = int(b["index"][0])
    expected = loader.store[row]["features"]
    np.testing.assert_array_equal(b["features"][0, : lengths[0]].numpy(), expected)


def test_subset_of_indices(stores):
    split = np.arange(20, 60)
    loader = BlockShuffleLoader(
        stores / "regions.zarr", ["n_regions"], 4, indices=split, block_size=8, drop_last=False
    )
    assert sorted(i for b in loader for i in b["index"].tolist()) == split.tolist()
