"""The finiteness checks that extractors, importers, evaluation and readers share."""

import numpy as np
import pytest
import torch

from infra.finite import NonFiniteError, check_finite, finite_rows, nonfinite_fields


def test_finite_rows_of_arrays_tensors_and_ragged_fields():
    array = np.ones((4, 3, 2), np.float16)
    array[2, 1, 0] = np.nan
    assert finite_rows(array).tolist() == [True, True, False, True]
    tensor = torch.ones(3, 5)
    tensor[0, 4] = -torch.inf
    assert finite_rows(tensor).tolist() == [False, True, True]
    ragged = [np.ones((2, 3)), np.zeros((0, 3)), np.array([[np.inf, 0, 0]])]
    assert finite_rows(ragged).tolist() == [True, True, False]
    assert finite_rows(np.arange(5)).all()  # integers are always finite


def test_fields_are_checked_as_stored():
    record = {"features": np.array([1e6, 0.0], np.float32), "ids": np.array([3])}
    assert nonfinite_fields(record) == []
    assert nonfinite_fields(record, {"features": "float16"}) == ["features"]


def test_check_finite_names_store_field_and_key():
    values = np.zeros((3, 4), np.float32)
    check_finite(values, "data/x.zarr", "features", ["a", "b", "c"])
    values[1, 2] = values[2, 0] = np.nan
    with pytest.raises(NonFiniteError) as err:
        check_finite(values, "data/x.zarr", "features", ["a", "b", "c"])
    message = str(err.value)
    assert message.startswith("data/x.zarr: field 'features' of 'b' holds NaN or infinite")
    assert "1 more" in message and "\n" not in message
