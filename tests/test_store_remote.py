"""A store written straight to S3 (moto on 127.0.0.1) by several writers with no lock
(:mod:`features.store.remote`): the first committed copy of a shard wins, a loser or a
late zombie never mixes into a shard, a killed writer or a lost endpoint costs a rerun,
and the finished store equals the local writer's byte for byte."""

import sys
import threading
from pathlib import Path

import pytest

from features.store.integrity import verify_store
from features.store.reader import Store
from features.store.remote import RemoteStoreWriter
from features.store.spec import StoreConfig, StoreError

sys.path.insert(0, str(Path(__file__).parent))
import store_writer_job as job  # noqa: E402
from local_s3 import local_s3, start_endpoint, stop_endpoint  # noqa: E402
from test_store import files_of  # noqa: E402

N, PER_SHARD = 40, 8  # 5 shards
URL = "s3://stores/regions.zarr"


@pytest.fixture
def s3(tmp_path):
    """A fresh endpoint and the local writer's store of the same samples."""
    import s3fs

    job.run(tmp_path / "local.zarr", "regions", N, PER_SHARD)
    with local_s3("stores") as options:
        yield s3fs.S3FileSystem(**options), options, files_of(tmp_path / "local.zarr")


def remote(options, shards=None, kind="regions", n=N, log=None) -> RemoteStoreWriter:
    keys = [f"img{i:04d}" for i in range(n)]
    cfg = StoreConfig(samples_per_shard=PER_SHARD, samples_per_chunk=4)
    args = (URL, kind, job.fields_for(kind), keys, job.PROVENANCE, cfg)
    return RemoteStoreWriter(
        *args, log=log or (lambda m: None), shards=shards, storage_options=options
    )


def write(writer: RemoteStoreWriter, shards=None) -> None:
    for shard in shards if shards is not None else writer.pending_shards():
        writer.write_shard(shard, job.shard_data("regions", *writer.shard_range(shard)))


def files_at(fs, url: str) -> dict[str, bytes]:
    root = url.removeprefix("s3://")
    fs.invalidate_cache()
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in sorted(fs.find(root))}


def assert_the_local_store(fs, options, local: dict) -> None:
    assert files_at(fs, URL) == local
    assert verify_store(URL, options) == []
    assert not fs.exists(URL + ".incomplete")  # no staging left


def test_overlapping_writers_keep_the_first_commit_of_each_shard(s3):
    fs, options, local = s3
    with remote(options) as coordinator:  # creates the skeleton: 5 shards pending
        assert coordinator.pending_shards() == [0, 1, 2, 3, 4]
    with pytest.raises(StoreError, match="incomplete, 0 of 5 shards committed"):
        Store.open(URL, storage_options=options)  # the skeleton is no store yet
    said = []
    with (
        remote(options, shards=[0, 1, 2, 3]) as a,
        remote(options, [2, 3, 4], log=said.append) as b,
    ):
        write(a)
        write(b, [2, 3, 4])  # 2 and 3 were committed by a: b's copies are discarded
    assert said == [
        f"store {URL}: shard {k} was committed first by writer {a.writer}; this writer's "
        f"copy ({b.writer}) is discarded"
        for k in (2, 3)
    ]
    fs.invalidate_cache()
    staged = {p.rsplit("/", 1)[1] for p in fs.find(f"{URL}.incomplete/{b.writer}/features")}
    assert staged == {"c.4.0.0"}  # its copies of 2 and 3 are gone
    with pytest.raises(StoreError, match="incomplete"):
        Store.open(URL, storage_options=options)  # committed by claims, not yet in place
    with remote(options) as coordinator:
        assert coordinator.pending_shards() == []  # finalized on close
    assert_the_local_store(fs, options, local)
    with remote(options) as again:  # complete, made from the same inputs: kept as it is
        assert again.reused and again.pending_shards() == []
    assert files_at(fs, URL) == local


