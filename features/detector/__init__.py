"""The bottom-up detector: model, weights people have, training data, training and metrics."""
