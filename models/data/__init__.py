"""Training and evaluation batches from the feature stores.

Every model reads the same kind of batch: a dict of tensors whose keys depend on what the
model declares in ``inputs``. Image-side keys are indexed by image, text-side keys by
caption; a training batch pairs caption ``c`` with its image, so row ``b`` of both sides is
a positive pair.

Image side::

    image            (B, Di)        global CNN feature (global store)
    regions          (B, R, Dr)     region features, zero-padded (regions store)
    region_lengths   (B,)           valid regions
    boxes            (B, R, 4)      x1, y1, x2, y2 divided by the image width/height
    grid             (B, G, Dg)     grid features, G = rows * cols (grid store)
    labels           (B,)           class id (manifest), also given with the text side

Text side::

    words, word_lengths        (B, L), (B,)       <start> w1 .. wn <end> vocabulary ids
    tokens, token_lengths      (B, T, Dt), (B,)   frozen BERT token features
    document                   (B, Dd)            HUSE document feature
    tfidf                      (B, V)             dense TF-IDF vector
    objects, attributes, relations                (B, N, W) word ids of each scene-graph
                                                  component's phrase (0-padded), with
    object_mask, attribute_mask, relation_mask    (B, N)
    attribute_objects                             (B, N) index of the modified object
    relation_subjects, relation_objects           (B, N) object indices
    text_labels                (B,)               class id of the caption's image

A source (:class:`PairData`: the stores, memory-mapped; :class:`ShardData`: WebDataset
shards built from them) *builds* a raw batch in the stored dtypes, one vectorised gather
per field, into memory the caller provides; :func:`finish` makes it what the models read
(float32, standardised, on the device), once, on the GPU when there is one.
"""
