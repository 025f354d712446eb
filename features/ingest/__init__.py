"""Ingestion: raw dataset annotations -> one validated, canonical manifest (parquet).

Readers turn each supported layout into :class:`Record` s:

- ``karpathy``: Karpathy split JSON (``dataset_flickr30k.json``, ``dataset_coco.json``):
  ``images[].filename``, ``filepath``, ``split`` (``restval`` merged into train by default,
  as VSE++ trains on "train + restval"), ``sentences[].raw``, ``imgid``.
- ``food101``: UPMC Food-101: class folders of images (``[split/]class/name.jpg``) and texts
  CSVs of ``image name, text, class`` named after their split (``train_titles.csv``); a
  seeded, hash-based part of train is held out as val, since the dataset has none.
- ``demo``: the synthetic demo dataset (:mod:`features.demo`), which is Karpathy JSON plus
  class labels, ground-truth boxes with names (the shapes) and, per box, its attributes
  (colour and size, from ``objects``): the boxes a detector trains on.

:func:`validate` checks every record and never aborts: problems go to an error list
(key, reason, detail) with counts, and :func:`error_fraction` lets the entry point fail
the run when too many records were bad. Optional fields (``label``, ``boxes``,
``box_names``) that are malformed drop their record as an error, never a crash; an image
path must stay inside the images root once symlinks are resolved (or lead into DVC's
cache), unless ``prepare.allow_symlinks_outside`` says otherwise.
"""
