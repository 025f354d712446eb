"""Feature store: layout, fingerprints, crash-safe resumable writes, readers, verify."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from features.store.integrity import checksums_text, parse_checksums, verify_store
from features.store.layout import incomplete_path
from features.store.reader import Store, join_by_key
from features.store.spec import (
    FieldSpec,
    Provenance,
    StoreConfig,
    StoreError,
    regions_fields,
)
from features.store.writer import StoreWriter

sys.path.insert(0, str(Path(__file__).parent))
import store_writer_job as job  # noqa: E402

JOB = Path(__file__).parent / "jobs" / "store_writer_job.py"


def files_of(path: Path) -> dict[str, bytes]:
    """Every file of a store (nothing in it depends on when or where it was written)."""
    return {
        str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
    }


@pytest.mark.parametrize("kind", ["regions", "tokens"])
def test_round_trip_random_access_and_verify(tmp_path, kind):
    job.run(tmp_path / "s.zarr", kind, 37, 8)
    store = Store.open(tmp_path / "s.zarr")
    assert len(store) == 37 and store.kind == kind and store.describe()["complete"]
    expected = job.shard_data(kind, 16, 24)
    sample = store["img0019"]
    assert store.index("img0019") == 19
    np.testing.assert_array_equal(
        sample["features"], np.asarray(expected["features"][3], dtype=np.float16)
    )
    picked = store.read_indices([30, 2, 19, 2])
    got = picked["features"]
    assert len(got) == 4
    np.testing.assert_array_equal(got[2], sample["features"])
    np.testing.assert_array_equal(got[1], got[3])
    if kind == "regions":
        assert got.shape == (4, 6, 16) and got.dtype == np.float16
        assert store.read(0, 5)["boxes"].dtype == np.float32
    else:
        assert store.offsets("features")[-1] == store.attrs["counts"]["features_rows"]
    assert store.verify() == []
    # plain zarr can read it too
    group = zarr.open_group(tmp_path / "s.zarr", mode="r")
    assert group["keys"][0] == "img0000" and group.attrs["vse"]["kind"] == kind
    with pytest.raises(KeyError, match="no sample with key 'nope'"):
        store["nope"]


def test_few_files_per_store(tmp_path):
    job.run(tmp_path / "s.zarr", "regions", 64, 32)
    data_files = [f for f in (tmp_path / "s.zarr").rglob("*") if f.is_file()]
    # 4 fields x 2 shards + keys + 2 markers + checksum manifest + 8 zarr.json
    assert len(data_files) == 4 * 2 + 1 + 2 + 1 + 8


@pytest.mark.parametrize("kind", ["regions", "tokens"])
def test_resume_after_sigkill_is_bitwise_identical(tmp_path, kind):
    job.run(tmp_path / "clean.zarr", kind, 120, 8)
    clean = files_of(tmp_path / "clean.zarr")
    target = tmp_path / "crashed.zarr"
    rng = np.random.default_rng(1 if kind == "regions" else 2)
    kills = 0
    for attempt in range(6):  # kill after a random number of commits, at a random moment
        proc = subprocess.Popen(
            # a pause after each commit (the writer takes ~1 ms a shard): killed in time
            [
                sys.executable,
                str(JOB),
                str(target),
                kind,
                "120",
                "8",
                str(0.003 * (1 + attempt % 2)),
            ],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(int(rng.integers(0, 4))):
            proc.stdout.readline()
        time.sleep(rng.uniform(0, 0.01))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        proc.stdout.close()
    assert kills >= 4, "the writer finished before it could be killed"
    if incomplete_path(target).exists():  # built aside: nothing at the store's own path
        assert not target.exists()
        with pytest.raises(StoreError, match="not a feature store"):
            Store.open(target)
        partial = Store.open(incomplete_path(target), require_complete=False)
        done = partial.committed
        if done.any() and not done.all():  # committed shards are readable, others refuse
            first_missing = int(np.argmin(done))
            with pytest.raises(StoreError, match="uncommitted"):
                partial.read(first_missing * 8, first_missing * 8 + 1)
    job.run(target, kind, 120, 8)
    assert files_of(target) == clean
    assert not incomplete_path(target).exists()
    assert Store.open(target).verify() == []


def test_second_writer_gets_a_lock_error(tmp_path):
    keys = ["a", "b"]
    with StoreWriter(tmp_path / "s.zarr", "tokens", job.ragged_fields(4), keys, job.PROVENANCE):
        with pytest.raises(StoreError, match="locked by a running writer \\(pid"):
            StoreWriter(
                tmp_path / "s.zarr", "tokens", job.ragged_fields(4), keys, job.PROVENANCE
            ).open()


def test_verify_names_corrupt_and_missing_shards(tmp_path):
    job.run(tmp_path / "s.zarr", "regions", 40, 8)
    root = tmp_path / "s.zarr"
    shard = root / "features/c.2.0.0"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    (root / "boxes/c.4.0.0").unlink()
    problems = Store.open(root).verify()
    assert problems == ["boxes/c.4.0.0: missing", "features/c.2.0.0: corrupt (checksum mismatch)"]


def test_fingerprint_and_manifest_checks(tmp_path):
    job.run(tmp_path / "s.zarr", "regions", 10, 8)
    store = Store.open(tmp_path / "s.zarr", kind="regions", manifest_digest="m" * 64)
    assert store.fingerprint == job.PROVENANCE.fingerprint("regions", job.fields_for("regions"))
    with pytest.raises(StoreError, match="built from manifest mmmmmmmmmmmm, but the manifest"):
        Store.open(tmp_path / "s.zarr", manifest_digest="x" * 64)
    with pytest.raises(StoreError, match="fingerprint .* does not match"):
        Store.open(tmp_path / "s.zarr", fingerprint="0" * 64)
    with pytest.raises(StoreError, match="a regions store, expected a grid store"):
        Store.open(tmp_path / "s.zarr", kind="grid")
    with pytest.raises(StoreError, match="not a feature store"):
        Store.open(tmp_path / "nothing.zarr")


def test_other_inputs_start_the_store_over(tmp_path):
    job.run(tmp_path / "s.zarr", "regions", 10, 8)
    other = Provenance("crash-test", "2", {"seed": 0}, "w" * 8, "m" * 64)
    messages = []
    fields = job.fields_for("regions")
    keys = [f"img{i:04d}" for i in range(10)]
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
    with StoreWriter(
        tmp_path / "s.zarr", "regions", fields, keys, other, cfg, messages.append
    ) as w:
        assert w.pending_shards() == [0, 1]
    assert "starting it over" in messages[0]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a feature store; remove it"):
        StoreWriter(tmp_path / "x", "regions", fields, keys, other, cfg).open()


def test_writer_checks_shapes_fields_and_order(tmp_path):
    keys = [str(i) for i in range(8)]
    cfg = StoreConfig(samples_per_shard=4, samples_per_chunk=2)
    with StoreWriter(
        tmp_path / "d.zarr", "regions", regions_fields(3, 5), keys, job.PROVENANCE, cfg
    ) as w:
        with pytest.raises(StoreError, match="'features' of shard 1 has shape \\(4, 3, 4\\)"):
            w.write_shard(
                1,
                {
                    "features": np.zeros((4, 3, 4)),
                    "boxes": np.zeros((4, 3, 4)),
                    "n_regions": np.zeros(4),
                    "image_hw": np.zeros((4, 2)),
                },
            )
        with pytest.raises(StoreError, match="expects"):
            w.write_shard(0, {"features": np.zeros((4, 3, 5))})
    with StoreWriter(
        tmp_path / "r.zarr", "tokens", job.ragged_fields(5), keys, job.PROVENANCE, cfg
    ) as w:
        with pytest.raises(StoreError, match="committed in order"):
            w.write_shard(1, {"features": [np.zeros((2, 5))] * 4})


def test_join_by_key_refuses_other_manifests(tmp_path):
    job.run(tmp_path / "a.zarr", "regions", 10, 8)
    job.run(tmp_path / "b.zarr", "tokens", 10, 8)
    a, b = Store.open(tmp_path / "a.zarr"), Store.open(tmp_path / "b.zarr")
    rows = join_by_key({"regions": a, "tokens": b}, ["img0003", "img0001"])
    assert rows["regions"].tolist() == [3, 1] and rows["tokens"].tolist() == [3, 1]
    keys = [f"img{i:04d}" for i in range(10)]
    other = Provenance("x", "1", {}, None, "z" * 64)
    with StoreWriter(tmp_path / "c.zarr", "tokens", job.ragged_fields(16), keys, other) as w:
        w.write_shard(0, job.shard_data("tokens", 0, 10))
    with pytest.raises(StoreError, match="different manifests"):
        join_by_key({"a": a, "c": Store.open(tmp_path / "c.zarr")}, keys)
    with pytest.raises(StoreError, match="store 'regions': .*no sample with key 'zz'"):
        join_by_key({"regions": a}, ["zz"])


def test_cli_ls_info_verify(tmp_path, capsys):
    from flows.cli import main

    job.run(tmp_path / "feats" / "regions.zarr", "regions", 20, 8)
    assert main(["store", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "regions.zarr" in out and "complete" in out and " 20 " in out
    assert main(["store", "info", str(tmp_path / "feats" / "regions.zarr")]) == 0
    assert "manifest_digest: " + "m" * 64 in capsys.readouterr().out
    assert main(["store", "verify", str(tmp_path / "feats" / "regions.zarr")]) == 0
    assert "is intact" in capsys.readouterr().out
    (tmp_path / "feats" / "regions.zarr" / "boxes/c.1.0.0").write_bytes(b"x")
    assert main(["store", "verify", str(tmp_path / "feats" / "regions.zarr")]) == 1
    assert "boxes/c.1.0.0: corrupt" in capsys.readouterr().out


def test_memory_mapped_reads_equal_zarr_reads(tmp_path):
    job.run(tmp_path / "s.zarr", "regions", 37, 8)  # chunks of 4 inside shards of 8
    store = Store.open(tmp_path / "s.zarr")
    assert store._mappable
    group = zarr.open_group(tmp_path / "s.zarr", mode="r")
    for start, stop in [(0, 37), (3, 13), (8, 16), (35, 37), (6, 7)]:
        got = store.read(start, stop, copy=False)
        for name in ("features", "boxes", "n_regions", "image_hw"):
            np.testing.assert_array_equal(got[name], group[name][start:stop])
    assert not store.read(0, 4, copy=False)["features"].flags.writeable
    assert store.read(0, 4)["features"].flags.writeable  # copies by default


def test_compressed_store_reads_through_zarr(tmp_path):
    keys = [f"k{i}" for i in range(20)]
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4, compression="zstd")
    data = np.random.default_rng(0).standard_normal((20, 3, 5)).astype(np.float16)
    with StoreWriter(
        tmp_path / "z.zarr",
        "x",
        {"f": job.regions_fields(3, 5)["features"]},
        keys,
        job.PROVENANCE,
        cfg,
    ) as w:
        for shard in w.pending_shards():
            start, stop = w.shard_range(shard)
            w.write_shard(shard, {"f": data[start:stop]})
    store = Store.open(tmp_path / "z.zarr")
    assert not store._mappable and store.verify() == []
    np.testing.assert_array_equal(store.read(2, 19)["f"], data[2:19])


def damaged_copies(root: Path):
    """Every way of damaging each file of a store once: (file, what, damage) where
    ``damage()`` changes the file and returns a function that restores it."""
    for path in sorted(f for f in root.rglob("*") if f.is_file()):
        data = path.read_bytes()
        positions = sorted({0, len(data) // 2, len(data) - 1})
        for pos in positions:

            def flip(path=path, data=data, pos=pos):
                changed = bytearray(data)
                changed[pos] ^= 0x01
                path.write_bytes(bytes(changed))

            yield path, f"byte {pos} flipped", flip, data
        yield (
            path,
            "truncated",
            lambda path=path, data=data: path.write_bytes(data[: len(data) // 2]),
            data,
        )


@pytest.mark.parametrize("kind", ["regions", "tokens"])
def test_verify_names_any_damaged_byte_of_any_file(tmp_path, kind):
    """Array metadata, keys, root attributes, commit markers, chunks and the checksum
    manifest itself: one flipped byte or a truncation anywhere is named, never missed."""
    root = tmp_path / "s.zarr"
    job.run(root, kind, 10, 8)
    assert verify_store(root) == []
    kinds = {str(f.relative_to(root)).split("/")[0] for f in root.rglob("*") if f.is_file()}
    assert {"zarr.json", "keys", "_commits", "_checksums", "features"} <= kinds
    checked, n_files = 0, sum(1 for f in root.rglob("*") if f.is_file())
    for path, what, damage, original in damaged_copies(root):
        rel = str(path.relative_to(root))
        damage()
        problems = verify_store(root)
        path.write_bytes(original)
        assert any(p.startswith(f"{rel}:") for p in problems), (rel, what, problems)
        checked += 1
    assert checked >= 3 * n_files and verify_store(root) == []


def test_the_checksum_manifest_checks_itself_at_every_byte(tmp_path):
    """Whatever byte of the manifest changes (to any of a few values, whitespace
    included), and wherever it is cut, it no longer passes as a manifest."""
    from features.store.integrity import parse_checksums
    from features.store.layout import CHECKSUMS_CHUNK

    job.run(tmp_path / "s.zarr", "regions", 10, 8)
    data = (tmp_path / "s.zarr" / CHECKSUMS_CHUNK).read_bytes()
    assert len(parse_checksums(data)) == sum(1 for f in (tmp_path / "s.zarr").rglob("*")) - (
        sum(1 for f in (tmp_path / "s.zarr").rglob("*") if f.is_dir()) + 1
    )
    variants = [data[:n] for n in range(len(data))] + [data + b" "]
    for pos in range(len(data)):
        for mask in (0x01, 0x20, 0x80):
            changed = bytearray(data)
            changed[pos] ^= mask
            variants.append(bytes(changed))
    for variant in variants:
        with pytest.raises(ValueError):
            parse_checksums(variant)


def test_verify_of_a_damaged_store_is_one_line_per_problem_not_a_traceback(tmp_path, capsys):
    from flows.cli import main

    root = tmp_path / "s.zarr"
    job.run(root, "regions", 10, 8)
    (root / "zarr.json").write_bytes((root / "zarr.json").read_bytes()[:40])
    assert main(["store", "verify", str(root)]) == 1
    out, err = capsys.readouterr()
    assert "zarr.json: corrupt" in out and "Traceback" not in out + err
    assert main(["store", "info", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "zarr.json" in err and len(err.splitlines()) == 1
    with pytest.raises(StoreError, match="vse store verify"):
        Store.open(root)


def test_verify_names_a_damaged_commit_marker_of_an_incomplete_store(tmp_path):
    target = tmp_path / "s.zarr"
    keys = [f"img{i:04d}" for i in range(16)]
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
    with StoreWriter(target, "regions", job.fields_for("regions"), keys, job.PROVENANCE, cfg) as w:
        w.write_shard(0, job.shard_data("regions", 0, 8))
    root = incomplete_path(target)
    assert verify_store(root) == ["shard 1: not committed (store incomplete)"]
    marker = root / "_commits/c.0"
    marker.write_bytes(marker.read_bytes()[:-3])
    problems = verify_store(root)
    assert any(p.startswith("_commits/c.0:") for p in problems), problems


def half_written(target):
    """A 16-sample store of two shards with shard 0 committed and shard 1 not: where a
    killed run leaves it (the incomplete path)."""
    keys = [f"img{i:04d}" for i in range(16)]
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
    with StoreWriter(target, "regions", job.fields_for("regions"), keys, job.PROVENANCE, cfg) as w:
        w.write_shard(0, job.shard_data("regions", 0, 8))
    return incomplete_path(target)


def test_verify_of_an_incomplete_store_checks_the_committed_shards_files(tmp_path):
    root = half_written(tmp_path / "s.zarr")
    chunk = root / "features" / "c.0.0.0"
    chunk.write_bytes(chunk.read_bytes()[::-1])
    assert verify_store(str(root) + "/") == [
        "shard 1: not committed (store incomplete)",
        "features/c.0.0.0: corrupt (checksum mismatch)",
    ]


def test_verify_of_an_incomplete_store_names_each_damaged_marker_exactly(tmp_path):
    root = half_written(tmp_path / "s.zarr")
    zarr.open_array(root / "_commits", mode="r+")[0] = json.dumps({"shard": 0})
    assert verify_store(root) == [
        "_commits/c.0: corrupt (ValueError: no file checksums)",
        "shard 1: not committed (store incomplete)",
    ]
    (root / "_commits" / "zarr.json").write_text("{")
    assert verify_store(root) == ["_commits/zarr.json: corrupt or missing (JSONDecodeError)"]


def test_verify_of_an_incomplete_store_with_damaged_metadata_reads_every_marker(tmp_path):
    root = half_written(tmp_path / "s.zarr")
    (root / "zarr.json").write_text('{"attributes": ')
    problems = verify_store(root)
    assert problems[0].startswith("zarr.json: corrupt (JSONDecodeError: ")
    assert problems[1:] == ["shard 1: not committed (store incomplete)"]


def test_verify_of_an_incomplete_store_changes_nothing_and_takes_any_name(tmp_path):
    """Without its markers' array, verify names it and writes nothing (opening the array
    to append would leave an empty folder); a store whose name ends in a letter that
    could be stripped from a URL, in a space, or in '/', is read at its own path."""
    root = half_written(tmp_path / "s.zarr").rename(tmp_path / "regions ")
    assert verify_store(root) == ["shard 1: not committed (store incomplete)"]
    root = root.rename(tmp_path / "regionsX")
    assert verify_store(f"{root}/") == ["shard 1: not committed (store incomplete)"]
    shutil.rmtree(root / "_commits")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert verify_store(root)[0] == "_commits/zarr.json: corrupt or missing (FileNotFoundError)"
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_verify_names_each_marker_missing_from_a_cut_markers_array(tmp_path):
    """The markers' array says 1 shard where the store's attributes say 2: the second
    shard's marker is named, not skipped."""
    root = half_written(tmp_path / "s.zarr")
    meta = json.loads((root / "_commits" / "zarr.json").read_text())
    meta["shape"] = [1]
    (root / "_commits" / "zarr.json").write_text(json.dumps(meta))
    problems = verify_store(root)
    assert len(problems) == 1 and problems[0].startswith("_commits/c.1: corrupt (IndexError")


