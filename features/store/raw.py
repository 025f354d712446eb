"""Uncompressed shard files written directly in the layout of Zarr's sharding codec,
checksummed as they are written."""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c
import numpy as np

from features.store.integrity import readonly_view


def write_raw_shard(path: Path, array: np.ndarray, chunk: int, per_shard: int) -> str:
    """Write one uncompressed shard file (``per_shard`` rows in chunks of ``chunk``) as
    Zarr's sharding codec lays it out (the chunks along axis 0 back to back, then the
    index: (offset, nbytes) uint64 per chunk, absent ones all ones, and the index's
    CRC-32C), by atomic rename; returns its checksum. The same bytes Zarr writes (tested),
    without its per-chunk encoding, and checksummed as written rather than read back."""
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    present = -(-len(array) // chunk)
    chunk_bytes = chunk * array[0].nbytes if len(array) else 0
    index = np.full((per_shard // chunk, 2), np.iinfo(np.uint64).max, dtype="<u8")
    index[:present, 0] = np.arange(present, dtype=np.uint64) * chunk_bytes
    index[:present, 1] = chunk_bytes
    tail = index.tobytes()
    tail += google_crc32c.value(tail).to_bytes(4, "little")
    padding = bytes(present * chunk_bytes - array.nbytes)  # the last chunk's fill
    crc = google_crc32c.value(readonly_view(array))
    crc = google_crc32c.extend(google_crc32c.extend(crc, padding), tail)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(tmp, "wb") as f:
        array.tofile(f)
        f.write(padding)
        f.write(tail)
    os.replace(tmp, path)
    return f"crc32c:{crc:08x}"
