"""Feature files people download (issue 23.4): LXMERT / py-bottom-up-attention obj36 TSVs
and MILVLG .npz folders imported with their object/attribute labels; regions stores
exported as obj36 and read back the way LXMERT's loader reads them."""

import base64
import csv
import os
import sys
import zipfile

import numpy as np
import pytest
from test_precomp import CFG, make_precomp, tsv_line, tsv_manifest

from features.exchange.butd_tsv import import_butd_tsv
from features.exchange.milvlg_npz import import_npz
from features.exchange.precomp import import_precomp
from features.ingest.manifest import IngestError
from features.store.reader import Store
from features.store.spec import StoreError
from flows.cli import main

# the column order of LXMERT's src/utils.py (HEIGHT before width)
LXMERT_FIELDS = [
    "img_id",
    "img_h",
    "img_w",
    "objects_id",
    "objects_conf",
    "attrs_id",
    "attrs_conf",
    "num_boxes",
    "boxes",
    "features",
]


def detections(rng, n, dim=8, h=480, w=640):
    """What a BUTD extractor keeps for one image: n regions with labels."""
    xy = rng.random((n, 2)) * [w / 2, h / 2]
    return {
        "objects_id": rng.integers(1, 1600, n),  # int64, as np.argmax gives
        "objects_conf": rng.random(n).astype(np.float32),
        "attrs_id": rng.integers(0, 400, n),
        "attrs_conf": rng.random(n).astype(np.float32),
        "boxes": np.concatenate([xy, xy + 10], axis=1).astype(np.float32),
        "features": rng.random((n, dim)).astype(np.float32),
        "img_h": h,
        "img_w": w,
    }


