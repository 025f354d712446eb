"""The report: the comparison table, its plots and the retrieval gallery."""
