"""The feature store: fingerprinted, crash-safe Zarr v3 groups, and the only code that knows
their on-disk layout (WebDataset shards are in :mod:`features.shards`).

A store is built in ``<store>.incomplete`` shard by shard (the shard's files, then its commit
marker, each by atomic rename), finalized with a checksum manifest of every file
(``_checksums``, written last) and moved to its path whole; a reader trusts committed shards
only. Writers ``flock`` ``<store>.incomplete/.lock``: one whole-store writer, or several
shard writers each holding its own shards' locks (``.shard_locks/<k>``, dense stores only).

Layout and integrity: ``docs/reference/store-format.md``; the design:
``docs/explanation/store-contract.md``.
"""
