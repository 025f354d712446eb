"""NaN and infinite values never pass silently: a NaN feature ranks *first* in retrieval
(it never compares greater), an infinite one drowns a mean.

Values are checked where they enter a store (the sample is stored empty with
``valid = 0`` and reported, like a bad image) and where they are consumed
(:func:`check_finite`), as stored: a float32 above 65504 is infinite in a float16 field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from infra.config import UserError

NON_FINITE = "non_finite"  # the reason code in error reports and commit-marker notes


class NonFiniteError(UserError):
    """An array holds NaN or infinite values where a number is needed."""


def _as_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, on any device
        values = values.detach().float().cpu().numpy() if values.is_floating_point() else 0
    return np.asarray(values)


def _all_finite(array: np.ndarray) -> bool:
    return array.dtype.kind not in "fc" or bool(np.isfinite(array).all())


def finite_rows(values: Any) -> np.ndarray:
    """``(N,)`` bool: whether row ``i`` of ``values`` (an ``(N, ...)`` array or tensor, or
    a list of N arrays: a ragged field) holds only finite numbers. Non-float rows are."""
    if isinstance(values, list | tuple):
        return np.array([_all_finite(_as_numpy(v)) for v in values], dtype=bool)
    array = _as_numpy(values)
    if array.dtype.kind not in "fc" or array.ndim == 0:
        return np.ones(len(array) if array.ndim else 1, dtype=bool)
    return np.isfinite(array.reshape(len(array), -1)).all(axis=1)


def nonfinite_fields(record: Mapping[str, Any], dtypes: Mapping[str, str] | None = None):
    """Names of the fields of one sample's ``record`` that hold NaN or infinite values,
    each checked as cast to its ``dtypes`` entry (the store's dtype) when given."""
    bad = []
    for name, value in record.items():
        array = _as_numpy(value)
        if dtypes and name in dtypes:
            with np.errstate(over="ignore", invalid="ignore"):
                array = array.astype(dtypes[name])
        if not _all_finite(array):
            bad.append(name)
    return bad


def check_finite(values: Any, url: str, field: str, keys: Sequence[str]) -> None:
    """Raise one line naming the store, the field and the first sample key whose row of
    ``values`` (rows aligned with ``keys``) holds NaN or infinite values."""
    finite = finite_rows(values)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    more = f" (and {len(bad) - 1} more of these {len(finite)} samples)" if len(bad) > 1 else ""
    raise NonFiniteError(
        f"{url}: field {field!r} of {keys[int(bad[0])]!r} holds NaN or infinite values{more}; "
        "the store is damaged or was made by a broken extractor: run `vse store verify`, "
        "then rebuild it (dvc repro)"
    )
