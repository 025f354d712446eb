"""Language features: the text stage, text models, Sentence-BERT statistics."""
