"""Feature-store write throughput against writing the same bytes to one ``.npy``, in one
run.

Writes N samples of a regions store ((36, 2048) float16 features, boxes, counts: what
``vse extract regions`` writes, committed shard by shard with checksums) and, as a
second case, a text store's ragged BERT-like token features (10..19 rows of 768 float16
per caption); each against ``np.save`` of the same bytes, alternating over ``--rounds``
passes into fresh paths (removed between passes, untimed); the best pass counts. Both
write into the page cache: the figures follow the machine's memory pressure. Target
(issue 16): store write >= 0.5x the plain ``.npy`` write.

    python benchmarks/store_write.py [--n 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from features.store.spec import FieldSpec, Provenance, StoreConfig, regions_fields
from features.store.writer import StoreWriter

R, D, TOKEN_DIM = 36, 2048, 768


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="samples (2048: 300 MB of regions)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="vse-store-write-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n = args.n
    keys = [f"img{i:06d}" for i in range(n)]
    provenance = Provenance("bench", "1", {}, None, "m" * 64)
    regions = {
        "features": rng.standard_normal((n, R, D), dtype=np.float32).astype(np.float16),
        "boxes": rng.uniform(0, 600, (n, R, 4)).astype(np.float32),
        "n_regions": np.full(n, R, np.int32),
        "image_hw": np.tile(np.array([480, 640], np.int32), (n, 1)),
    }
    lengths = rng.integers(10, 20, n)
    tokens = rng.standard_normal((int(lengths.sum()), TOKEN_DIM), dtype=np.float32)
    tokens = tokens.astype(np.float16)
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    print(f"{load()} at start; regions {sum(a.nbytes for a in regions.values()) / 2**20:.0f} MB")
    counter = [0]
    written: list[Path] = []  # removed between passes, outside the timed part

    def clean() -> None:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        written.clear()

    def fresh(name: str) -> Path:
        counter[0] += 1
        return root / f"{name}{counter[0]}"

    def write_regions() -> int:
        path = fresh("regions").with_suffix(".zarr")
        fields = regions_fields(R, D)
        with StoreWriter(
            path, "regions", fields, keys, provenance, StoreConfig(), log=lambda m: None
        ) as writer:
            for shard in writer.pending_shards():
                a, b = writer.shard_range(shard)
                writer.write_shard(shard, {k: v[a:b] for k, v in regions.items()})
        written.append(path)
        return sum(a.nbytes for a in regions.values())

    def npy_regions() -> int:
        path = fresh("regions").with_suffix(".npy")
        with open(path, "wb") as f:  # the same bytes, one file
            for array in regions.values():
                np.save(f, array)
        written.append(path)
        return sum(a.nbytes for a in regions.values())

    def write_tokens() -> int:
        path = fresh("text").with_suffix(".zarr")
        fields = {"features": FieldSpec((TOKEN_DIM,), "float16", ragged=True)}
        with StoreWriter(
            path, "text", fields, keys, provenance, StoreConfig(), log=lambda m: None
        ) as writer:
            for shard in writer.pending_shards():
                a, b = writer.shard_range(shard)
                rows = [tokens[cuts[i] : cuts[i + 1]] for i in range(a, b)]
                writer.write_shard(shard, {"features": rows})
        written.append(path)
        return tokens.nbytes

    def npy_tokens() -> int:
        path = fresh("text").with_suffix(".npy")
        np.save(path, tokens)
        written.append(path)
        return tokens.nbytes

    writers = {
        "regions: np.save, one .npy (baseline)": npy_regions,
        "regions: feature store (StoreWriter)": write_regions,
        "ragged tokens: np.save, one .npy (baseline)": npy_tokens,
        "ragged tokens: feature store (StoreWriter)": write_tokens,
    }
    best = dict.fromkeys(writers, 0.0)
    try:
        for write in writers.values():
            write()  # warm-up
            clean()
        for _ in range(args.rounds):
            for name, write in writers.items():
                start = time.perf_counter()
                nbytes = write()
                best[name] = max(best[name], nbytes / (time.perf_counter() - start))
                clean()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{n} samples, best of {args.rounds} passes, {load()}")
    print(f"{'writer':<48}{'MB/s':>8}{'x .npy':>8}")
    for name, rate in best.items():
        base = best[name.split(":")[0] + ": np.save, one .npy (baseline)"]
        print(f"{name:<48}{rate / 2**20:>8.0f}{rate / base:>8.2f}")
    store = best["regions: feature store (StoreWriter)"]
    npy = best["regions: np.save, one .npy (baseline)"]
    print(f"target: regions store >= 0.5x .npy: {store / npy:.2f}")


if __name__ == "__main__":
    main()
