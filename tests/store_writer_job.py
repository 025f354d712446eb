"""A store-writing job for the crash tests: deterministic data, optionally slow.

usage: python store_writer_job.py PATH KIND N SHARD_SIZE [SLEEP_SECONDS]
"""

import sys
import time

import numpy as np

from features.store import Provenance, StoreConfig, StoreWriter, ragged_fields, regions_fields

PROVENANCE = Provenance("crash-test", "1", {"seed": 0}, "w" * 8, "m" * 64)


def fields_for(kind):
    return regions_fields(6, 16) if kind == "regions" else ragged_fields(16)


def shard_data(kind, start, stop):
    rng = np.random.default_rng(start)
    n = stop - start
    if kind == "regions":
        return {
            "features": rng.standard_normal((n, 6, 16)),
            "boxes": rng.random((n, 6, 4)) * 100,
            "n_regions": rng.integers(1, 7, n),
            "image_hw": np.tile([480, 640], (n, 1)),
        }
    return {"features": [rng.standard_normal((int(rng.integers(0, 9)), 16)) for _ in range(n)]}


def run(path, kind, n, shard_size, sleep=0.0, verbose=False):
    keys = [f"img{i:04d}" for i in range(n)]
    cfg = StoreConfig(samples_per_shard=shard_size, samples_per_chunk=4)
    with StoreWriter(path, kind, fields_for(kind), keys, PROVENANCE, cfg, log=lambda m: None) as w:
        for shard in w.pending_shards():
            start, stop = w.shard_range(shard)
            w.write_shard(shard, shard_data(kind, start, stop))
            if verbose:
                print(f"committed {shard}", flush=True)
            time.sleep(sleep)


if __name__ == "__main__":
    path, kind, n, shard_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    run(path, kind, n, shard_size, float(sys.argv[5]) if len(sys.argv) > 5 else 0.0, True)
