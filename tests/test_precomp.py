"""Importers (SCAN/VSE++ precomp, bottom-up-attention TSV) and the precomp exporter."""

import base64
import csv
import sys

import numpy as np
import pytest

from features.ingest import IngestError, read_manifest
from features.precomp import export_precomp, import_butd_tsv, import_precomp, match_keys
from features.store import Store, StoreConfig
from flows.cli import main

CFG = StoreConfig(samples_per_shard=4, samples_per_chunk=2)


def make_precomp(folder, name, n, per_image=5, ids=True, regions=36, dim=16):
    rng = np.random.default_rng(len(name))
    ims = rng.standard_normal((n, regions, dim)).astype(np.float32)
    np.save(folder / f"{name}_ims.npy", ims)
    caps = [f"{name} image {i} caption {j}" for i in range(n) for j in range(per_image)]
    (folder / f"{name}_caps.txt").write_text("\n".join(caps) + "\n")
    if ids:
        (folder / f"{name}_ids.txt").write_text(
            "".join(f"{1000 + len(name) * 100 + i}\n" for i in range(n))
        )
    return ims


def test_import_then_export_precomp_round_trips(tmp_path):
    src = tmp_path / "f30k_precomp"
    src.mkdir()
    train = make_precomp(src, "train", 10)
    dev = make_precomp(src, "dev", 3, ids=False)
    manifest = import_precomp(
        src, ["train", "dev"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG
    )
    assert len(manifest) == 13 and manifest.dataset == "precomp"
    assert len(manifest.split("val")) == 3
    store = Store.open(tmp_path / "r.zarr", manifest_digest=manifest.digest)
    assert "boxes" not in store.fields and store.verify() == []
    np.testing.assert_array_equal(store[11]["features"], dev[1].astype(np.float16))
    out = tmp_path / "export"
    export_precomp(store, manifest, "train", out)
    again = np.load(out / "train_ims.npy")
    np.testing.assert_array_equal(again, train.astype(np.float16).astype(np.float32))
    assert (out / "train_caps.txt").read_text() == (src / "train_caps.txt").read_text()
    assert (out / "train_ids.txt").read_text() == (src / "train_ids.txt").read_text()
    export_precomp(store, manifest, "val", out)
    assert (out / "dev_ids.txt").read_text().split() == [f"dev_{i:06d}" for i in range(3)]


def test_precomp_errors(tmp_path):
    make_precomp(tmp_path, "test", 4, per_image=5)
    (tmp_path / "test_caps.txt").write_text("one\ntwo\nthree\n")
    with pytest.raises(IngestError, match="whole number of captions per image"):
        import_precomp(tmp_path, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    with pytest.raises(IngestError, match="dev_ims.npy and dev_caps.txt"):
        import_precomp(tmp_path, ["dev"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)


def write_tsv(path, rows):
    csv.field_size_limit(sys.maxsize)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        for image_id, boxes, feats in rows:
            writer.writerow(
                [
                    image_id,
                    640,
                    480,
                    len(boxes),
                    base64.b64encode(boxes.astype(np.float32).tobytes()).decode(),
                    base64.b64encode(feats.astype(np.float32).tobytes()).decode(),
                ]
            )


def test_import_butd_tsv(tmp_path):
    src = tmp_path / "p"
    src.mkdir()
    make_precomp(src, "test", 5, ids=False)
    manifest = import_precomp(src, ["test"], tmp_path / "m.parquet", tmp_path / "x.zarr", CFG)
    keys = manifest.table["key"].to_pylist()  # test_000000 ... test_000004
    rng = np.random.default_rng(0)
    rows = [(str(i), rng.random((10 + i, 4)) * 100, rng.random((10 + i, 8))) for i in (0, 1, 3)]
    write_tsv(tmp_path / "a.tsv", rows[:2])
    write_tsv(tmp_path / "b.tsv", rows[2:] + [("999", rng.random((2, 4)), rng.random((2, 8)))])
    missing = import_butd_tsv(
        [tmp_path / "a.tsv", tmp_path / "b.tsv"], manifest, tmp_path / "r.zarr", CFG, max_regions=12
    )
    assert missing == ["test_000002", "test_000004"]
    store = Store.open(tmp_path / "r.zarr", manifest_digest=manifest.digest)
    sample = store[keys[3]]
    assert sample["n_regions"] == 12 and tuple(sample["image_hw"]) == (480, 640)
    np.testing.assert_allclose(sample["features"][:12], rows[2][2][:12], atol=1e-3)
    np.testing.assert_allclose(sample["boxes"][:12], rows[2][1][:12], rtol=1e-6)
    assert store[keys[1]]["n_regions"] == 11 and store[keys[2]]["n_regions"] == 0
    assert not store[keys[1]]["features"][11:].any()  # padding stays zero


def test_match_keys_by_trailing_id():
    keys = ["COCO_val2014_000000391895", "1000092795", "noid"]
    assert match_keys(keys, ["391895", "1000092795"]) == {
        "COCO_val2014_000000391895": "391895",
        "1000092795": "1000092795",
    }


def test_cli_import_and_export(tmp_path, repo_root, monkeypatch):
    src = tmp_path / "p"
    src.mkdir()
    make_precomp(src, "train", 6)
    params = repo_root / "params.yaml"
    assert (
        main(
            [
                "--params",
                str(params),
                "store",
                "import-precomp",
                str(src),
                "--splits",
                "train",
                "--manifest",
                str(tmp_path / "m.parquet"),
                "--out",
                str(tmp_path / "r.zarr"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "store",
                "export-precomp",
                str(tmp_path / "r.zarr"),
                "--manifest",
                str(tmp_path / "m.parquet"),
                "--split",
                "train",
                "--out",
                str(tmp_path / "e"),
            ]
        )
        == 0
    )
    assert np.load(tmp_path / "e" / "train_ims.npy").shape == (6, 36, 16)
    assert read_manifest(tmp_path / "m.parquet").table.num_rows == 6
