"""WebDataset shards: per-split training samples packed from the manifest and the stores,
for streaming training (many machines, object storage). The only code that knows the
shard layout (``docs/reference/shards-format.md``).

Each tar sample is a *group* of up to ``images_per_group`` images with all their captions:
``<key>.meta.json``, ``<key>.<store>.<field>.npy`` per image field and
``<key>.text.<field>[_offsets].npy`` per caption field. ``sizes.json``, written last,
records the inputs and every member's name, size and CRC-32C: a reader refuses shards
built from other inputs (:func:`check_sources`) or any member that is not the one built
(:mod:`features.shards.members`). Identical inputs give identical bytes.
"""
