"""The models by name. Each model file defines one model class with ``name``, ``Config``
(its ``models.<name>`` section of params.yaml, the paper's defaults) and ``inputs``.

Model files are imported when a model is asked for, so code that handles one model (a
``train@vsepp`` stage) runs, and depends on, that model's file only.
"""

from __future__ import annotations

import importlib
import re

from infra.config import Section

MODELS = {
    "vsepp": "models.vsepp:VSEPP",
    "mvvse": "models.mvvse:MVVSE",
    "camera": "models.camera:CAMERA",
    "huse": "models.huse:HUSE",
    "univse": "models.univse:UniVSE",
}
MODEL_NAMES = tuple(MODELS)
# batch key -> the image stores that may hold it, the default first (dvc.yaml passes the
# store as --<store>): a global vector is the grid's pooled PCA or Graph-RISE's embedding
STORES = {"image": ("global", "graph_rise"), "regions": ("regions",), "grid": ("grid",)}
DEFAULT_STORES = {"huse": "graph_rise"}  # HUSE reads the Graph-RISE embedding


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


def model_stores(name: str) -> tuple[str, ...]:
    """The image stores model ``name`` can read (``global``, ``graph_rise``, ``regions`` or
    ``grid``)."""
    (stores,) = {STORES[key] for key in model_class(name).inputs if key in STORES}
    return stores


def model_store(name: str) -> str:
    """The image store model ``name`` reads by default."""
    return DEFAULT_STORES.get(name) or model_stores(name)[0]


def check_enabled(enabled: dict[str, str]) -> dict[str, str]:
    """``models.enabled`` of params.yaml: the models the DAG trains, evaluates and reports
    (``train@``, ``evaluate@``, ``report``), each with the image store it reads."""
    if not enabled:
        raise ValueError(f"no model enabled; name at least one of {', '.join(MODEL_NAMES)}")
    for name, store in enabled.items():
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
        check_store(name, store)
    return enabled


def check_store(name: str, store: str, where: str = "") -> None:
    """That model ``name`` can read image store ``store``; else a ValueError (its message
    starting with ``where``)."""
    if store not in model_stores(name):
        known = " or ".join(model_stores(name))
        raise ValueError(f"{where}{name} reads the {known} store, not {store!r}")


class Ablation(Section):
    """One entry of ``models.ablations``: model ``model`` trained and evaluated again on
    image store ``store`` (stages ``train-ablation@<run>``, ``evaluate-ablation@<run>``),
    its results a row of the report beside the model's own, e.g. HUSE on the pooled trunk
    feature beside HUSE on the Graph-RISE embedding."""

    model: str
    store: str


RUN_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")  # a file and DVC stage name


def check_ablations(enabled: dict[str, str], ablations: dict[str, Ablation]) -> None:
    """``models.ablations``: each run named like a file, a model of ``models.enabled`` (the
    row it is compared with) on a store that model can read, not the one it reads there."""
    for run, a in ablations.items():
        where = f"ablations.{run}"
        if not RUN_NAME.fullmatch(run):
            raise ValueError(f"{where}: name a run with a-z, 0-9, '-' and '_' (e.g. huse-pooled)")
        if run in enabled:
            raise ValueError(f"{where}: {run} is a model of models.enabled; name the run apart")
        if a.model not in enabled:
            raise ValueError(
                f"{where}: {a.model} is not in models.enabled; add it or delete this run"
            )
        check_store(a.model, a.store, f"{where}: ")
        if a.store == enabled[a.model]:
            raise ValueError(f"{where}: {a.model} already reads {a.store} in models.enabled")
