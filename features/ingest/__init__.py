"""Ingestion: raw dataset annotations -> one validated, canonical manifest (parquet).

Readers (:mod:`features.ingest.readers`: Karpathy split JSON, Flickr8k, UPMC Food-101, the
demo) turn each layout into :class:`Record` s; :func:`validate` checks every record and
never aborts: problems go to an error list (key, reason, detail) with counts, and the stage
fails when too many records were bad (``docs/reference/manifest.md``).
"""
