"""A Graph-RISE-style image embedding (Juan et al. 2019, "Graph-RISE: Graph-Regularized
Image Semantic Embedding"), trained at small scale on the pipeline's own outputs: labels
from the captions' scene graphs (:mod:`.labels`), a caption-similarity kNN graph
(:mod:`.graph`), the 64-d head and its losses (:mod:`.model`) and stage ``graph_rise``
(:mod:`.stage`). Not Google's model: no 40M-label vocabulary, no billion-image graph, no
fine-tuned trunk.
"""
