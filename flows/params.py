"""``params.yaml``: the project's only config file, validated as a whole before any work.

:data:`SECTIONS` names the typed model of each section; :func:`params_model` composes them
into one model. Unknown keys and wrong types fail with the full key path, e.g.
``params.yaml: prepare.max_eror_fraction: unknown key, did you mean max_error_fraction``.

Sections are named by import path, not imported here: a stage's code deps in ``dvc.yaml``
are the modules its command imports, and those of the sections it does not read cannot
change its outputs (``tools/dag_deps.py`` adds the modules of the sections it reads).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, Field, ValidationError, create_model, model_validator

from infra.config import ConfigError, Section, format_errors

MODELS = "models.registry"  # section `models`: one section per model, models.<name>


class ModelsSection(Section):
    """Base of section ``models``: checks ``ablations`` against ``enabled``."""

    @model_validator(mode="after")
    def _ablations_of_enabled(self):
        importlib.import_module(MODELS).check_ablations(self.enabled, self.ablations)
        return self


# Section -> its typed model, "module:Class" (imported only to validate), and the stages
# that read it; ``models`` is the model registry's (one section per model).
SECTIONS = {
    "demo": "features.demo:DemoConfig",  # demo_data
    "evaluate": "models.evaluate:EvaluateConfig",  # evaluate@
    "adversarial": "features.scenegraph.adversarial:AdversarialConfig",  # adversarial
    "global": "features.images.global_features:GlobalConfig",  # global
    "grid": "features.images.config:GridConfig",  # grid
    "regions": "features.images.config:RegionsConfig",  # regions
    "scenegraph": "features.scenegraph.stage:ScenegraphConfig",  # scenegraph
    "text": "features.text.stage:TextConfig",  # text
    "prepare": "features.ingest.readers:PrepareConfig",  # prepare
    "shards": "features.shards.writer:ShardsConfig",  # shards
    "sbert": "features.text.sbert_stats:SbertConfig",  # sbert_stats, train@huse
    "store": "features.store.spec:StoreConfig",  # every stage that writes a store
    "train": "models.common:TrainConfig",  # train@
    "models": MODELS,  # train@, evaluate@, report
    "detector": "features.detector.config:DetectorConfig",  # detector
    "graph_rise": "features.images.graph_rise.stage:GraphRiseConfig",  # graph_rise
}


def section_class(name: str) -> type[Section]:
    """The typed model of section ``name``; ``models`` holds one section per model and
    ``enabled``, the models of the DAG (model -> the image store it reads), and
    ``ablations``, more runs of them on other stores (run -> model and store)."""
    if name == "models":
        registry = importlib.import_module(MODELS)
        model_class = registry.model_class
        every = {m: registry.model_store(m) for m in registry.MODEL_NAMES}
        enabled = Annotated[dict[str, str], AfterValidator(registry.check_enabled)]
        fields: dict[str, Any] = {"enabled": (enabled, Field(default_factory=lambda: dict(every)))}
        fields["ablations"] = (dict[str, registry.Ablation], Field(default_factory=dict))
        fields |= {
            m: (model_class(m).Config, Field(default_factory=model_class(m).Config))
            for m in registry.MODEL_NAMES
        }
        return create_model("ModelsConfig", __base__=ModelsSection, **fields)
    module, _, cls = SECTIONS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def section_module(key: str) -> str:
    """The module that defines the section of params key ``key``: ``text`` ->
    ``features.text``, ``models.vsepp`` -> ``models.vsepp`` (each model's own file),
    ``models.enabled`` -> the registry."""
    name, _, sub = key.partition(".")
    if name == "models":
        registry = importlib.import_module(MODELS)
        return registry.model_module(sub) if sub in registry.MODELS else MODELS
    return SECTIONS[name].partition(":")[0]


@functools.cache
def params_model() -> type[Section]:
    """All sections of params.yaml as one model; a missing section takes its defaults.
    Attribute names are the section names (``global`` is ``global_``)."""
    fields: dict[str, Any] = {}
    for name in SECTIONS:
        cls = section_class(name)
        attr = f"{name}_" if name == "global" else name
        fields[attr] = (cls, Field(default_factory=cls, alias=name))
    return create_model("Params", __base__=Section, **fields)


def load_params(path: str | Path = "params.yaml"):
    """Read and validate ``path``; every problem is reported at once, by key path."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: not found; run from the repository root or pass --params FILE"
        ) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); re-save it") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    model = params_model()
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, model, str(path))) from None
