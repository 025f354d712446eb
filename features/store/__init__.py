"""The feature store: fingerprinted, crash-safe Zarr v3 groups. The only code that knows
their on-disk layout (WebDataset shards are in :mod:`features.shards`).

Layout of a store (a Zarr v3 group, readable with plain ``zarr.open_group``)::

    regions.zarr/
      zarr.json          group attributes under "vse": schema version, kind, fingerprint,
                         inputs (extractor, version, params, weights and manifest digests),
                         fields, layout; counts once complete (nothing that depends on
                         when or where it was written: same inputs, same bytes)
      keys/              (N,) str      sample keys (image keys, or caption keys `<image>#<i>`)
      <field>/           (N, ...)      a dense field, e.g. regions: features (N,R,D) f16,
                                       boxes (N,R,4) f32, n_regions (N,), image_hw (N,2)
      <field>/ + <field>_offsets/      a ragged field: rows of all samples back to back
                                       (rows, ...) and the row where each sample starts (N,)
      _commits/          (n_shards,) str, one file per shard: the commit marker of shard k,
                         JSON with its sample range, ragged row range and file checksums
      _checksums/        (1,) str, uncompressed: written last when the store is finalized,
                         the CRC-32C of every other file of the store (root and array
                         metadata, keys, markers, chunks), with a SHA-256 of the listing

Dense fields are chunked along the sample axis (``samples_per_chunk``) inside Zarr shards
of ``samples_per_shard`` samples (the sharding codec: few, large files, since DVC hashes
every file of a directory output). The writer commits whole shards: it writes the data,
then the marker, each file by atomic rename (Zarr's local store writes a temp file and
renames it). A reader trusts only committed shards, so it never sees a half-written one; a
rerun after a crash rewrites every uncommitted shard and ends bitwise identical to an
uninterrupted run.

A store is built in ``<store>.incomplete`` and moved to its own path when its last
shard is committed, so a store at its path is always complete (and a DVC output is never
partial: no stage needs ``persist``). Writers lock ``<store>.incomplete/.lock`` with
``flock``. A whole-store writer (the default) holds it exclusively: it alone creates,
resumes, starts over and finalizes the store. A store of dense fields only can also be
filled by several processes at once (e.g. Dask workers), each a *shard writer*
(``ShardWriter(..., shards=[...])``): distinct shards are distinct files, so shard writers
share ``.lock`` and each holds an exclusive lock per shard (``.shard_locks/<k>``), commits
its own shards and never finalizes; a whole-store writer opened afterwards finalizes the
store, sweeps the lock files and moves it into place.

Integrity: every file is covered by a checksum. A shard's files are hashed into its commit
marker when it is committed; at finalization the checksum manifest (``_checksums``) lists
every file of the store (the markers' checksums for chunks, freshly computed ones for the
metadata, keys and markers). The manifest is self-checking: it is canonical JSON holding
a digest of its own listing, stored as one uncompressed string, so any changed or missing
byte of it shows. :func:`verify_store` checks a store file by file and never needs its
metadata to be readable.
"""