def write_obj36(path, images: dict):
    """As py-bottom-up-attention's extraction scripts write: csv.DictWriter, tab-separated,
    each array base64 of its raw bytes."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, LXMERT_FIELDS, delimiter="\t")
        for img_id, d in images.items():
            row = {"img_id": img_id, "img_h": d["img_h"], "img_w": d["img_w"]}
            row["num_boxes"] = len(d["boxes"])
            for name in LXMERT_FIELDS[3:7] + ["boxes", "features"]:
                row[name] = base64.b64encode(np.ascontiguousarray(d[name])).decode()
            writer.writerow(row)


def lxmert_load_obj_tsv(path):
    """The reading LXMERT's load_obj_tsv does: csv.DictReader, int() sizes, then
    base64.b64decode + np.frombuffer with int64 ids and float32 values."""
    csv.field_size_limit(sys.maxsize)
    out = {}
    with open(path) as f:
        for item in csv.DictReader(f, LXMERT_FIELDS, delimiter="\t"):
            for key in ("img_h", "img_w", "num_boxes"):
                item[key] = int(item[key])
            n = item["num_boxes"]
            for key, shape, dtype in [
                ("objects_id", (n,), np.int64),
                ("objects_conf", (n,), np.float32),
                ("attrs_id", (n,), np.int64),
                ("attrs_conf", (n,), np.float32),
                ("boxes", (n, 4), np.float32),
                ("features", (n, -1), np.float32),
            ]:
                item[key] = np.frombuffer(base64.b64decode(item[key]), dtype=dtype).reshape(shape)
            out[item["img_id"]] = item
    return out


def vse(params, *argv) -> int:
    return main(["--params", str(params), *map(str, argv)])


def test_obj36_imports_with_labels_and_exports_for_lxmert(tmp_path, repo_root, capsys):
    manifest = tsv_manifest(tmp_path, 5)  # test_000000 ... test_000004
    rng = np.random.default_rng(0)
    images = {str(i): detections(rng, 10 + i, h=300 + i, w=500 - i) for i in (0, 1, 3)}
    write_obj36(tmp_path / "vg_obj36.tsv", images)
    params = repo_root / "params.yaml"
    m, out = tmp_path / "m.parquet", tmp_path / "r.zarr"
    assert vse(params, "store", "import-tsv", tmp_path / "vg_obj36.tsv", "--manifest", m,
               "--out", out, "--max-regions", 12) == 0  # fmt: skip
    store = Store.open(out, manifest_digest=manifest.digest)
    assert store.attrs["inputs"]["extractor"] == "import-butd-tsv"
    for i, d in ((0, images["0"]), (3, images["3"])):
        sample = store[f"test_{i:06d}"]
        r = min(12, len(d["boxes"]))
        assert sample["n_regions"] == r
        assert sample["image_hw"].tolist() == [d["img_h"], d["img_w"]]  # h first, as written
        np.testing.assert_array_equal(sample["objects_id"][:r], d["objects_id"][:r])
        np.testing.assert_array_equal(sample["attrs_conf"][:r], d["attrs_conf"][:r])
        np.testing.assert_array_equal(sample["boxes"][:r], d["boxes"][:r])
        np.testing.assert_allclose(sample["features"][:r], d["features"][:r], atol=1e-3)
        assert (sample["objects_id"][r:] == -1).all() and not sample["objects_conf"][r:].any()
    assert store["test_000002"]["n_regions"] == 0
    # exported, then read exactly as LXMERT reads its obj36 files
    tsv = tmp_path / "export" / "test_obj36.tsv"
    capsys.readouterr()
    assert vse(params, "store", "export-tsv", out, "--manifest", m, "--out", tsv) == 0
    printed = capsys.readouterr().out
    assert "3 images -> " in printed and "2 images without regions left out" in printed
    back = lxmert_load_obj_tsv(tsv)
    assert list(back) == ["test_000000", "test_000001", "test_000003"]
    for key, src in zip(back, images.values(), strict=True):
        item, r = back[key], min(12, len(src["boxes"]))
        assert (item["img_h"], item["img_w"], item["num_boxes"]) == (src["img_h"], src["img_w"], r)
        for name in ("objects_id", "objects_conf", "attrs_id", "attrs_conf", "boxes"):
            np.testing.assert_array_equal(item[name], src[name][:r])
        np.testing.assert_allclose(item["features"], src["features"][:r], atol=1e-3)
    # and the export imports again, to the same store contents
    again = tmp_path / "again.zarr"
    assert vse(params, "store", "import-tsv", tsv, "--manifest", m, "--out", again,
               "--max-regions", 12) == 0  # fmt: skip
    a, b = Store.open(out).read(0, 5), Store.open(again).read(0, 5)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_damaged_obj36_rows_are_named_and_stored_empty(tmp_path):
    manifest = tsv_manifest(tmp_path, 8)
    rng = np.random.default_rng(1)
    images = {str(i): detections(rng, 4) for i in range(8)}
    images["1"]["objects_id"] = images["1"]["objects_id"].astype(np.int32)  # 4-byte ids
    images["2"]["attrs_conf"] = images["2"]["attrs_conf"][:3]
    images["3"]["objects_id"] = -images["3"]["objects_id"]
    images["6"]["objects_conf"] = np.full(4, np.nan, np.float32)
    write_obj36(tmp_path / "a.tsv", images)
    lines = (tmp_path / "a.tsv").read_text().splitlines(keepends=True)
    lines[4] = lines[4].replace("\t", "\tx", 1)  # img_h "x480"
    lines[5] = "\t".join(lines[5].split("\t")[:9]) + "\n"  # features column lost
    (tmp_path / "a.tsv").write_text("".join(lines))
    messages = []
    import_butd_tsv([tmp_path / "a.tsv"], manifest, tmp_path / "r.zarr", CFG, log=messages.append)
    at = tmp_path / "a.tsv"
    expected = {
        1: f"{at}:2: objects_id: 2 values for 4 rows",
        2: f"{at}:3: attrs_conf: 3 values for 4 rows",
        4: f"{at}:5: num_boxes, img_w and img_h must be integers",
        5: f"{at}:6: 9 tab-separated fields, expected 10 ({', '.join(LXMERT_FIELDS)})",
    }
    store = Store.open(tmp_path / "r.zarr")
    notes = store.notes()
    for i, message in expected.items():
        assert notes[f"test_{i:06d}"] == ["malformed_row", message]
    assert (
        notes["test_000003"][1].startswith(f"{at}:4: objects_id -")
        and "out of range" in (notes["test_000003"][1])
    )
    assert notes["test_000006"] == ["non_finite", "objects_conf: NaN or infinite values"]
    assert store.read(0, 8)["valid"].tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    assert len(messages) == 2 and all("\n" not in m for m in messages)
    # forced to the other layout, every row is refused by name, nothing is guessed
    with pytest.raises(IngestError, match="no row of the 8 matched images can be parsed as "):
        import_butd_tsv([at], manifest, tmp_path / "s.zarr", CFG, fmt="butd")
    (tmp_path / "b.tsv").write_text(tsv_line(0, rng.random((2, 4)), rng.random((2, 8))))
    with pytest.raises(IngestError) as err:
        import_butd_tsv([at, tmp_path / "b.tsv"], manifest, tmp_path / "s.zarr", CFG)
    assert str(err.value) == (
        f"{tmp_path / 'b.tsv'} is a 6-field bottom-up-attention TSV and {at} a 10-field obj36 "
        "TSV; import them into separate stores"
    )
    assert not (tmp_path / "s.zarr").exists()


def test_the_fields_of_a_row_without_boxes_decode_empty():
    """num_boxes 0: each field is an empty array of its shape, one value per box (ids,
    confidences), 4 per box (boxes) or any number (features)."""
    from features.exchange.butd_tsv import _decode

    assert _decode("", 0, None, "objects_id", np.int64).shape == (0,)
    assert _decode("", 0, 4, "boxes").shape == (0, 4)
    assert _decode("", 0, -1, "features").shape == (0, 0)


def test_the_tsv_format_is_told_by_the_first_rows_field_count(tmp_path):
    from features.exchange.butd_tsv import index_tsv, tsv_format

    rng = np.random.default_rng(3)
    write_obj36(tmp_path / "o.tsv", {"1": detections(rng, 2)})
    (tmp_path / "b.tsv").write_text(tsv_line(0, rng.random((2, 4)), rng.random((2, 8))))
    assert tsv_format(tmp_path / "o.tsv") == "obj36" and tsv_format(tmp_path / "b.tsv") == "butd"
    late = tmp_path / "late.tsv"  # 100 rows of 3 fields, then an obj36 row: not probed
    late.write_text("a\tb\tc\n" * 100 + (tmp_path / "o.tsv").read_text())
    assert tsv_format(late) == "butd" and tsv_format(late, probe=101) == "obj36"
    assert tsv_format(tmp_path / "b.tsv", "obj36") == "obj36"  # as asked, unread
    with pytest.raises(IngestError) as err:
        tsv_format(tmp_path / "b.tsv", "lxmert")
    assert str(err.value) == "--format 'lxmert': expected auto, butd or obj36"
    with pytest.raises(IngestError) as err:
        index_tsv([tmp_path])
    assert str(err.value) == f"{tmp_path}: cannot read (Is a directory)"
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(IngestError, match=r"no TSV image_id matches a manifest key .* vs None\)"):
        import_butd_tsv([tmp_path / "empty.tsv"], tsv_manifest(tmp_path, 1), tmp_path / "r", CFG)


@pytest.mark.parametrize(("ids", "ok"), [([0, 2**31 - 1], True), ([2**31, 1], False)])
def test_obj36_class_ids_are_checked_against_int32(tmp_path, ids, ok):
    """Ids 0 to 2**31 - 1 fit the store's int32 field; 2**31 would wrap: refused."""
    from features.exchange.butd_tsv import MalformedRow, _read_tsv_row

    d = detections(np.random.default_rng(5), 2)
    d["objects_id"] = np.array(ids, dtype=np.int64)
    write_obj36(tmp_path / "o.tsv", {"1": d})
    if ok:
        assert _read_tsv_row(tmp_path / "o.tsv", 0, 1, "obj36")["objects_id"].tolist() == ids
    else:
        with pytest.raises(MalformedRow, match="objects_id 1..2147483648 out of range"):
            _read_tsv_row(tmp_path / "o.tsv", 0, 1, "obj36")


