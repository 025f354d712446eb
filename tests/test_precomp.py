"""Importers (SCAN/VSE++ precomp, bottom-up-attention TSV) and the precomp exporter."""

import base64
import csv
import sys

import numpy as np
import pytest

from features.ingest import IngestError, read_manifest
from features.precomp import (
    _rows_per_image,
    export_precomp,
    import_butd_tsv,
    import_precomp,
    match_keys,
)
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


def per_caption_layout(folder, name, ims, per_image=5, ids=True):
    """VSE++/SCAN's other precomp layout (their loaders' ``im_div = 1``): one feature row per
    caption, each image's row repeated for each of its captions, ids (if any) per caption."""
    np.save(folder / f"{name}_ims.npy", np.repeat(ims, per_image, axis=0))
    caps = [f"{name} image {i} caption {j}" for i in range(len(ims)) for j in range(per_image)]
    (folder / f"{name}_caps.txt").write_text("\n".join(caps) + "\n")
    if ids:
        lines = [f"{700 + i}\n" for i in range(len(ims)) for _ in range(per_image)]
        (folder / f"{name}_ids.txt").write_text("".join(lines))
    return caps


@pytest.mark.parametrize("ids", [True, False])
def test_one_row_per_caption_imports_each_image_once_with_its_captions(tmp_path, ids):
    src = tmp_path / "coco_precomp"
    src.mkdir()
    ims = np.random.default_rng(1).standard_normal((4, 36, 16)).astype(np.float32)
    ims[2, 5, 3] = np.nan  # a copied NaN is the same bytes in every copy
    caps = per_caption_layout(src, "test", ims, ids=ids)
    manifest = import_precomp(src, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    rows = manifest.table.to_pylist()
    assert len(rows) == 4 and manifest.captions_per_image == 5
    assert [r["key"] for r in rows] == (
        ["700", "701", "702", "703"] if ids else [f"test_{i:06d}" for i in range(4)]
    )
    assert [r["captions"] for r in rows] == [caps[5 * i : 5 * i + 5] for i in range(4)]
    store = Store.open(tmp_path / "r.zarr", manifest_digest=manifest.digest)
    data = store.read(0, 4)
    assert data["valid"].tolist() == [1, 1, 0, 1]  # the NaN image: stored empty, as always
    for i in (0, 1, 3):
        np.testing.assert_array_equal(data["features"][i], ims[i].astype(np.float16))
    # exported in the one-row-per-image layout, the reference loaders' other form
    export_precomp(store, manifest, "test", tmp_path / "out")
    assert np.load(tmp_path / "out" / "test_ims.npy").shape == (4, 36, 16)
    assert (tmp_path / "out" / "test_caps.txt").read_text() == (src / "test_caps.txt").read_text()


def test_one_caption_per_image_stays_one_image_per_row(tmp_path):
    ims = make_precomp(tmp_path, "test", 6, per_image=1)
    ims[3] = ims[2]  # two identical images, not the first two: still one row per image
    np.save(tmp_path / "test_ims.npy", ims)
    manifest = import_precomp(tmp_path, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    assert len(manifest) == 6 and manifest.captions_per_image == 1
    assert manifest.table["captions"].to_pylist()[4] == ["test image 4 caption 0"]


@pytest.mark.parametrize(
    "damage, message",
    [
        ((13, 0, 0), "rows 0-4 hold one image 5 times .* but row 13 differs from row 10;"),
        ((19, 35, 15), "but row 19 differs from row 15; save one row per image, or 5 identical"),
        (None, "but its 23 rows are not a whole number of images;"),
    ],
)
def test_rows_repeated_for_some_images_only_are_refused_in_one_line(tmp_path, damage, message):
    ims = np.random.default_rng(2).standard_normal((4, 36, 16)).astype(np.float32)
    per_caption_layout(tmp_path, "test", ims, ids=False)
    rows = np.load(tmp_path / "test_ims.npy")
    if damage:
        rows[damage] += 1.0  # one copy of image 2 (row 13) or of image 3 (row 19) differs
    else:  # 3 more images of one row each, and as many captions
        rows = np.concatenate([rows, ims[1:]])
        with open(tmp_path / "test_caps.txt", "a") as f:
            f.write("one\ntwo\nthree\n")
    np.save(tmp_path / "test_ims.npy", rows)
    for block in (1, 1 << 26):  # one image per block, or the whole file in one
        with pytest.raises(IngestError, match=message) as err:
            _rows_per_image(np.load(tmp_path / "test_ims.npy", mmap_mode="r"), "f", block)
    with pytest.raises(IngestError, match=r"test_ims\.npy: rows 0-4 hold") as err:
        import_precomp(tmp_path, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    assert "\n" not in str(err.value) and not (tmp_path / "r.zarr").exists()


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


def test_precomp_rows_with_nan_or_inf_are_stored_invalid_and_reported(tmp_path):
    src = tmp_path / "p"
    src.mkdir()
    ims = make_precomp(src, "test", 6, ids=False)
    ims[1, 3, 5] = np.nan
    ims[4, 0, 0] = 1e9  # finite as float32, infinite in the float16 store
    np.save(src / "test_ims.npy", ims)
    messages = []
    import_precomp(
        src, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG, log=messages.append
    )
    store = Store.open(tmp_path / "r.zarr")
    assert {k: v[0] for k, v in store.notes().items()} == {
        "test_000001": "non_finite",
        "test_000004": "non_finite",
    }
    data = store.read(0, 6)
    assert data["valid"].tolist() == [1, 0, 1, 1, 0, 1]
    assert data["n_regions"].tolist() == [36, 0, 36, 36, 0, 36]
    assert np.isfinite(data["features"].astype(np.float32)).all()
    assert "test_000001 (features)" in " ".join(messages)


def test_tsv_rows_with_nan_are_stored_invalid_and_reported(tmp_path):
    src = tmp_path / "p"
    src.mkdir()
    make_precomp(src, "test", 3, ids=False)
    manifest = import_precomp(src, ["test"], tmp_path / "m.parquet", tmp_path / "x.zarr", CFG)
    rng = np.random.default_rng(0)
    boxes = rng.random((4, 4)) * 100
    boxes[2, 1] = np.inf
    rows = [(str(i), rng.random((4, 4)) * 100, rng.random((4, 8))) for i in range(3)]
    rows[1] = ("1", boxes, rng.random((4, 8)))
    write_tsv(tmp_path / "a.tsv", rows)
    import_butd_tsv([tmp_path / "a.tsv"], manifest, tmp_path / "r.zarr", CFG, max_regions=4)
    store = Store.open(tmp_path / "r.zarr")
    assert store.notes() == {"test_000001": ["non_finite", "boxes: NaN or infinite values"]}
    assert store.read(0, 3)["valid"].tolist() == [1, 0, 1]
    assert np.isfinite(store.read(0, 3)["boxes"]).all()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d, p: p.write_bytes(p.read_bytes()[:-7]), "test_ims.npy: not a readable .npy"),
        (lambda d, p: p.write_bytes(p.read_bytes()[:60]), "test_ims.npy: not a readable .npy"),
        (lambda d, p: p.write_bytes(b"garbage"), "test_ims.npy: not a readable .npy"),
        (
            lambda d, p: np.save(p, np.array([{"a": 1}], dtype=object)),
            "test_ims.npy: not a readable .npy",
        ),
        (lambda d, p: np.save(p, np.zeros((0, 36, 16))), "holds no features"),
        (lambda d, p: np.save(p, np.zeros((3, 16))), "expected real numbers of shape"),
        (lambda d, p: np.save(p, np.zeros((3, 2, 2), complex)), "expected real numbers"),
        (lambda d, p: (d / "test_caps.txt").write_bytes(b"ok\ncaf\xe9\n"), "test_caps.txt:2: not"),
        (lambda d, p: (d / "test_ids.txt").write_text("1 1 2 3"), "id '1' occurs more than once"),
    ],
)
def test_bad_precomp_files_are_one_line_errors_and_nothing_is_written(tmp_path, damage, message):
    src = tmp_path / "p"
    src.mkdir()
    make_precomp(src, "train", 4)
    make_precomp(src, "test", 4)
    damage(src, src / "test_ims.npy")
    out = tmp_path / "out"
    with pytest.raises(IngestError, match=message) as err:
        import_precomp(src, ["train", "test"], out / "m.parquet", out / "r.zarr", CFG)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_malformed_tsv_rows_are_named_and_stored_empty(tmp_path):
    src = tmp_path / "p"
    src.mkdir()
    make_precomp(src, "test", 5, ids=False)
    manifest = import_precomp(src, ["test"], tmp_path / "m.parquet", tmp_path / "x.zarr", CFG)
    rng = np.random.default_rng(0)
    write_tsv(
        tmp_path / "a.tsv", [(str(i), rng.random((3, 4)), rng.random((3, 8))) for i in (0, 1)]
    )
    with open(tmp_path / "a.tsv", "a") as f:
        f.write("2\t640\t480\t3\tnot base64!\tAAAA\n")  # bad boxes
        f.write("3\t640\t480\n")  # too few fields
        f.write("4\t640\t480\t1\tAAAAAAAAAAAAAAAAAAAAAA==\tAAAAAA==\n")  # 16 bytes, 1 feature of 1
    messages = []
    missing = import_butd_tsv(
        [tmp_path / "a.tsv"], manifest, tmp_path / "r.zarr", CFG, log=messages.append
    )
    assert missing == []
    notes = Store.open(tmp_path / "r.zarr").notes()
    assert (
        notes["test_000002"][0] == "malformed_row" and "a.tsv:3: boxes" in notes["test_000002"][1]
    )
    assert "a.tsv:4: 3 tab-separated fields" in notes["test_000003"][1]
    assert "features of 1 values per box, others 8" in notes["test_000004"][1]
    assert Store.open(tmp_path / "r.zarr").read(0, 5)["valid"].tolist() == [1, 1, 0, 0, 0]
    assert "3 images stored empty (valid = 0) for malformed_row" in messages[0]
    (tmp_path / "b.tsv").write_bytes(b"\xff\xfe\t1\n")
    with pytest.raises(IngestError, match="b.tsv:1: image_id .* is not ASCII"):
        import_butd_tsv([tmp_path / "b.tsv"], manifest, tmp_path / "s.zarr", CFG)
    write_tsv(tmp_path / "c.tsv", [("0", rng.random((1, 4)), rng.random((1, 8)))] * 2)
    with pytest.raises(IngestError, match="c.tsv:2: image_id '0' already at .*c.tsv:1"):
        import_butd_tsv([tmp_path / "c.tsv"], manifest, tmp_path / "s.zarr", CFG)
