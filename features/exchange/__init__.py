"""Feature files people already have: SCAN/VSE++ precomp folders and bottom-up-attention
TSVs, in and out."""
