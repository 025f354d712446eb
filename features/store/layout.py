"""Names of a store's files and folders and the Zarr settings every array is created with:
the one place that knows where things lie inside a store (the store package's other
modules ask here)."""

from __future__ import annotations

from pathlib import Path

import zarr

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


def flat_keys() -> dict:
    return {"chunk_key_encoding": {"name": "default", "separator": SEPARATOR}}


def array_codecs(cfg: StoreConfig) -> dict:
    compressors = zarr.codecs.ZstdCodec(level=1) if cfg.compression == "zstd" else None
    return {"compressors": compressors}


def write_every_chunk():
    """Write chunks of zeros too, so each committed shard has a fixed set of files (the
    setting is not saved with an array, so it is set around every write)."""
    return zarr.config.set({"array.write_empty_chunks": True})


def incomplete_path(path: str | Path) -> Path:
    """Where the store ``path`` is built: ``<path>.incomplete``, moved to ``path`` once
    every shard is committed (so a store at its own path is always complete)."""
    path = Path(path)
    return path.with_name(path.name + INCOMPLETE)


def withdraw_store(path: str | Path) -> Path | None:
    """Take a complete store off its path after its stage failed (issue 25.4): it moves
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