def test_verify_names_a_damaged_marker_by_the_stores_own_key_layout(tmp_path, monkeypatch):
    """A store made before the flat keys (``_commits/c/0``) has its damaged marker named by
    its own path; a reason too long for one line is cut to 200 characters."""
    root = half_written(tmp_path / "s.zarr")
    meta = json.loads((root / "_commits" / "zarr.json").read_text())
    meta["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
    (root / "_commits" / "zarr.json").write_text(json.dumps(meta))
    for k in (0, 1):
        old = root / "_commits" / f"c.{k}"
        if old.exists():
            (root / "_commits" / "c").mkdir(exist_ok=True)
            old.rename(root / "_commits" / "c" / str(k))
    zarr.open_array(root / "_commits", mode="r+")[0] = json.dumps({"shard": 0})
    assert verify_store(root)[0] == "_commits/c/0: corrupt (ValueError: no file checksums)"

    loads = json.loads

    def long_reason(text, *args, **kwargs):  # for the damaged marker only
        if text == json.dumps({"shard": 0}):
            raise ValueError("x" * 300)
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", long_reason)
    problem = verify_store(root)[0]
    assert problem.startswith("_commits/c/0: corrupt (ValueError: xxx") and len(problem) == 200


def vlen_utf8(text: str) -> bytes:
    """An uncompressed Zarr vlen-utf8 chunk of one string."""
    data = text.encode()
    return (1).to_bytes(4, "little") + len(data).to_bytes(4, "little") + data


def test_a_checksum_manifest_is_refused_for_exactly_what_is_wrong_with_it():
    files = {"b/c.0": "crc32c:00000001", "a/zarr.json": "crc32c:00000002"}
    assert parse_checksums(vlen_utf8(checksums_text(files))) == dict(sorted(files.items()))
    with pytest.raises(ValueError, match="^not one vlen-utf8 string$"):
        parse_checksums(b"\x01\x00")
    with pytest.raises(ValueError, match="^Expecting value"):  # one empty string: no JSON
        parse_checksums(vlen_utf8(""))
    with pytest.raises(ValueError, match="^11 bytes for a string of 10$"):
        parse_checksums(vlen_utf8("abcdefghij")[:11])
    body = json.loads(checksums_text(files))
    unsorted = json.dumps({"files": body["files"], "digest": body["digest"]}, separators=(",", ":"))
    with pytest.raises(ValueError, match="^not in canonical form$"):
        parse_checksums(vlen_utf8(unsorted))
    with pytest.raises(ValueError, match="^not a listing of checksums$"):
        parse_checksums(vlen_utf8(checksums_text({"a/zarr.json": 5})))
    tampered = json.dumps(body | {"digest": "0" * 64}, sort_keys=True, separators=(",", ":"))
    with pytest.raises(ValueError, match="^its digest does not match its listing$"):
        parse_checksums(vlen_utf8(tampered))
    with pytest.raises(ValueError, match=r"^not a checksum manifest \(KeyError: 'files'\)$"):
        parse_checksums(vlen_utf8(json.dumps({"digest": "0"}, separators=(",", ":"))))


def test_files_of_stores_checksummed_with_sha256_still_verify():
    from features.store.integrity import _checksum_matches, sha256_bytes

    assert _checksum_matches(b"shard", sha256_bytes(b"shard"))
    assert not _checksum_matches(b"shard", sha256_bytes(b"shard!"))


def test_verify_checks_an_incomplete_stores_own_arrays_and_skips_writers_files(tmp_path):
    """A store-level array (e.g. a fitted projection) of an incomplete store is checked
    against the checksum its attributes record; writers' temporary and lock files are
    never listed as unexpected files of a complete store."""
    target = tmp_path / "s.zarr"
    keys = [f"img{i:04d}" for i in range(16)]
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
    with StoreWriter(target, "regions", job.fields_for("regions"), keys, job.PROVENANCE, cfg) as w:
        w.write_shard(0, job.shard_data("regions", 0, 8))
        w.write_extra("mean", np.arange(4.0))
    root = incomplete_path(target)
    assert verify_store(root) == ["shard 1: not committed (store incomplete)"]
    extra = root / "mean" / "c" / "0"
    extra.write_bytes(extra.read_bytes() + b"x")
    assert verify_store(root)[1:] == ["mean/c/0: corrupt (checksum mismatch)"]
    job.run(tmp_path / "whole.zarr", "regions", 10, 8)
    (tmp_path / "whole.zarr" / "features" / ".c.0.0.0.123.abc.tmp").write_bytes(b"half")
    (tmp_path / "whole.zarr" / ".lock").write_text("pid 1")
    assert verify_store(tmp_path / "whole.zarr") == []


def test_store_files_lists_every_file_but_writers_locks_and_temporary_files(tmp_path):
    from features.store.integrity import local_fs, store_files

    for rel in ["zarr.json", "features/c/0", ".lock", ".shard_locks/3", "features/.c.1.9.ab.tmp"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / "keys" / ".lock").parent.mkdir()
    (tmp_path / "keys" / ".lock").write_text("a lock's name, not the store's lock")
    listed = list(store_files(*local_fs(tmp_path)))
    assert listed == ["features/c/0", "keys/.lock", "zarr.json"]


def test_checksums_of_arrays_equal_those_of_their_bytes():
    """Chunks come as bytes, buffers or arrays of any shape and layout."""
    from features.store.integrity import file_checksum

    grid = np.arange(24, dtype=np.int32).reshape(4, 6)
    for array in (grid, grid.T, grid[::2], memoryview(grid.tobytes())):
        assert file_checksum(array) == file_checksum(np.ascontiguousarray(array).tobytes())
    assert file_checksum(grid.T) != file_checksum(grid.tobytes())


def test_verify_names_what_is_wrong_with_a_stores_attributes(tmp_path):
    """An incomplete store's attributes name its shards and store-level arrays: missing,
    not a mapping, or damaged, verify names the file and goes on with what it can read."""
    with pytest.raises(StoreError, match=r": no such store \(no files there\); check the path$"):
        verify_store(tmp_path / "nothing.zarr")
    root = half_written(tmp_path / "s.zarr")
    meta = json.loads((root / "zarr.json").read_text())
    meta["attributes"]["vse"].update(n_shards="2", extras={"mean": "crc32c:0"}, extras_files="mean")
    (root / "zarr.json").write_text(json.dumps(meta))
    assert verify_store(root) == ["shard 1: not committed (store incomplete)"]
    meta["attributes"]["vse"] = ["not", "a", "mapping"]
    (root / "zarr.json").write_text(json.dumps(meta))
    assert verify_store(root) == [
        "zarr.json: corrupt (TypeError: 'vse' attributes are not a mapping)",
        "shard 1: not committed (store incomplete)",
    ]
    (root / "zarr.json").unlink()
    assert verify_store(root) == ["zarr.json: missing", "shard 1: not committed (store incomplete)"]


def test_verify_names_a_complete_stores_missing_manifest_and_files_it_does_not_list(tmp_path):
    from features.store.layout import CHECKSUMS_CHUNK

    root = tmp_path / "whole.zarr"
    job.run(root, "regions", 10, 8)
    (root / ".shard_locks").mkdir()
    (root / ".shard_locks" / "0").write_text("pid 1")  # a writer's: never listed
    (root / "features" / "stray").write_text("x")
    assert verify_store(root) == ["features/stray: unexpected file (not in the checksum manifest)"]
    (root / CHECKSUMS_CHUNK).unlink()
    assert verify_store(root) == [
        f"{CHECKSUMS_CHUNK}: missing, though the store is marked complete; rebuild the store"
    ]


def test_ls_reports_a_damaged_store_and_goes_on(tmp_path, capsys):
    from flows.cli import main

    job.run(tmp_path / "a.zarr", "regions", 10, 8)
    job.run(tmp_path / "b.zarr", "tokens", 10, 8)
    (tmp_path / "a.zarr" / "zarr.json").write_bytes(b'{"attributes": {"vse": {"kin')
    assert main(["store", "ls", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "b.zarr" in out and "complete" in out
    assert "a.zarr" in out and "damaged" in out and "Traceback" not in out + err


def test_kill_at_any_write_resumes_or_restarts_to_the_same_store(tmp_path):
    """SIGKILL before each rename that puts a file in place (creation, shards,
    finalization, the move into place): a rerun ends with the uninterrupted store."""
    job.run(tmp_path / "clean.zarr", "regions", 10, 4)
    clean = files_of(tmp_path / "clean.zarr")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    args = [sys.executable, str(JOB), str(tmp_path / "count.zarr"), "regions", "10", "4"]
    done = subprocess.run(
        args, env={**env, "VSE_TEST_KILL_AT_WRITE": "-1"}, capture_output=True, text=True
    )
    writes = int(done.stdout.split("writes ")[-1])
    assert writes > 20
    points = range(writes)  # every one: creation, each shard's files, finalization
    each = [sys.executable, str(JOB), "--kill-each", str(tmp_path / "k"), "regions", "10", "4"]
    result = subprocess.run(
        [*each, ",".join(map(str, points))], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == [f"{k} killed 0" for k in points]
    for k in points:
        target = tmp_path / f"k{k}.zarr"
        assert files_of(target) == clean, k
        assert not incomplete_path(target).exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".k{k}.")] == []


def _naive(store, name, indices):
    """One sample at a time, through Zarr: what the vectorised gathers must equal."""
    group = zarr.open_group(store.url, mode="r")
    if not store.fields[name].ragged:
        return [group[name][i] for i in indices]
    starts = list(group[f"{name}_offsets"][:]) + [group[name].shape[0]]
    return [group[name][starts[i] : starts[i + 1]] for i in indices]


@pytest.mark.parametrize("in_memory", [True, False])
def test_vectorised_gathers_equal_one_sample_at_a_time(tmp_path, monkeypatch, in_memory):
    """Dense and ragged fields at arbitrary indices (repeats, across shard files, empty
    samples), from memory or from the mapped shard files, and after pickling (workers)."""
    import pickle

    import features.store.reader as store_module

    if not in_memory:  # every array from its shard files
        monkeypatch.setattr(store_module, "IN_MEMORY_BYTES", 0)
    job.run(tmp_path / "r.zarr", "regions", 37, 8)
    job.run(tmp_path / "t.zarr", "tokens", 37, 8)  # 0..8 rows per sample: some empty
    indices = [36, 0, 17, 17, 8, 35, 3, 24]
    regions = Store.open(tmp_path / "r.zarr")
    for name in ("features", "boxes", "n_regions", "image_hw"):
        got = regions.gather(name, indices)
        assert got.dtype == np.dtype(regions.fields[name].dtype)
        np.testing.assert_array_equal(got, np.stack(_naive(regions, name, indices)))
    tokens = pickle.loads(pickle.dumps(Store.open(tmp_path / "t.zarr")))
    expected = _naive(tokens, "features", indices)
    assert any(len(e) == 0 for e in _naive(tokens, "features", range(37)))
    padded, lengths = tokens.gather_ragged("features", indices)
    assert lengths.tolist() == [len(e) for e in expected]
    assert padded.shape == (len(indices), max(lengths), 16) and padded.dtype == np.float16
    for row, length, want in zip(padded, lengths, expected, strict=True):
        np.testing.assert_array_equal(row[:length], want)
        assert not row[length:].any()  # zero padding
    empty = [i for i in range(37) if len(_naive(tokens, "features", [i])[0]) == 0]
    padded, lengths = tokens.gather_ragged("features", empty[:2])
    assert padded.shape == (len(empty[:2]), 1, 16) and not padded.any() and not lengths.any()
    listed = tokens.read_indices(indices)["features"]
    for got, want in zip(listed, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    # into a caller's buffer (a batch arena)
    buffer = np.full(len(indices) * 6 * 16, 7, np.float16)
    got = regions.gather("features", indices, alloc=lambda s, d: buffer[: np.prod(s)].reshape(s))
    assert np.shares_memory(got, buffer)


def test_gathers_refuse_bad_indices_and_read_compressed_stores(tmp_path):
    job.run(tmp_path / "r.zarr", "regions", 20, 8)
    store = Store.open(tmp_path / "r.zarr")
    with pytest.raises(IndexError, match="index 20 out of range"):
        store.gather("features", [3, 20])
    with pytest.raises(StoreError, match="'features' is dense; use gather"):
        store.gather_ragged("features", [1])
    keys = [f"k{i}" for i in range(20)]
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4, compression="zstd")
    data = np.random.default_rng(0).standard_normal((20, 3, 5)).astype(np.float16)
    fields = {"f": job.regions_fields(3, 5)["features"], **job.ragged_fields(2, "r")}
    with StoreWriter(tmp_path / "z.zarr", "x", fields, keys, job.PROVENANCE, cfg) as w:
        for shard in w.pending_shards():
            start, stop = w.shard_range(shard)
            rows = [np.full((i % 3, 2), i) for i in range(start, stop)]
            w.write_shard(shard, {"f": data[start:stop], "r": rows})
    store = Store.open(tmp_path / "z.zarr")
    assert not store._mappable
    np.testing.assert_array_equal(store.gather("f", [19, 2, 9, 2]), data[[19, 2, 9, 2]])
    padded, lengths = store.gather_ragged("r", [5, 3, 19])
    assert lengths.tolist() == [2, 0, 1] and padded[0, :2].tolist() == [[5, 5], [5, 5]]


def test_uncompressed_shard_files_are_the_bytes_zarr_writes(tmp_path):
    """The writer lays out dense shard files and commit markers itself (no Zarr encoding
    on the write path); they must be what Zarr writes, partial last chunk and shard
    included."""
    import shutil

    job.run(tmp_path / "s.zarr", "regions", 37, 8)  # shards of 8, chunks of 4; 37 samples
    ours = files_of(tmp_path / "s.zarr")
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "z.zarr")
    group = zarr.open_group(tmp_path / "z.zarr", mode="r+")
    for shard in range(5):
        start, stop = shard * 8, min(shard * 8 + 8, 37)
        data = job.shard_data("regions", start, stop)
        with zarr.config.set({"array.write_empty_chunks": True}):
            for name, spec in job.regions_fields(6, 16).items():
                group[name][start:stop] = np.asarray(data[name], dtype=spec.dtype)
        group["_commits"][shard] = Store.open(tmp_path / "s.zarr").group["_commits"][shard]
    theirs = files_of(tmp_path / "z.zarr")
    assert all(ours[f"_commits/c.{k}"] == theirs[f"_commits/c.{k}"] for k in range(5))
    fields = job.regions_fields(6, 16)
    shards = [k for k in ours if "/c." in k and k.split("/")[0] in fields]
    assert len(shards) == 20
    for rel in shards:
        assert ours[rel] == theirs[rel], rel
    assert Store.open(tmp_path / "s.zarr").verify() == []


def test_ragged_shard_files_are_the_bytes_zarr_writes(tmp_path):
    """Ragged rows are appended shard by shard, into row shard files that each write
    rewrites (the rows so far, then the new ones): the bytes Zarr writes."""
    import shutil

    job.run(tmp_path / "s.zarr", "tokens", 37, 8)
    ours = files_of(tmp_path / "s.zarr")
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "z.zarr")
    group = zarr.open_group(tmp_path / "z.zarr", mode="r+")
    values, offsets = group["features"], group["features_offsets"]
    values.resize((0, 16))
    for shard in range(5):
        start, stop = shard * 8, min(shard * 8 + 8, 37)
        rows = [
            np.asarray(r, np.float16) for r in job.shard_data("tokens", start, stop)["features"]
        ]
        first = values.shape[0]
        with zarr.config.set({"array.write_empty_chunks": True}):
            offsets[start:stop] = first + np.cumsum([0] + [len(r) for r in rows[:-1]])
            if sum(len(r) for r in rows):
                values.resize((first + sum(len(r) for r in rows), 16))
                values[first:] = np.concatenate(rows)
    theirs = files_of(tmp_path / "z.zarr")
    data_files = [k for k in ours if k.startswith(("features/c.", "features_offsets/c."))]
    assert len(data_files) > 5
    for rel in data_files:
        assert ours[rel] == theirs[rel], rel
    assert Store.open(tmp_path / "s.zarr").verify() == []


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(f.read_bytes()).digest())
    return digest.hexdigest()