def test_a_zombie_writer_loses_to_the_writer_its_task_moved_to(s3):
    """A writer frozen between staging its shard and claiming it (a worker cut off from the
    network, its task given to another worker): it wakes before finalization and loses,
    or after it, and touches only its own staging, which the next coordinator deletes."""
    fs, options, local = s3
    with remote(options):
        pass
    staged, wake = threading.Event(), threading.Event()
    zombie = remote(options, shards=[1])
    put = zombie.fs.put_file

    def put_then_freeze(*args, **kwargs):
        put(*args, **kwargs)
        if threading.current_thread().name == "zombie" and not staged.is_set():
            staged.set()
            wake.wait(60)

    zombie.fs.put_file = put_then_freeze  # fsspec shares the instance: the thread decides
    errors = []

    def run_zombie():
        try:
            with zombie:
                write(zombie)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=run_zombie, name="zombie")
    thread.start()
    assert staged.wait(60)
    with remote(options) as moved:  # the moved task and every other shard, then finalized
        write(moved)
    assert_the_local_store(fs, options, local)
    wake.set()
    thread.join(60)
    assert not errors
    assert files_at(fs, URL) == local  # the zombie's copy went to its staging only
    with remote(options) as rerun:
        assert rerun.reused
    assert_the_local_store(fs, options, local)


def test_a_writer_killed_mid_shard_or_an_endpoint_lost_costs_a_rerun(s3):
    """A writer that dies after staging part of a shard; an endpoint that restarts in the
    middle of a shard (its retries carry the writer over), then one that stays away until
    the writer fails in one line: what was committed stays, nothing half-written is
    committed, and a rerun completes the local writer's store."""
    fs, options, local = s3
    with remote(options) as coordinator:
        write(coordinator, [0])
        put, calls = coordinator.fs.put_file, []

        def put_then_die(*args, **kwargs):
            put(*args, **kwargs)
            calls.append(args)
            if len(calls) == 2:  # stands in for SIGKILL: the shard is half staged
                raise KeyboardInterrupt

        coordinator.fs.put_file = put_then_die
        with pytest.raises(KeyboardInterrupt):
            write(coordinator, [1])
        del coordinator.fs.put_file
    with pytest.raises(StoreError, match="incomplete"):
        Store.open(URL, storage_options=options)
    with remote(options) as rerun:
        assert rerun.pending_shards() == [1, 2, 3, 4]
        write(rerun, [1])
        put, calls = rerun.fs.put_file, []

        def put_then_restart(*args, **kwargs):
            put(*args, **kwargs)
            calls.append(args)
            if len(calls) == 1:  # down for a second in the middle of shard 2
                stop_endpoint(options)
                threading.Timer(1.0, start_endpoint, [options]).start()

        rerun.fs.put_file = put_then_restart
        write(rerun, [2])
        del rerun.fs.put_file
    impatient = {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    with remote(impatient) as last:
        stop_endpoint(options)
        with pytest.raises(Exception) as lost:
            write(last, [3])
        assert "\n" not in str(lost.value) and options["endpoint_url"] in str(lost.value)
        start_endpoint(options)
    with remote(options) as coordinator:
        assert coordinator.pending_shards() == [3, 4]
        write(coordinator)
    assert_the_local_store(fs, options, local)


def test_remote_writers_refuse_ragged_missing_and_other_stores(s3):
    fs, options, _ = s3
    with pytest.raises(StoreError, match="does not exist; create it first with one coordinator"):
        remote(options, shards=[0]).open()
    with pytest.raises(StoreError, match=r"ragged field\(s\) \['features'\] .* push it"):
        remote(options, kind="tokens").open()
    with remote(options, n=16):
        pass
    with pytest.raises(StoreError, match=r"other inputs or with another layout \(n 16 != 40\)"):
        remote(options, shards=[0]).open()
    with pytest.raises(StoreError, match=r"shard\(s\) \[5\] out of range"):
        remote(options, shards=[5])
    with remote(options):
        pass
    with remote(options, shards=[2]) as w, pytest.raises(StoreError, match="not one of this"):
        w.write_shard(3, job.shard_data("regions", 24, 32))
