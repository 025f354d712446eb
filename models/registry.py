"""The models by name. Each model file defines one model class with ``name``, ``Config``
(its ``models.<name>`` section of params.yaml, the paper's defaults) and ``inputs``.

Model files are imported when a model is asked for, so code that handles one model (a
``train@vsepp`` stage) runs, and depends on, that model's file only.
"""

from __future__ import annotations

import importlib

from infra.config import Section

MODELS = {
    "vsepp": "models.vsepp:VSEPP",
    "mvvse": "models.mvvse:MVVSE",
    "camera": "models.camera:CAMERA",
    "huse": "models.huse:HUSE",
    "univse": "models.univse:UniVSE",
}
MODEL_NAMES = tuple(MODELS)


def model_module(name: str) -> str:
    """The module of model ``name``, e.g. ``models.vsepp``."""
    return MODELS[name].partition(":")[0]


def model_class(name: str) -> type:
    """The class of model ``name`` (its module imported on first use)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    module, _, cls = MODELS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def model_inputs(name: str, cfg: Section) -> frozenset[str]:
    """The batch keys model ``name`` reads with its validated config (``models.<name>``):
    a class attribute ``inputs``, or ``inputs_for(cfg)`` where they depend on the config."""
    cls = model_class(name)
    if hasattr(cls, "inputs_for"):
        return frozenset(cls.inputs_for(cfg))
    return frozenset(cls.inputs)