def test_stores_keep_the_bytes_they_were_first_written_with(tmp_path):
    """Every file of a regions, a ragged and a compressed store (with an extra) is what the
    writer produced before the codecs were pinned (digests recorded from that version):
    a change of Zarr's defaults or of the hand layout would change every store's bytes
    and every `dvc.lock` output, and fails here instead."""
    job.run(tmp_path / "r.zarr", "regions", 37, 8)
    job.run(tmp_path / "t.zarr", "tokens", 37, 8)
    fields = {"f": FieldSpec((3,), "float16"), "r": FieldSpec((2,), "float32", ragged=True)}
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4, compression="zstd")
    keys = [f"k{i}" for i in range(21)]
    with StoreWriter(tmp_path / "z.zarr", "x", fields, keys, job.PROVENANCE, cfg, log=len) as w:
        for shard in w.pending_shards():
            a, b = w.shard_range(shard)
            rows = [np.full((i % 3, 2), i) for i in range(a, b)]
            w.write_shard(shard, {"f": np.arange(a * 3, b * 3).reshape(-1, 3), "r": rows})
        w.write_extra("proj", np.arange(12.0).reshape(3, 4))
    assert _tree_digest(tmp_path / "r.zarr") == (
        "40740ab4ea2bc577d706852f511adb6b7fa28947225b5f94daf10c2491a0b735"
    )
    assert _tree_digest(tmp_path / "t.zarr") == (
        "5005946d7c5cbc96f44fdb3a77c13d5df8cb270511cd1142e71410ae1d005705"
    )
    assert _tree_digest(tmp_path / "z.zarr") == (
        "c7fda35acc4752ea023ffc948cdd9f14bb670556bc297339f0da4d622a5e172f"
    )
