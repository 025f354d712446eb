"""What a model is built with (:class:`DataInfo`, plain data kept in checkpoints), where its
features are (:class:`FeaturePaths`: local paths, or fsspec URLs for the stores) and which
inputs are floats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.config import UserError, one_line, require_extra
from infra.files import is_url

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
    """Where the stage's inputs are; every path comes from dvc.yaml via the CLI. A store may
    be an fsspec URL (``s3://bucket/regions.zarr``), kept as a ``str``."""

    manifest: Path
    global_: Path | str | None = None
    regions: Path | str | None = None
    grid: Path | str | None = None
    text: Path | str | None = None
    vocab: Path | None = None
    scenegraphs: Path | None = None  # folder: graphs.parquet and negatives.json


class DataError(UserError):
    """A missing or inconsistent input, named with what to do about it."""


def need_path(path: Path | str | None, flag: str, what: str) -> Path | str:
    """``path`` checked to exist: a local ``Path``, or an fsspec URL kept as its ``str``
    (``Path`` would fold ``s3://b/x`` into ``s3:/b/x``), reached with the credentials and
    endpoint of the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_ENDPOINT_URL`` for S3)."""
    if path is None:
        raise DataError(f"this model reads {what}: pass {flag} PATH")
    if not is_url(path):
        if not Path(path).exists():
            raise DataError(f"{path}: not found ({what}); run `dvc repro` to build it")
        return Path(path)
    url = str(path)
    if url.startswith(("s3://", "s3a://")):
        require_extra("s3fs", "s3", f"reading {url}")
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
        found = fs.exists(root)
    except Exception as err:  # noqa: BLE001 - credentials, endpoint, network: one line
        raise DataError(
            f"{url}: cannot be reached ({what}; {type(err).__name__}: {one_line(err)}); check "
            "the URL and AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL"
        ) from None
    if not found:
        raise DataError(
            f"{url}: not found ({what}); upload the store there (e.g. `aws s3 sync "
            f"data/features/NAME.zarr {url}`) or pass its local path"
        )
    return url


# batch key -> (store role, field) of the float inputs checked for NaN and infinities
FLOAT_INPUTS = {
    "image": ("global", "features"),
    "regions": ("regions", "features"),
    "grid": ("grid", "features"),
    "tokens": ("text", "features"),
    "document": ("text", "document"),
    "tfidf": ("text", "tfidf_values"),
}
