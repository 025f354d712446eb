"""The one place that lays out Zarr's formats by hand, where that is faster than Zarr's API
(``benchmarks/store_write.py`` and ``store_read.py`` time both): uncompressed dense shard
files written and checksummed in one pass, commit markers encoded without an array
round trip, and shard files read back as memory-mapped views. The codecs are those
:mod:`features.store.layout` pins for these arrays; tests check the bytes against Zarr's."""

from __future__ import annotations

from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np

from features.store.integrity import readonly_view
from features.store.layout import STRINGS_LEVEL
from infra.files import atomic_path

NO_CHUNK = np.iinfo(np.uint64).max  # index entry of an absent chunk: (offset, nbytes)


def write_raw_shard(path: Path, pieces: list[np.ndarray], chunk: int, per_shard: int) -> str:
    """Write one uncompressed shard file (``per_shard`` rows in chunks of ``chunk``) of the
    rows of ``pieces`` laid end to end (no copy joins them), as Zarr's sharding codec lays
    it out (``layout.field_codecs``: the chunks along axis 0 back to back, little-endian,
    then the index: (offset, nbytes) uint64 per chunk, absent ones all ones, and the
    index's CRC-32C), atomically; returns its checksum, computed as written rather than
    read back."""
    pieces = [np.ascontiguousarray(p, dtype=p.dtype.newbyteorder("<")) for p in pieces]
    rows = sum(len(p) for p in pieces)
    present = -(-rows // chunk)
    chunk_bytes = chunk * pieces[0].itemsize * int(np.prod(pieces[0].shape[1:], dtype=np.int64))
    index = np.full((per_shard // chunk, 2), NO_CHUNK, dtype="<u8")
    index[:present, 0] = np.arange(present, dtype=np.uint64) * chunk_bytes
    index[:present, 1] = chunk_bytes
    tail = index.tobytes()
    tail += google_crc32c.value(tail).to_bytes(4, "little")
    padding = bytes(present * chunk_bytes - sum(p.nbytes for p in pieces))  # last chunk's fill
    crc = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for piece in pieces:
            piece.tofile(f)
            crc = google_crc32c.extend(crc, readonly_view(piece))
        f.write(padding)
        f.write(tail)
    crc = google_crc32c.extend(google_crc32c.extend(crc, padding), tail)
    return f"crc32c:{crc:08x}"


def write_marker(path: Path, text: str) -> None:
    """A commit marker: the chunk Zarr writes for ``commits[k] = text`` (``layout.STRINGS``:
    vlen-utf8, then Zstd), atomically."""
    data = numcodecs.Zstd(level=STRINGS_LEVEL).encode(
        numcodecs.VLenUTF8().encode(np.array([text], dtype=object))
    )
    with atomic_path(path) as tmp:
        tmp.write_bytes(bytes(data))


def shard_index(data: np.ndarray, n_chunks: int) -> np.ndarray:
    """(n_chunks, 2) (offset, nbytes) of each chunk of a mapped shard file: the sharding
    codec's index at the file's end, before its CRC-32C."""
    return data[-(16 * n_chunks + 4) : -4].view("<u8").reshape(n_chunks, 2)


def contiguous_rows(
    data: np.ndarray, index: np.ndarray, rows: int, chunk_rows: int, row_shape, dtype
) -> np.ndarray | None:
    """The first ``rows`` rows of a mapped shard file as one read-only view, if its chunks
    lie back to back in order from offset 0 (what :func:`write_raw_shard` and Zarr write
    for uncompressed chunks); None otherwise (read it through Zarr)."""
    n = -(-rows // chunk_rows)
    chunk_bytes = chunk_rows * int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    expected = np.stack([np.arange(n) * chunk_bytes, np.full(n, chunk_bytes)], 1)
    if not np.array_equal(index[:n], expected):
        return None
    view = data[: n * chunk_bytes].view(np.ndarray).view(dtype)
    return view.reshape(n * chunk_rows, *row_shape)