def test_export_tsv_of_stores_without_labels_or_boxes(tmp_path):
    manifest = tsv_manifest(tmp_path, 2)
    rng = np.random.default_rng(2)
    feats = rng.random((3, 8)).astype(np.float32)
    (tmp_path / "a.tsv").write_text(tsv_line(0, rng.random((3, 4)), feats, w=64, h=32))
    import_butd_tsv([tmp_path / "a.tsv"], manifest, tmp_path / "r.zarr", CFG)
    messages = []
    store = Store.open(tmp_path / "r.zarr")
    from features.exchange.butd_tsv import export_obj36

    written, skipped = export_obj36(store, manifest, tmp_path / "o.tsv", log=messages.append)
    assert (written, skipped) == (1, ["test_000001"])
    assert messages == [
        f"export: {store.url} has no objects or attrs labels; writing id -1 and confidence 0 "
        "for them"
    ]
    item = lxmert_load_obj_tsv(tmp_path / "o.tsv")["test_000000"]
    assert (item["img_h"], item["img_w"]) == (32, 64)
    assert item["objects_id"].tolist() == [-1] * 3 and not item["attrs_conf"].any()
    np.testing.assert_allclose(item["features"], feats, atol=1e-3)
    precomp = Store.open(tmp_path / "x.zarr")  # made by tsv_manifest: no boxes
    with pytest.raises(StoreError) as err:
        export_obj36(precomp, manifest, tmp_path / "p.tsv")
    assert str(err.value) == (
        f"{precomp.url}: this regions store has no boxes (a precomp import?); obj36 rows "
        "need them: import bottom-up-attention TSV or npz files, or extract regions"
    )
    assert not (tmp_path / "p.tsv").exists()


