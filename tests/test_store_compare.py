"""``vse store compare``: the largest absolute and relative difference per field of two
stores, and whether every value is within a tolerance."""

import json

import numpy as np
import pytest

from features.store.compare import compare_stores
from features.store.reader import Store
from features.store.spec import FieldSpec, Provenance, StoreConfig, StoreError
from features.store.writer import StoreWriter
from flows.cli import main

LAYOUT = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
N = 19  # three shards, the last one short


def make(path, change=None, keys=None, extra=None, fields=None):
    """A global-kind store of ``N`` samples: ``features`` (N, 6) float16, ``boxes``
    ragged float32 rows, ``valid`` uint8; ``change(data)`` edits the values first."""
    rng = np.random.default_rng(0)
    data = {
        "features": rng.standard_normal((N, 6)).astype(np.float16),
        "boxes": [rng.random((i % 3, 4)).astype(np.float32) * 100 for i in range(N)],
        "valid": np.ones(N, np.uint8),
    }
    if change:
        change(data)
    specs = fields or {
        "features": FieldSpec((6,), "float16"),
        "boxes": FieldSpec((4,), "float32", ragged=True),
        "valid": FieldSpec((), "uint8"),
    }
    keys = keys or [f"img{i:03d}" for i in range(N)]
    provenance = Provenance("test", "1", {}, None, "m" * 64)
    with StoreWriter(path, "global", specs, keys, provenance, LAYOUT, log=lambda m: None) as w:
        if extra is not None:
            w.write_extra("axes", extra)
        for shard in w.pending_shards():
            lo, hi = w.shard_range(shard)
            w.write_shard(shard, {k: v[lo:hi] for k, v in data.items() if k in specs})
    return Store.open(path)


def by_name(diffs):
    return {d.name: d for d in diffs}


def test_a_store_against_its_copy_is_identical(tmp_path):
    a = make(tmp_path / "a.zarr", extra=np.eye(3, dtype=np.float32))
    b = make(tmp_path / "b.zarr", extra=np.eye(3, dtype=np.float32))
    diffs = by_name(compare_stores(a, b))
    assert set(diffs) == {"features", "boxes", "valid", "extra:axes"}
    assert all(d.identical and d.within and d.max_abs == 0 for d in diffs.values())
    assert diffs["features"].values == N * 6 and diffs["extra:axes"].values == 9
    assert diffs["boxes"].values == 4 * sum(i % 3 for i in range(N))


def test_differences_are_measured_against_a_loop_over_the_values(tmp_path):
    rng = np.random.default_rng(5)
    noise = rng.standard_normal((N, 6)) * 1e-3

    def nudge(data):
        data["features"] = (data["features"] + noise).astype(np.float16)
        data["boxes"][4] = data["boxes"][4] + np.float32(0.5)  # sample 4: one row
        data["valid"][17] = 0  # in the last, short shard

    a, b = make(tmp_path / "a.zarr", nudge), make(tmp_path / "b.zarr")
    diffs = by_name(compare_stores(a, b))
    x = a.read(0, N)["features"].astype(np.float64)
    y = b.read(0, N)["features"].astype(np.float64)
    loop_abs = max(abs(p - q) for p, q in zip(x.ravel(), y.ravel(), strict=True))
    loop_rel = max(abs(p - q) / abs(q) for p, q in zip(x.ravel(), y.ravel(), strict=True))
    features = diffs["features"]
    assert features.max_abs == loop_abs and features.max_rel == loop_rel
    assert features.differing == int((x != y).sum()) > 0 and not features.within
    assert diffs["boxes"].differing == 4 and diffs["boxes"].max_abs == pytest.approx(0.5)
    assert diffs["valid"].differing == 1 and diffs["valid"].max_rel == 1.0  # |0 - 1| / 1
    assert by_name(compare_stores(b, a))["valid"].max_rel == np.inf  # |1 - 0| / 0
    within = by_name(compare_stores(a, b, atol=loop_abs))
    assert within["features"].within and within["boxes"].within is False
    relative = by_name(compare_stores(a, b, rtol=loop_rel))
    assert relative["features"].within


def test_nan_equals_nan_and_a_number_against_nan_is_infinitely_far(tmp_path):
    def nan_at(i):
        def change(data):
            data["features"][i, 0] = np.nan

        return change

    same = compare_stores(
        make(tmp_path / "a.zarr", nan_at(2)), make(tmp_path / "b.zarr", nan_at(2))
    )
    assert by_name(same)["features"].identical
    other = by_name(compare_stores(make(tmp_path / "c.zarr"), Store.open(tmp_path / "b.zarr")))
    assert other["features"].max_abs == np.inf and not other["features"].within


def test_stores_that_do_not_pair_up_are_one_line_errors(tmp_path):
    a = make(tmp_path / "a.zarr")
    keys = [f"img{i:03d}" for i in range(N)]
    keys[3] = "other"
    with pytest.raises(StoreError, match=r"b\.zarr: not the samples of .*sample 3 is 'img003'"):
        compare_stores(a, make(tmp_path / "b.zarr", keys=keys))
    wide = {
        "features": FieldSpec((6,), "float32"),
        "boxes": FieldSpec((4,), "float32", ragged=True),
        "valid": FieldSpec((), "uint8"),
    }
    with pytest.raises(StoreError, match="field 'features' is float32 .*only fields of one"):
        compare_stores(a, make(tmp_path / "c.zarr", fields=wide))
    fewer = {"features": FieldSpec((6,), "float16"), "valid": FieldSpec((), "uint8")}
    d = make(tmp_path / "d.zarr", fields=fewer)
    with pytest.raises(StoreError, match=r"fields \['boxes'\] are in one store only"):
        compare_stores(a, d)
    with pytest.raises(StoreError, match="d.zarr: no field 'boxes'"):
        compare_stores(a, d, fields=["boxes"])
    assert [x.name for x in compare_stores(a, d, fields=["features"])] == ["features"]

    def more_rows(data):
        data["boxes"][0] = np.zeros((2, 4), np.float32)

    with pytest.raises(StoreError, match="other row counts per sample"):
        compare_stores(a, make(tmp_path / "e.zarr", more_rows))


def test_cli_prints_a_row_per_field_and_fails_beyond_the_tolerance(tmp_path, capsys):
    def nudge(data):
        data["features"][5, 1] += np.float16(0.25)

    make(tmp_path / "a.zarr", nudge)
    make(tmp_path / "b.zarr")
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    assert main(["store", "compare", a, a]) == 0
    assert "compare: 3 of 3 identical" in capsys.readouterr().out
    assert main(["store", "compare", a, b]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("features"))
    assert row.split()[2:4] == [str(N * 6), "1"] and row.split()[-1] == "NO"
    assert "beyond it: features" in out
    assert main(["store", "compare", a, b, "--atol", "0.3", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["features"]["within"] and not rows["features"]["identical"]
    assert rows["valid"]["identical"]
    assert main(["store", "compare", a, str(tmp_path / "none.zarr")]) == 1
    assert "none.zarr" in capsys.readouterr().err
