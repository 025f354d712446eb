"""Names of a store's files and folders and the Zarr settings every array is created with:
the one place that knows where things lie inside a store (the store package's other
modules ask here)."""

from __future__ import annotations

from pathlib import Path

import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, VLenUTF8Codec, ZstdCodec

from features.store.spec import StoreConfig

COMMITS = "_commits"


CHECKSUMS = "_checksums"  # the checksum manifest, written last at finalization


CHECKSUMS_CHUNK = f"{CHECKSUMS}/c/0"


LOCK = ".lock"


SHARD_LOCKS = ".shard_locks"  # one lock file per shard held by a shard writer


INCOMPLETE = ".incomplete"  # suffix of the folder a store is built in


SEPARATOR = "."  # chunk keys c.<k>.0.0: one file per shard, no directory per shard


def chunk_key(field_name: str, index: int, ndim: int, separator: str = SEPARATOR) -> str:
    """Path of Zarr shard ``index`` (along axis 0) of an array, relative to the group:
    ``name/c.<index>.0..`` (stores made before the flat keys: ``name/c/<index>/0/..``)."""
    return f"{field_name}/" + separator.join(["c", str(index)] + ["0"] * (ndim - 1))


FLAT_KEYS = {"chunk_key_encoding": {"name": "default", "separator": SEPARATOR}}


# Every codec of every array, pinned (none left to Zarr's defaults, which may change): the
# values are those the stores were first written with, so their bytes stay the same.
LITTLE = BytesCodec(endian="little")


STRINGS_LEVEL = 0  # Zstd level of the keys and commit markers (raw.encode_marker)


STRINGS = {"serializer": VLenUTF8Codec(), "compressors": ZstdCodec(level=STRINGS_LEVEL)}


MANIFEST = {"serializer": VLenUTF8Codec(), "compressors": None}  # the checksum manifest


EXTRAS = {"serializer": LITTLE, "compressors": ZstdCodec(level=0)}  # store-level arrays


def field_codecs(cfg: StoreConfig, chunk_shape: tuple[int, ...]) -> dict:
    """A field's codecs: Zarr's sharding codec (chunks of ``chunk_shape`` in a shard file,
    little-endian, Zstd level 1 if compressed; the index at the end with its CRC-32C),
    with the array's ``chunks`` set to the shard shape."""
    inner = [LITTLE] + ([ZstdCodec(level=1)] if cfg.compression == "zstd" else [])
    sharding = ShardingCodec(
        chunk_shape=chunk_shape,
        codecs=inner,
        index_codecs=[LITTLE, Crc32cCodec()],
        index_location="end",
    )
    return {"serializer": sharding, "compressors": None, "filters": None}


def write_every_chunk():
    """Write chunks of zeros too, so each committed shard has a fixed set of files (the
    setting is not saved with an array, so it is set around every write)."""
    return zarr.config.set({"array.write_empty_chunks": True})


def is_temp(name: str) -> bool:
    """Whether a file name is a writer's temporary file (``infra.files.atomic_path``'s
    ``.<name>.<pid>.<random>.tmp``, or ``<name>.<pid>.partial`` of older writers)."""
    return name.endswith(".partial") or (name.startswith(".") and name.endswith(".tmp"))


def incomplete_path(path: str | Path) -> Path:
    """Where the store ``path`` is built: ``<path>.incomplete``, moved to ``path`` once
    every shard is committed (so a store at its own path is always complete)."""
    path = Path(path)
    return path.with_name(path.name + INCOMPLETE)


def withdraw_store(path: str | Path) -> Path | None:
    """Take a complete store off its path after its stage failed: it moves
    back to ``<path>.incomplete``, the writer's own folder, so nothing is published at
    ``path``, and a rerun with the same inputs resumes from its committed shards (others
    start it over). Returns where it went, or None if ``path`` held no store."""
    from infra.files import replace_dir

    path = Path(path)
    if not (path / "zarr.json").is_file():
        return None
    aside = incomplete_path(path)
    replace_dir(path, aside)
    return aside
