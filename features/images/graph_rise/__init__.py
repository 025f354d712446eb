"""A Graph-RISE-style image embedding (Juan et al. 2019, "Graph-RISE: Graph-Regularized
Image Semantic Embedding"), trained at small scale on the pipeline's own outputs.

- :mod:`.labels`: fine-grained labels per image mined from its captions' scene graphs
  (objects, attribute-object phrases, relation triples) above a frequency floor.
- :mod:`.graph`: the image-image kNN graph over the train split from caption
  Sentence-BERT similarity, stored as ``src, dst, weight`` parquet.
- :mod:`.model`: the head (64-d, L2-normalised) on the pooled trunk feature, its
  multi-label softmax loss and the Neural Graph Machines regulariser.
- :mod:`.stage`: stage ``graph_rise``: trains, evaluates (kNN label precision@10) and
  writes a ``global``-kind store that HUSE reads.

Not Google's model: no 40M-label vocabulary, no billion-image graph, no fine-tuned trunk.
"""
