"""Read throughput of the feature store against a numpy memmap baseline, in one run.

Writes N samples of (36, 2048) float16 region features (147 KB each) three ways: a plain
.npy (read through a memmap: the baseline), a feature store, and WebDataset shards; reads
each warm (after one untimed pass) and prints samples/s, MB/s and the ratio to the
baseline: random batches gathered from the store (``Store.gather``, what training
reads), and the shards' groups read and gathered into batches (``features.shards``,
what streaming training reads), with and without the check of every member's CRC-32C:
warm (each shard mapped and checked once, as every epoch after a process's first read
of it) and on a shard's first read (maps dropped before each pass; also the bare read,
not gathered). Targets: store gathers >= 0.8x, WebDataset streaming >= 0.5x
(issue 16); the members' check costs <= 10% of shard read throughput (issue 25). Zarr's
own API reads the same stores too (``Array.oindex[batch]``, its sharding codec: a few
batches a pass, it is slow), on this COCO-sized store and on one of the demo's regions
shape (800 x (10, 256) float16), against ``Store.gather``: the hand reader stays only
where it is at least 1.5x faster (issue 22).
``benchmarks/train_input.py`` measures whole training batches.

    python benchmarks/store_read.py [--n 4096] [--batch 128] [--dir /tmp/vse-bench]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zarr
from torch.utils.data import DataLoader, IterableDataset

from features.ingest.manifest import Dataset, Record, read_manifest, write_manifest
from features.shards import members
from features.shards.reader import GroupColumns, read_groups, read_sizes
from features.shards.writer import ShardsConfig, build_shards
from features.store.reader import Kept, Store
from features.store.spec import Provenance, StoreConfig, regions_fields
from features.store.writer import StoreWriter

R, D = 36, 2048


class MemmapBatches(IterableDataset):
    """The baseline inside a DataLoader worker, to compare like with like."""

    def __init__(self, path: Path, batch: int):
        self.path, self.batch = path, batch

    def __iter__(self):
        data = np.load(self.path, mmap_mode="r")
        order = np.random.default_rng().permutation(len(data))
        for i in range(0, len(data) - self.batch + 1, self.batch):
            yield torch.from_numpy(np.ascontiguousarray(data[np.sort(order[i : i + self.batch])]))


SAMPLE_BYTES = R * D * 2


def measure(readers: dict, rounds: int, log=lambda message: None) -> dict[str, float]:
    """Best samples/s of each reader over ``rounds`` interleaved passes, after one untimed
    pass each (warm page cache); interleaving spreads machine noise over all readers.
    Shared by ``train_input.py``."""
    for name, read in readers.items():
        read()
        log(f"  warmed up: {name}")
    best = dict.fromkeys(readers, 0.0)
    for _ in range(rounds):
        for name, read in readers.items():
            start = time.perf_counter()
            n = read()
            best[name] = max(best[name], n / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="samples (default 4096 = 600 MB)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--compression", default="none", choices=["none", "zstd"])
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per reader")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="vse-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n, batch = args.n, args.batch

    print(f"writing {n} samples of ({R}, {D}) float16 ({n * SAMPLE_BYTES / 2**20:.0f} MB) ...")
    keys = [f"img{i:06d}" for i in range(n)]
    records = [Record(k, f"{k}.jpg", "train", ["a caption"]) for k in keys]
    write_manifest(records, Dataset("bench", records), 1, root / "manifest.parquet")
    manifest = read_manifest(root / "manifest.parquet")
    memmap = np.lib.format.open_memmap(root / "ims.npy", "w+", np.float16, (n, R, D))
    provenance = Provenance("bench", "1", {}, None, manifest.digest)
    cfg = StoreConfig(compression=args.compression)
    with StoreWriter(
        root / "regions.zarr",
        "regions",
        regions_fields(R, D, boxes=False),
        keys,
        provenance,
        cfg,
        log=lambda m: None,
    ) as writer:
        for shard in writer.pending_shards():
            start, stop = writer.shard_range(shard)
            block = rng.standard_normal((stop - start, R, D), dtype=np.float32).astype(np.float16)
            memmap[start:stop] = block
            writer.write_shard(
                shard,
                {
                    "features": block,
                    "n_regions": np.full(stop - start, R),
                    "image_hw": np.zeros((stop - start, 2)),
                },
            )
    memmap.flush()
    store = Store.open(root / "regions.zarr")
    build_shards(manifest, {"regions": store}, root / "shards", ShardsConfig())
    sizes = read_sizes(root / "shards")

    baseline = np.load(root / "ims.npy", mmap_mode="r")

    def memmap_batches() -> int:
        order = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            np.ascontiguousarray(baseline[np.sort(order[i : i + batch])])
        return n // batch * batch

    def memmap_per_sample() -> int:  # what the VSE++/SCAN precomp loaders do
        order = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            np.stack([baseline[j] for j in order[i : i + batch]])
        return n // batch * batch

    out = np.empty((batch, R, D), np.float16)

    def store_gather() -> int:  # random batches into a reused buffer, as training does
        order = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            store.gather("features", order[i : i + batch], alloc=lambda shape, dtype: out)
        return n // batch * batch

    def memmap_worker() -> int:
        dl = DataLoader(MemmapBatches(root / "ims.npy", batch), batch_size=None, num_workers=1)
        return sum(len(b) for b in dl)

    picks = rng.choice(keys, size=min(n, 512), replace=False)

    def by_key() -> int:
        for key in picks:
            store[key]
        return len(picks)

    zarr_features = zarr.open_array(root / "regions.zarr" / "features", mode="r")
    zarr_batches = max(1, min(4, n // batch))

    def zarr_oindex() -> int:  # Zarr's API: orthogonal selection of a random batch
        order = rng.permutation(n)
        for i in range(zarr_batches):
            zarr_features.oindex[order[i * batch : (i + 1) * batch]]
        return zarr_batches * batch

    fields = sizes["stores"]["regions"]["fields"]

    def webdataset(checked: bool = True) -> int:  # groups in shard order, shuffled in 2048
        count, held = 0, []
        for name, recorded in sorted(sizes["shards"].items()):
            for group in read_groups(str(root / "shards" / name), recorded if checked else None):
                held.append(group)
                if sum(g.n_images for g in held) >= 2048:
                    count += emit(held)
                    held = []
        return count + emit(held)

    def first_read(read) -> int:
        """``read`` as on a shard's first read: mapped, located (and checked) anew; the
        warm readers' maps are kept aside."""
        kept, members._MAPPED = members._MAPPED, Kept(members.MAX_MAPPED)
        try:
            return read()
        finally:
            members._MAPPED = kept

    def shard_read(checked: bool = True) -> int:  # groups read, not gathered
        count = 0
        for name, recorded in sorted(sizes["shards"].items()):
            for group in read_groups(str(root / "shards" / name), recorded if checked else None):
                count += group.n_images
        return count

    def emit(held) -> int:
        if not held:
            return 0
        columns = GroupColumns(held, "regions", fields, "images")
        order = rng.permutation(sum(g.n_images for g in held))
        for i in range(0, len(order) - batch + 1, batch):  # a batch in storage order
            rows = np.sort(order[i : i + batch])
            columns.gather("features", rows, alloc=lambda shape, dtype: out)
        return len(order) // batch * batch

    results = measure(
        {
            "numpy memmap, random batches (baseline)": memmap_batches,
            "numpy memmap, per-sample reads": memmap_per_sample,
            "store gather, random batches": store_gather,
            "Zarr API, random batches (Array.oindex)": zarr_oindex,
            "numpy memmap, random batches, 1 DataLoader worker": memmap_worker,
            "store random access by key": by_key,
            "WebDataset streaming (groups, gathered)": webdataset,
            "WebDataset streaming, members unchecked": lambda: webdataset(False),
            "WebDataset streaming, first read": lambda: first_read(webdataset),
            "WebDataset streaming, first read, unchecked": lambda: first_read(
                lambda: webdataset(False)
            ),
            "WebDataset shard first read (groups, not gathered)": lambda: first_read(shard_read),
            "WebDataset shard first read, unchecked": lambda: first_read(lambda: shard_read(False)),
        },
        args.rounds,
    )
    base = results["numpy memmap, random batches (baseline)"]
    print(f"\nbatch {batch}, best of {args.rounds} warm passes, compression {args.compression}")
    print(f"{'reader':<52}{'samples/s':>11}{'MB/s':>9}{'x memmap':>10}")
    for name, rate in results.items():
        print(f"{name:<52}{rate:>11.0f}{rate * SAMPLE_BYTES / 2**20:>9.0f}{rate / base:>10.2f}")
    # target (issue 25): the members' check costs <= 10% of shard read throughput
    for checked, unchecked in [
        ("WebDataset streaming (groups, gathered)", "WebDataset streaming, members unchecked"),
        ("WebDataset streaming, first read", "WebDataset streaming, first read, unchecked"),
        (
            "WebDataset shard first read (groups, not gathered)",
            "WebDataset shard first read, unchecked",
        ),
    ]:
        cost = 1 - results[checked] / results[unchecked]
        print(f"CRC-32C check of every member costs {cost:6.1%}: {checked}")
    demo_shapes(root, rng, batch, args.rounds)
    if args.dir is None:
        shutil.rmtree(root)


