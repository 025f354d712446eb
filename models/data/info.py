"""What a model is built with (:class:`DataInfo`, plain data kept in checkpoints), where its
features are (:class:`FeaturePaths`) and which inputs are floats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.config import UserError

STATS_BLOCK = 128  # images read at a time for the feature statistics


@dataclass(frozen=True)
class DataInfo:
    """Sizes of the inputs a model is built for (0 where the model does not use one)."""

    image_dim: int = 0
    region_dim: int = 0
    grid_dim: int = 0
    token_dim: int = 0
    document_dim: int = 0
    vocab_size: int = 0
    tfidf_dim: int = 0
    n_classes: int = 0
    # HUSE's semantic graph A[c, c']: cosine distance between class-name embeddings
    class_distances: list[list[float]] | None = None
    # UniVSE's negative-sampling vocabularies as word-id phrases: nouns, adjectives, relations
    negatives: dict[str, list[list[int]]] = field(default_factory=dict)
    # per-dimension [mean, std] of image inputs over train images, when standardised
    feature_stats: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FeaturePaths:
    """Where the stage's inputs are; every path comes from dvc.yaml via the CLI."""

    manifest: Path
    global_: Path | None = None
    regions: Path | None = None
    grid: Path | None = None
    text: Path | None = None
    vocab: Path | None = None
    scenegraphs: Path | None = None  # folder: graphs.parquet and negatives.json


class DataError(UserError):
    """A missing or inconsistent input, named with what to do about it."""


def need_path(path: Path | None, flag: str, what: str) -> Path:
    if path is None:
        raise DataError(f"this model reads {what}: pass {flag} PATH")
    if not Path(path).exists() and "://" not in str(path):
        raise DataError(f"{path}: not found ({what}); run `dvc repro` to build it")
    return Path(path)


# batch key -> (store role, field) of the float inputs checked for NaN and infinities
FLOAT_INPUTS = {
    "image": ("global", "features"),
    "regions": ("regions", "features"),
    "grid": ("grid", "features"),
    "tokens": ("text", "features"),
    "document": ("text", "document"),
    "tfidf": ("text", "tfidf_values"),
}
