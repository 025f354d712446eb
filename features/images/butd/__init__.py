"""Bottom-up-attention Faster R-CNN (Anderson et al. 2018) in PyTorch: the model
(:mod:`.model`), the published checkpoints' key layouts (:mod:`.checkpoint`) and the
region records it fills (:mod:`.extractor`)."""
