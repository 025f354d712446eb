"""``params.yaml``: the project's only config file, validated as a whole before any work.

Each stage owns its section's typed model (next to the code that uses it); this module
composes them. Unknown keys and wrong types fail with the full key path, e.g.
``params.yaml: prepare.max_eror_fraction: unknown key, did you mean max_error_fraction``.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from features.adversarial import AdversarialConfig
from features.config import ConfigError, Section, format_errors
from features.demo import DemoConfig
from features.demo_parser import ParserConfig
from features.ingest import PrepareConfig
from features.sbert_stats import SbertConfig
from features.scenegraph import ScenegraphConfig
from features.shards import ShardsConfig
from features.store import StoreConfig
from features.text import TextConfig
from features.visual_config import DetectorConfig, GlobalConfig, GridConfig, RegionsConfig
from models import ModelsConfig
from models.common import TrainConfig
from models.evaluate import EvaluateConfig


class Params(Section):
    """All sections of params.yaml; a missing section takes its defaults."""

    demo: DemoConfig = DemoConfig()
    prepare: PrepareConfig = PrepareConfig()
    store: StoreConfig = StoreConfig()
    shards: ShardsConfig = ShardsConfig()
    detector: DetectorConfig = DetectorConfig()
    regions: RegionsConfig = RegionsConfig()
    grid: GridConfig = GridConfig()
    global_: GlobalConfig = Field(GlobalConfig(), alias="global")
    sbert: SbertConfig = SbertConfig()
    text: TextConfig = TextConfig()
    parser: ParserConfig = ParserConfig()
    scenegraph: ScenegraphConfig = ScenegraphConfig()
    adversarial: AdversarialConfig = AdversarialConfig()
    train: TrainConfig = TrainConfig()
    models: ModelsConfig = ModelsConfig()
    evaluate: EvaluateConfig = EvaluateConfig()


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``path``; every problem is reported at once, by key path."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: not found; run from the repository root or pass --params FILE"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    try:
        return Params.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, Params, str(path))) from None
