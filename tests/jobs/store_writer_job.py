"""A store-writing job for the crash tests: deterministic data, optionally slow.

usage: python store_writer_job.py PATH KIND N SHARD_SIZE [SLEEP_SECONDS]
       python store_writer_job.py --kill-each PREFIX KIND N SHARD_SIZE K1,K2,...

With ``VSE_TEST_KILL_AT_WRITE=K`` in the environment the job SIGKILLs itself just before
its K-th file system rename (0-based), i.e. with its K-th file written aside but not yet
in place: every moment between two atomic writes, creation and finalization included.
``--kill-each`` does that for each K into ``PREFIX<K>.zarr`` and then resumes it, in
forked processes of one interpreter (imports once: fast), printing ``K STATUS`` per K.
"""

import os
import signal
import sys
import time

import numpy as np

from features.store.spec import FieldSpec, Provenance, StoreConfig, regions_fields
from features.store.writer import StoreWriter

PROVENANCE = Provenance("crash-test", "1", {"seed": 0}, "w" * 8, "m" * 64)


def ragged_fields(dim, name="features"):
    return {name: FieldSpec((dim,), "float16", ragged=True)}


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


def count_writes() -> list[int]:
    """Patch the renames that put files in place: count them, and SIGKILL this process at
    the one numbered ``VSE_TEST_KILL_AT_WRITE``. Returns the live count."""
    kill_at = int(os.environ.get("VSE_TEST_KILL_AT_WRITE", "-1"))
    count = [0]

    def wrap(real):
        def renamed(*args, **kwargs):
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return real(*args, **kwargs)

        return renamed

    os.replace, os.rename, os.link = wrap(os.replace), wrap(os.rename), wrap(os.link)
    return count


def kill_each(prefix, kind, n, shard_size, points):
    """Per point K: a forked writer killed at its K-th rename, then a forked rerun."""
    for k in points:
        pid = os.fork()
        if pid == 0:  # no zarr I/O has happened in this process yet: no threads to lose
            os.environ["VSE_TEST_KILL_AT_WRITE"] = str(k)
            count_writes()
            run(f"{prefix}{k}.zarr", kind, n, shard_size)
            os._exit(0)
        killed = os.waitpid(pid, 0)[1]
        pid = os.fork()
        if pid == 0:
            run(f"{prefix}{k}.zarr", kind, n, shard_size)
            os._exit(0)
        rerun = os.waitpid(pid, 0)[1]
        state = "killed" if os.WIFSIGNALED(killed) else "finished"
        print(k, state, os.waitstatus_to_exitcode(rerun), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--kill-each":
        prefix, kind, n, shard_size, points = sys.argv[2:7]
        kill_each(prefix, kind, int(n), int(shard_size), [int(k) for k in points.split(",")])
        sys.exit(0)
    writes = count_writes() if "VSE_TEST_KILL_AT_WRITE" in os.environ else None
    path, kind, n, shard_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    run(path, kind, n, shard_size, float(sys.argv[5]) if len(sys.argv) > 5 else 0.0, True)
    if writes is not None:
        print(f"writes {writes[0]}", flush=True)