def demo_shapes(root: Path, rng, batch: int, rounds: int) -> None:
    """``Store.gather`` against Zarr's API on a store of the demo's regions shape."""
    n, r, d = 800, 10, 256
    data = rng.standard_normal((n, r, d), dtype=np.float32).astype(np.float16)
    keys = [f"img{i:06d}" for i in range(n)]
    fields = {"features": regions_fields(r, d)["features"]}
    provenance = Provenance("bench", "1", {}, None, "m" * 64)
    path = root / "demo.zarr"
    with StoreWriter(path, "regions", fields, keys, provenance, log=lambda m: None) as writer:
        for shard in writer.pending_shards():
            start, stop = writer.shard_range(shard)
            writer.write_shard(shard, {"features": data[start:stop]})
    store = Store.open(path)
    array = zarr.open_array(path / "features", mode="r")

    def batches(read, count: int) -> int:
        order = rng.permutation(n)
        for i in range(count):
            read(order[i * batch : (i + 1) * batch])
        return count * batch

    results = measure(
        {
            "demo regions: store gather (hand reader)": lambda: batches(
                lambda b: store.gather("features", b), n // batch
            ),
            "demo regions: Zarr API (Array.oindex)": lambda: batches(lambda b: array.oindex[b], 2),
        },
        rounds,
    )
    base = results["demo regions: Zarr API (Array.oindex)"]
    print(f"\ndemo-shaped store ({n} x ({r}, {d}) float16), batch {batch}")
    print(f"{'reader':<52}{'samples/s':>11}{'x Zarr':>10}")
    for name, rate in results.items():
        print(f"{name:<52}{rate:>11.0f}{rate / base:>10.2f}")


if __name__ == "__main__":
    main()
