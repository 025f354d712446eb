"""WebDataset shards: per-split training samples packed from the manifest and the stores,
for streaming training (many machines, object storage). The only code that knows the
shard layout.

A shard is a standard tar file (``{split}-{index:06d}.tar``, any WebDataset reader opens
it); each WebDataset sample in it is a *group* of up to ``images_per_group`` consecutive
images of the split (few, large members: tar parsing is per member, so the per-image
cost of streaming is that of copying bytes) with all their captions::

    <key>.meta.json                  {"keys", "index" (split positions), "labels",
                                      "captions", "boxes", "box_names"} per image, and
                                      "scene_graphs" per caption when packed
    <key>.<store>.<field>.npy        each field of each packed image store, (G, ...)
    <key>.text.<field>.npy           a caption-level text store field: dense (C, ...),
    <key>.text.<field>_offsets.npy   or ragged: the captions' rows back to back and where
                                     each caption starts (C + 1,)

Arrays are ``.npy`` members (``np.load`` reads them). ``sizes.json`` records what the
shards were built from (manifest digest, each packed store's kind, fingerprint and
fields, the scene graphs' digest) and, per shard, its split, counts of images,
captions and groups, its bytes and every member's name, size and CRC-32C in tar order: a
reader refuses shards built from other inputs (:func:`check_sources`) and any member that
is not the one built (:mod:`features.shards.members`: damaged data, a damaged header, a
cut or missing tar, each one line naming the shard and member); shards of format 2 (no
members recorded) are refused in one line that says to rebuild them. Identical inputs
give identical bytes (fixed tar headers).

Reading (:func:`read_groups`) locates members with the stdlib's ``tarfile`` and decodes
them with numpy: a local shard is memory-mapped, so a group's arrays are views of the page cache
(no copy until a batch is gathered); an ``s3://`` (any fsspec URL) shard is read
sequentially. :class:`GroupColumns` gathers batch rows from a buffer of groups with the
same vectorised gathers as the stores (``gather``, ``gather_ragged``), so training builds
a batch from shards with the code that builds it from stores.
"""
