"""Stores opened read-only from S3, against a local S3 endpoint (moto) on 127.0.0.1."""

import sys
from pathlib import Path

import numpy as np
import pytest

from features.store.integrity import verify_store
from features.store.reader import Store
from flows.cli import main

sys.path.insert(0, str(Path(__file__).parent))
import store_writer_job as job  # noqa: E402
from local_s3 import local_s3  # noqa: E402


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import s3fs

    with local_s3("stores") as options:
        fs = s3fs.S3FileSystem(**options)
        local = tmp_path_factory.mktemp("local") / "regions.zarr"
        job.run(local, "regions", 30, 8)
        fs.put(str(local), "stores/regions.zarr", recursive=True)
        yield fs, options, local


def test_open_read_and_verify_from_s3(s3):
    fs, options, local = s3
    remote = Store.open("s3://stores/regions.zarr", storage_options=options)
    here = Store.open(local)
    assert len(remote) == 30 and remote.fingerprint == here.fingerprint
    np.testing.assert_array_equal(remote["img0017"]["features"], here["img0017"]["features"])
    np.testing.assert_array_equal(remote.read(3, 20)["boxes"], here.read(3, 20)["boxes"])
    assert remote.verify() == []


def test_verify_names_a_corrupt_shard_on_s3(s3, capsys):
    fs, options, local = s3
    fs.put(str(local), "stores/broken.zarr", recursive=True)
    fs.pipe("stores/broken.zarr/features/c.1.0.0", b"garbage")
    url = "s3://stores/broken.zarr"
    assert Store.open(url, storage_options=options).verify() == [
        "features/c.1.0.0: corrupt (checksum mismatch)"
    ]
    import json

    assert main(["store", "verify", url, "--storage-options", json.dumps(options)]) == 1
    assert "features/c.1.0.0: corrupt" in capsys.readouterr().out
    assert main(["store", "info", url, "--json", "--storage-options", json.dumps(options)]) == 0
    assert '"kind": "regions"' in capsys.readouterr().out


def test_verify_names_damaged_metadata_keys_and_markers_on_s3(s3, capsys):
    import json

    fs, options, local = s3
    url = "s3://stores/meta.zarr"
    fs.put(str(local), "stores/meta.zarr", recursive=True)
    for rel in ("zarr.json", "keys/c.0", "_commits/c.1", "boxes/zarr.json"):
        data = fs.cat_file(f"stores/meta.zarr/{rel}")
        fs.pipe(f"stores/meta.zarr/{rel}", data[: len(data) // 2])
    assert main(["store", "verify", url, "--storage-options", json.dumps(options)]) == 1
    out, err = capsys.readouterr()
    for rel in ("zarr.json", "keys/c.0", "_commits/c.1", "boxes/zarr.json"):
        assert f"{url}: {rel}: corrupt" in out
    assert "Traceback" not in out + err
    assert main(["store", "info", url, "--storage-options", json.dumps(options)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {url}: its metadata")


def test_verify_of_an_incomplete_store_on_s3_reads_its_commit_markers(s3, tmp_path):
    """A store a killed run left on S3: its commit markers are read with the storage
    options (the URL given with a trailing slash, as shells complete it)."""
    from test_store import half_written

    fs, options, _ = s3
    root = half_written(tmp_path / "s.zarr")
    fs.put(str(root), "stores/half.zarr", recursive=True)
    fs.pipe("stores/half.zarr/features/c.0.0.0", b"garbage")
    assert verify_store("s3://stores/half.zarr/", options) == [
        "shard 1: not committed (store incomplete)",
        "features/c.0.0.0: corrupt (checksum mismatch)",
    ]
