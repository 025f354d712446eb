"""What the image extractors share: the store fields they fill, the params and version that
enter the fingerprint, and the checks on the weights they load."""

from __future__ import annotations

import warnings

import numpy as np

from features.detector.weights import WeightsError
from features.images.config import ExtractConfig
from features.store.spec import FieldSpec

DEFAULT_TRUNK = "resnet152"  # VSE++, UniVSE


# Part of every store fingerprint: bump it with any change that alters extracted features,
# or a persisted store made by the old code is kept (its fingerprint still matches).
EXTRACTOR_VERSION = "2"  # 2: exact BUTD selection (classes of unsurvived proposals)


def zeros(fields: dict[str, FieldSpec]) -> dict[str, np.ndarray]:
    return {name: np.zeros(spec.shape, dtype=spec.dtype) for name, spec in fields.items()}


def feature_params(cfg: ExtractConfig) -> dict:
    """The params that change the features, for the fingerprint (the weights enter as their
    digest; batch size, workers, device and error threshold do not change a feature)."""
    return cfg.model_dump(
        exclude={"batch_size", "num_workers", "device", "weights", "max_error_fraction"}
    )


def check_conflict(param: str, given, found, source: str) -> None:
    if given is not None and given != found:
        raise WeightsError(
            f"{param} is {given!r} but {source} says {found!r}; remove the param (it is "
            "taken from the checkpoint) or give a checkpoint that matches"
        )


def warn_random_init(what: str, seed: int) -> None:
    warnings.warn(
        f"{what}: NO WEIGHTS GIVEN, using RANDOM initialisation (seed {seed}). Features "
        "are only useful for testing the pipeline; set `weights:` to a local checkpoint "
        "for real runs. The store's fingerprint records the random init.",
        stacklevel=3,
    )