def save_milvlg(folder, image_id, d, attrs=True, **overrides):
    """As MILVLG's extraction script saves an image: np.savez_compressed with ``info`` a
    dict (pickled by numpy)."""
    info = {
        "image_id": image_id,
        "image_h": d["img_h"],
        "image_w": d["img_w"],
        "num_boxes": len(d["boxes"]),
        "objects_id": d["objects_id"],
        "objects_conf": d["objects_conf"],
    }
    if attrs:
        info.update(attrs_id=d["attrs_id"], attrs_conf=d["attrs_conf"])
    arrays = {
        "x": d["features"],
        "bbox": d["boxes"],
        "num_bbox": len(d["boxes"]),
        "image_h": d["img_h"],
        "image_w": d["img_w"],
        "info": info,
    }
    arrays.update(overrides)
    np.savez_compressed(folder / f"{image_id}.npz", **arrays)


class Payload:
    """A pickle that would run a command when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_milvlg_npz_folder_imports_with_labels(tmp_path, repo_root):
    manifest = tsv_manifest(tmp_path, 9)
    folder = tmp_path / "npz"
    folder.mkdir()
    rng = np.random.default_rng(3)
    images = {f"test_{i:06d}": detections(rng, 5 + i, h=200, w=300) for i in range(9)}
    for image_id, d in images.items():
        save_milvlg(folder, image_id, d)
    marker = tmp_path / "ran"
    save_milvlg(folder, "test_000001", images["test_000001"], info={"x": Payload(marker)})
    save_milvlg(folder, "test_000002", images["test_000002"], bbox=np.zeros((2, 4), np.float32))
    save_milvlg(folder, "test_000003", images["test_000003"], attrs=False)
    del_x = {k: v for k, v in np.load(folder / "test_000004.npz", allow_pickle=True).items()}
    del del_x["x"]
    np.savez(folder / "test_000004.npz", **del_x)
    data = (folder / "test_000005.npz").read_bytes()
    (folder / "test_000005.npz").write_bytes(data[: len(data) // 2])
    save_milvlg(folder, "test_000006", images["test_000006"], num_bbox=np.float32(11))
    (folder / "test_000008.npz").unlink()
    params = repo_root / "params.yaml"
    out = tmp_path / "r.zarr"
    assert vse(params, "store", "import-npz", folder, "--manifest", tmp_path / "m.parquet",
               "--out", out, "--max-regions", 8) == 0  # fmt: skip
    assert not marker.exists()  # the pickle was refused, not run
    store = Store.open(out)
    d = images["test_000007"]
    sample = store["test_000007"]
    assert sample["n_regions"] == 8 and sample["image_hw"].tolist() == [200, 300]
    np.testing.assert_array_equal(sample["attrs_id"], d["attrs_id"][:8])
    np.testing.assert_array_equal(sample["objects_conf"], d["objects_conf"][:8])
    np.testing.assert_array_equal(sample["boxes"], d["boxes"][:8])
    np.testing.assert_allclose(sample["features"], d["features"][:8], atol=1e-3)
    notes = store.notes()
    f = {i: folder / f"test_{i:06d}.npz" for i in range(9)}
    assert notes["test_000001"] == [
        "malformed_row",
        f"{f[1]}: info refused: posix.system is not part of a numpy array",
    ]
    assert notes["test_000002"][1] == (f"{f[2]}: bbox is float32 of shape (2, 4); expected (7, 4)")
    assert notes["test_000003"][1] == f"{f[3]}: info has no attrs_id; others have"
    assert notes["test_000004"][1].startswith(f"{f[4]}: no x; expected x, bbox, num_bbox")
    assert notes["test_000005"][1].startswith(f"{f[5]}: not a readable .npz (BadZipFile")
    assert notes["test_000006"][1] == (
        f"{f[6]}: num_bbox: float32 of shape (); expected an integer"
    )
    assert notes["test_000008"] == ["no_npz_file", "no npz file matches this key"]
    assert store.read(0, 9)["valid"].tolist() == [1, 0, 0, 0, 0, 0, 0, 1, 0]
    assert all("\n" not in note[1] for note in notes.values())
    with zipfile.ZipFile(f[7]) as z:
        assert "info.npy" in z.namelist()
    with pytest.raises(IngestError, match="no .npz files; is this a MILVLG feature folder"):
        import_npz(tmp_path / "src", manifest, tmp_path / "s.zarr", CFG)


def test_export_of_one_split_writes_its_images_only(tmp_path):
    from features.exchange.butd_tsv import export_obj36

    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        make_precomp(src, split, 3, per_image=1, ids=False, regions=2, dim=2)
    manifest = import_precomp(
        src, ["train", "test"], tmp_path / "m.parquet", tmp_path / "x.zarr", CFG
    )
    keys = manifest.table["key"].to_pylist()
    folder = tmp_path / "npz"
    folder.mkdir()
    rng = np.random.default_rng(4)
    for key in keys:
        save_milvlg(folder, key, detections(rng, 4, h=50, w=60))
    import_npz(folder, manifest, tmp_path / "r.zarr", CFG, log=lambda m: None)
    store = Store.open(tmp_path / "r.zarr")
    written, skipped = export_obj36(store, manifest, tmp_path / "t.tsv", split="test")
    test_keys = manifest.split("test")["key"].to_pylist()
    assert (written, skipped) == (3, []) and len(test_keys) == 3
    assert sorted(lxmert_load_obj_tsv(tmp_path / "t.tsv")) == sorted(test_keys)


def test_an_id_matching_many_keys_names_the_first_five(tmp_path):
    """Id 7 is the trailing number of keys a_7 ... f_7: five keys are
    named in full, more are cut with '...'."""
    from features.exchange.butd_tsv import match_keys

    for n, shown in ((5, "a_7, b_7, c_7, d_7, e_7"), (6, "a_7, b_7, c_7, d_7, e_7, ...")):
        keys = [f"{c}_7" for c in "abcdef"[:n]]
        with pytest.raises(IngestError) as err:
            match_keys(keys, {"7": "f.tsv:3"})
        assert str(err.value) == (
            f"f.tsv:3: image id '7' matches {n} manifest keys ({shown}); name the rows by "
            "manifest key, or import each split with a manifest of that split only"
        )
