"""Importers (SCAN/VSE++ precomp, bottom-up-attention TSV) and the precomp exporter."""

import base64
import csv
import pickle
import re
import sys

import numpy as np
import pytest

from features.exchange.butd_tsv import import_butd_tsv, match_keys
from features.exchange.precomp import (
    _rows_per_image,
    export_precomp,
    import_precomp,
    read_precomp_split,
)
from features.ingest.manifest import Dataset, IngestError, Record, read_manifest, write_manifest
from features.ingest.validate import check_key
from features.store.reader import Store
from features.store.spec import StoreConfig, StoreError
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


@pytest.mark.parametrize("ids, per_image", [(True, 5), (True, 2), (False, 2)])
def test_one_row_per_caption_imports_each_image_once_with_its_captions(tmp_path, ids, per_image):
    src = tmp_path / "coco_precomp"
    src.mkdir()
    ims = np.random.default_rng(1).standard_normal((4, 36, 16)).astype(np.float32)
    ims[2, 5, 3] = np.nan  # a copied NaN is the same bytes in every copy
    caps = per_caption_layout(src, "test", ims, per_image, ids)
    manifest = import_precomp(src, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    rows = manifest.table.to_pylist()
    assert len(rows) == 4 and manifest.captions_per_image == per_image
    assert [r["key"] for r in rows] == (
        ["700", "701", "702", "703"] if ids else [f"test_{i:06d}" for i in range(4)]
    )
    assert [r["captions"] for r in rows] == [
        caps[per_image * i : per_image * (i + 1)] for i in range(4)
    ]
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
        (
            (13, 0, 0),
            "^"
            + re.escape(
                "f: rows 0-4 hold one image 5 times (one row per caption, as in VSE++/SCAN's "
                "im_div = 1), but row 13 differs from row 10; save one row per image, or 5 "
                "identical rows for every image"
            )
            + "$",
        ),
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
    assert match_keys(keys, {"391895": "a:1", "1000092795": "a:2"}) == {
        "COCO_val2014_000000391895": "391895",
        "1000092795": "1000092795",
    }


def test_an_id_matching_several_keys_stops_the_import_in_one_line(tmp_path):
    """Issue 25.3: TSV id ``1`` once matched train_00001, val_00001 and test_00001 and
    gave all three the same row."""
    keys = ["train_00001", "val_00001", "test_00001", "test_00002"]
    with pytest.raises(IngestError) as err:
        match_keys(keys, {"1": "a.tsv:7", "2": "a.tsv:8"})
    assert str(err.value) == (
        "a.tsv:7: image id '1' matches 3 manifest keys (train_00001, val_00001, test_00001); "
        "name the rows by manifest key, or import each split with a manifest of that split only"
    )
    # an exact key and a trailing number claiming the same id: ambiguous too
    with pytest.raises(IngestError, match="image id '7' matches 2 manifest keys \\(7, val_7\\)"):
        match_keys(["7", "val_7"], {"7": "a.tsv:1"})
    # two ids with the same number (``01`` and ``1``): the key is not guessed at either
    with pytest.raises(IngestError) as err:
        match_keys(["img_1"], {"01": "a.tsv:1", "1": "a.tsv:2"})
    assert str(err.value).startswith(
        "a.tsv:1: manifest key 'img_1' matches image ids ['01', '1'] by its trailing number"
    )
    # each key exactly once: the full key wins over numbers, no error
    assert match_keys(["val_7", "train_7"], {"val_7": "x", "train_7": "y", "7": "z"}) == {
        "val_7": "val_7",
        "train_7": "train_7",
    }
    # through the importer: nothing is written
    manifest = tsv_manifest(tmp_path, 2)  # test_000000, test_000001
    rng = np.random.default_rng(0)
    (tmp_path / "a.tsv").write_text(
        tsv_line(1, rng.random((2, 4)), rng.random((2, 8)))
        + tsv_line("000001", rng.random((2, 4)), rng.random((2, 8)))
    )
    with pytest.raises(IngestError) as err:
        import_butd_tsv([tmp_path / "a.tsv"], manifest, tmp_path / "r.zarr", CFG)
    assert str(err.value) == (
        f"{tmp_path / 'a.tsv'}:2: manifest key 'test_000001' matches image ids "
        "['000001', '1'] by its trailing number; keep one of those rows, or name the rows by "
        "manifest key"
    )
    assert not (tmp_path / "r.zarr").exists()


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


# --------------------------------------------------------------------------- exact outcomes
# What a user reads (every message in full, the store's provenance, the notes) checked
# exactly, so that a changed word, bound or default shows (make mutation).


def npy_error(path) -> str:
    """numpy's own words on a file that np.load refuses, as the importer quotes them:
    whitespace collapsed, at most 160 characters."""
    try:
        np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    raise AssertionError(f"{path} loads")


def long_header_npy(path):
    """A .npy whose header has 30 unknown keys: numpy's error lists them all (> 160 chars)."""
    keys = ", ".join(f"'k{i:02d}': 0" for i in range(30))
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2, 2), {keys}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    body = np.zeros((2, 2, 2), np.float32).tobytes()
    path.write_bytes(
        b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + body
    )


def test_precomp_features_stay_memory_mapped(tmp_path):
    make_precomp(tmp_path, "test", 3)
    ims, captions, keys = read_precomp_split(tmp_path, "test")
    assert isinstance(ims, np.memmap) and len(captions) == 15 and keys == ["1400", "1401", "1402"]
    one = np.random.default_rng(0).standard_normal((1, 4, 2)).astype(np.float32)
    per_caption_layout(tmp_path, "dev", one, per_image=2, ids=False)  # one image, 2 rows
    ims, captions, keys = read_precomp_split(tmp_path, "dev")
    assert isinstance(ims, np.memmap) and ims.shape == (1, 4, 2) and keys == ["dev_000000"]


def _damaged(name):
    """(damage(folder), expected message(folder)) of the named damage to split 'test'."""
    ims = lambda d: d / "test_ims.npy"  # noqa: E731
    ids = lambda d: d / "test_ids.txt"  # noqa: E731
    whole = "re-create it with numpy.save or download it again"
    return {
        "pickle": (
            lambda d: ims(d).write_bytes(pickle.dumps([1.0, 2.0])),
            lambda d: f"{ims(d)}: not a readable .npy array ({npy_error(ims(d))}); {whole}",
        ),
        "long numpy error": (
            lambda d: long_header_npy(ims(d)),
            lambda d: f"{ims(d)}: not a readable .npy array ({npy_error(ims(d))}); {whole}",
        ),
        "npz": (
            lambda d: np.savez(d / "x.npz", a=np.zeros(3)) or (d / "x.npz").rename(ims(d)),
            lambda d: (
                f"{ims(d)}: NpzFile array of shape ?; expected real numbers of shape "
                "(images, regions, dim)"
            ),
        ),
        "complex": (
            lambda d: np.save(ims(d), np.zeros((3, 2, 2), complex)),
            lambda d: (
                f"{ims(d)}: complex128 array of shape (3, 2, 2); expected real numbers "
                "of shape (images, regions, dim)"
            ),
        ),
        "6 captions for 4 images": (
            lambda d: (d / "test_caps.txt").write_text("a\nb\nc\nd\ne\nf\n"),
            lambda d: (
                f"{ims(d)}: (4, 36, 16) features for 6 captions in test_caps.txt; "
                "expected (N, regions, dim) and a whole number of captions per image (1 or more)"
            ),
        ),
        "not UTF-8": (
            lambda d: (d / "test_caps.txt").write_bytes(b"ok\ncaf\xe9\n"),
            lambda d: f"{d / 'test_caps.txt'}:2: not valid UTF-8; re-encode the file",
        ),
        "3 ids": (
            lambda d: ids(d).write_text("1\n2\n3\n"),
            lambda d: f"{ids(d)}: 3 ids for 4 images",
        ),
        "bad id": (
            lambda d: ids(d).write_text("1\na#b\n2\n3\n"),
            lambda d: f"{ids(d)}: {check_key('a#b')}",
        ),
        "id twice": (
            lambda d: ids(d).write_text("5 6 7 6"),
            lambda d: f"{ids(d)}: id '6' occurs more than once",
        ),
        "ids a folder": (
            lambda d: ids(d).unlink() or ids(d).mkdir(),
            lambda d: f"{ids(d)}: cannot read (Is a directory)",
        ),
    }[name]


@pytest.mark.parametrize(
    "name",
    [
        "pickle",
        "long numpy error",
        "npz",
        "complex",
        "6 captions for 4 images",
        "not UTF-8",
        "3 ids",
        "bad id",
        "id twice",
        "ids a folder",
    ],
)
def test_precomp_refusals_word_for_word(tmp_path, name):
    damage, expected = _damaged(name)
    src = tmp_path / "p"
    src.mkdir()
    make_precomp(src, "test", 4)
    damage(src)
    with pytest.raises(IngestError) as err:
        import_precomp(src, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    assert str(err.value) == expected(src)
    assert not (tmp_path / "r.zarr").exists() and not (tmp_path / "m.parquet").exists()
    if name == "long numpy error":
        assert len(npy_error(src / "test_ims.npy")) == len("ValueError: ") + 160


def test_precomp_split_choices_word_for_word(tmp_path):
    make_precomp(tmp_path, "train", 4)
    make_precomp(tmp_path, "test", 3, regions=10)
    make_precomp(tmp_path, "testall", 3, regions=10)
    (tmp_path / "testall_ids.txt").write_text((tmp_path / "test_ids.txt").read_text())
    out = (tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    cases = {
        (): "no precomp split given; pass --splits train dev test",
        ("val",): "precomp split 'val': expected one of ['train', 'dev', 'test', 'testall']",
        ("test", "testall"): f"{tmp_path}: 3 image ids occur in more than one split of "
        "['test', 'testall']; import overlapping splits (test, testall) separately",
        ("train", "test"): f"{tmp_path}: splits ['train', 'test'] have different feature shapes",
    }
    for splits, message in cases.items():
        with pytest.raises(IngestError) as err:
            import_precomp(tmp_path, list(splits), *out)
        assert str(err.value) == message


def test_import_precomp_records_what_made_the_store(tmp_path):
    src = tmp_path / "p"
    src.mkdir()
    make_precomp(src, "train", 5)
    make_precomp(src, "dev", 2, ids=False)
    shards, messages = [], []

    def progress(items):
        shards.append(list(items))
        return shards[-1]

    args = (src, ["train", "dev"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    manifest = import_precomp(*args, progress=progress, log=messages.append)
    assert shards == [[0, 1]] and messages == []  # 7 images, 4 a shard
    assert manifest.table["path"].to_pylist() == [""] * 7  # precomp has no image files
    store = Store.open(tmp_path / "r.zarr", kind="regions")
    assert store.samples_per_shard == 4 and store.samples_per_chunk == 2
    assert store.attrs["inputs"] == {
        "extractor": "import-precomp",
        "version": "1",
        "params": {"folder": "p", "splits": ["train", "dev"]},
        "weights_digest": None,
        "manifest_digest": manifest.digest,
    }
    import_precomp(*args, log=messages.append)  # the same inputs again: kept, and said
    assert messages == [f"store {tmp_path / 'r.zarr'}: complete, made from the same inputs; kept"]


@pytest.mark.filterwarnings("error")  # an overflow to float16 is noted, never a warning
@pytest.mark.parametrize("bad", [10, 11])
def test_non_finite_images_are_listed_ten_at_most(tmp_path, bad):
    ims = make_precomp(tmp_path, "test", 12, per_image=1, ids=False)
    ims[:bad, 0, 0] = 1e9  # finite as float32, infinite as float16
    np.save(tmp_path / "test_ims.npy", ims)
    messages = []
    import_precomp(
        tmp_path, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG, log=messages.append
    )
    listed = ", ".join(f"test_{i:06d} (features)" for i in range(10))
    more = ", ..." if bad > 10 else ""
    assert messages == [
        f"import: {bad} images stored empty (valid = 0) for non_finite: {listed}{more} "
        "(Store.notes() lists them all)"
    ]
    notes = Store.open(tmp_path / "r.zarr").notes()
    assert len(notes) == bad
    assert notes["test_000000"] == ["non_finite", "features: NaN or infinite values"]


def test_export_pads_cuts_and_writes_float32_past_one_block(tmp_path):
    """600 images: more than two blocks of 256; regions padded with zeros or cut."""
    ims = make_precomp(tmp_path, "test", 600, per_image=1, ids=False, regions=2, dim=4)
    layout = StoreConfig(samples_per_shard=256, samples_per_chunk=64)
    manifest = import_precomp(
        tmp_path, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", layout
    )
    store = Store.open(tmp_path / "r.zarr")
    stored = ims.astype(np.float16).astype(np.float32)
    export_precomp(store, manifest, "test", tmp_path / "pad", n_regions=3)
    padded = np.load(tmp_path / "pad" / "test_ims.npy")
    assert padded.dtype == np.float32 and padded.shape == (600, 3, 4)
    np.testing.assert_array_equal(padded[:, :2], stored)
    assert not padded[:, 2].any()
    export_precomp(store, manifest, "test", tmp_path / "cut", n_regions=1)
    np.testing.assert_array_equal(np.load(tmp_path / "cut" / "test_ims.npy"), stored[:, :1])


def test_export_refusals_and_captions_word_for_word(tmp_path):
    make_precomp(tmp_path, "test", 3, ids=False)
    manifest = import_precomp(tmp_path, ["test"], tmp_path / "m.parquet", tmp_path / "r.zarr", CFG)
    store = Store.open(tmp_path / "r.zarr", manifest_digest=manifest.digest)

    def other(records, name):
        write_manifest(records, Dataset("x", records), 2, tmp_path / f"{name}.parquet")
        return read_manifest(tmp_path / f"{name}.parquet")

    keys = [f"test_{i:06d}" for i in range(3)]
    uneven = other([Record(k, "", "test", ["a"] * (2 + (k == keys[1]))) for k in keys], "u")
    with pytest.raises(IngestError) as err:
        export_precomp(store, uneven, "test", tmp_path / "e")
    assert str(err.value) == (
        "split test: images have [2, 3] captions; the precomp layout needs the same number "
        "for every image"
    )
    stranger = other([Record("test_000009", "", "test", ["a", "b"])], "s")
    with pytest.raises(StoreError) as err:
        export_precomp(store, stranger, "test", tmp_path / "e")
    assert str(err.value) == (
        f"{tmp_path / 'r.zarr'}: no sample with key 'test_000009'; export with the manifest "
        "the store was built from"
    )
    # a caption holding a line break stays one line of the captions file
    broken = other([Record(k, "", "test", ["a dog\nrunning", "x"]) for k in keys], "b")
    export_precomp(store, broken, "test", tmp_path / "e")
    assert (tmp_path / "e" / "test_caps.txt").read_text() == "a dog running\nx\n" * 3


def b64(values) -> str:
    return base64.b64encode(np.asarray(values, np.float32).tobytes()).decode()


def tsv_line(image_id, boxes, feats, w=640, h=480, n=None, end="\n") -> str:
    n = len(np.asarray(boxes).reshape(-1, 4)) if n is None else n
    return "\t".join(map(str, [image_id, w, h, n, b64(boxes), b64(feats)])) + end


def tsv_manifest(tmp_path, n):
    src = tmp_path / "src"
    src.mkdir()
    make_precomp(src, "test", n, per_image=1, ids=False, regions=2, dim=2)
    return import_precomp(src, ["test"], tmp_path / "m.parquet", tmp_path / "x.zarr", CFG)


def test_tsv_rows_refused_word_for_word(tmp_path):
    rng = np.random.default_rng(0)
    boxes, feats = rng.random((3, 4)) * 100, rng.random((3, 8))
    tail = feats.astype(np.float32).copy()
    tail.view(np.uint8)[-1] = 0x17  # the last base64 character is an 'X'
    assert b64(tail).endswith("X")
    good = b64(boxes)
    bad_rows = {
        0: f"0\t640\t480\t3\t{good[:8]}*{good[8:]}\t{b64(feats)}\n",
        1: tsv_line(1, boxes, tail),
        2: f"2\t640\t480\t1\t{base64.b64encode(bytes(15)).decode()}\t{b64(feats[:1])}\n",
        3: f"3\t640\t480\t3\t{good}\t{base64.b64encode(bytes(28)).decode()}\n",
        4: tsv_line(4, [1.0, 2.0, 3.0], feats[:2], n=2),
        5: tsv_line(5, boxes[:1], feats[:0], n=0),
        6: "6\t640\t480\t0\t\t\n",
        7: tsv_line(7, boxes, feats, n="x"),
        8: tsv_line(8, boxes, feats, n=-1),
        9: tsv_line(9, boxes, feats, w=-1),
        10: tsv_line(10, boxes, feats, h=-1),
        11: tsv_line(11, boxes, feats, n=100_001),
        12: tsv_line(12, boxes[0, :1], feats, n=100_000),
        13: tsv_line(13, boxes[:2], feats[:2], w=0, h=0, end="\r\n"),
        14: "14\t640\t480\t3\tAAAA\n",
        15: tsv_line(15, boxes, feats)[:-3] + "\xe9=\n",
        16: tsv_line(16, np.where(boxes == boxes[1, 1], np.inf, boxes), np.full((3, 8), np.nan)),
        17: tsv_line(17, boxes, feats[:, :4]),
    }
    (tmp_path / "a.tsv").write_bytes("".join(bad_rows.values()).encode("latin-1") + b"\n")
    manifest = tsv_manifest(tmp_path, 18)
    messages = []
    missing = import_butd_tsv(
        [tmp_path / "a.tsv"], manifest, tmp_path / "r.zarr", CFG, log=messages.append
    )
    assert missing == []
    at = f"{tmp_path / 'a.tsv'}"
    fields = "image_id, image_w, image_h, num_boxes, boxes, features"
    malformed = {
        0: f"{at}:1: boxes is not base64",
        2: f"{at}:3: boxes: 15 bytes do not hold 1 rows of float32",
        3: f"{at}:4: features: 28 bytes do not hold 3 rows of float32",
        4: f"{at}:5: boxes: 3 values for 2 rows of 4",
        5: f"{at}:6: boxes: values for 0 boxes",
        6: f"{at}:7: features of 0 values per box, others 8",
        7: f"{at}:8: num_boxes, image_w and image_h must be integers",
        8: f"{at}:9: num_boxes -1, image 640x480 out of range",
        9: f"{at}:10: num_boxes 3, image -1x480 out of range",
        10: f"{at}:11: num_boxes 3, image 640x-1 out of range",
        11: f"{at}:12: num_boxes 100001, image 640x480 out of range",
        12: f"{at}:13: boxes: 1 values for 100000 rows of 4",
        14: f"{at}:15: 5 tab-separated fields, expected 6 ({fields})",
        15: f"{at}:16: not ASCII (base64) text",
        17: f"{at}:18: features of 4 values per box, others 8",
    }
    expected = {f"test_{i:06d}": ["malformed_row", m] for i, m in malformed.items()}
    expected["test_000016"] = ["non_finite", "features, boxes: NaN or infinite values"]
    store = Store.open(tmp_path / "r.zarr", kind="regions")
    assert store.notes() == expected
    data = store.read(0, 18)
    assert np.flatnonzero(data["valid"]).tolist() == [1, 13]
    assert data["n_regions"].tolist() == [0, 3] + [0] * 11 + [2] + [0] * 4
    np.testing.assert_array_equal(data["features"][1, :3], tail.astype(np.float16))
    assert data["image_hw"][13].tolist() == [0, 0]  # size unknown: 0 x 0 is taken
    first = ", ".join(f"test_{i:06d} ({at})" for i in list(malformed)[:10])
    assert messages == [
        f"import: 15 images stored empty (valid = 0) for malformed_row: {first}, ... "
        "(Store.notes() lists them all)",
        "import: 1 images stored empty (valid = 0) for non_finite: test_000016 (features, "
        "boxes) (Store.notes() lists them all)",
    ]


NOT_ASCII = b"\xff" * 50


def test_tsv_files_refused_word_for_word(tmp_path):
    manifest = tsv_manifest(tmp_path, 2)
    rng = np.random.default_rng(0)
    (tmp_path / "ids.tsv").write_bytes(NOT_ASCII + b"\t640\n")
    (tmp_path / "far.tsv").write_text(tsv_line(999, rng.random((2, 4)), rng.random((2, 8))))
    (tmp_path / "bad.tsv").write_text("0\t1\t1\t1\tAAAA\tAAAA\n1\t1\t1\t1\tAAAA\tAAAA\n")
    (tmp_path / "folder.tsv").mkdir()
    out = tmp_path / "r.zarr"
    fields = "image_id, image_w, image_h, num_boxes, boxes, features"
    cases = {
        "ids.tsv": f"{tmp_path / 'ids.tsv'}:1: image_id {NOT_ASCII[:40]!r} is not ASCII text; "
        "is this a bottom-up-attention TSV file?",
        "far.tsv": f"{tmp_path / 'far.tsv'}: no TSV image_id matches a manifest key (e.g. "
        "'test_000000' vs '999')",
        "bad.tsv": f"{tmp_path / 'bad.tsv'}: no row of the 2 matched images can be parsed as "
        f"{fields} with boxes; is this a bottom-up-attention TSV file?",
        "folder.tsv": f"{tmp_path / 'folder.tsv'}: cannot read (Is a directory)",
    }
    for name, message in cases.items():
        with pytest.raises(IngestError) as err:
            import_butd_tsv([tmp_path / name], manifest, out, CFG)
        assert str(err.value) == message
    with pytest.raises(IngestError) as err:
        import_butd_tsv([tmp_path / "far.tsv"], manifest, out, CFG, max_regions=0)
    assert str(err.value) == "--max-regions 0: expected 1 or more"
    write_manifest([], Dataset("none", []), 1, tmp_path / "none.parquet")
    with pytest.raises(IngestError) as err:
        import_butd_tsv([tmp_path / "far.tsv"], read_manifest(tmp_path / "none.parquet"), out, CFG)
    assert str(err.value).endswith("(e.g. None vs '999')")
    assert not out.exists()


def test_import_tsv_records_what_made_the_store(tmp_path):
    manifest = tsv_manifest(tmp_path, 7)
    rng = np.random.default_rng(0)
    rows = [tsv_line(i, rng.random((40, 4)) * 9, rng.random((40, 8))) for i in (0, 1, 3, 5)]
    (tmp_path / "b.tsv").write_text("".join(rows[:2]))
    (tmp_path / "a.tsv").write_text("".join(rows[2:]))
    files = [tmp_path / "b.tsv", tmp_path / "a.tsv"]
    shards, messages = [], []

    def progress(items):
        shards.append(list(items))
        return shards[-1]

    missing = import_butd_tsv(
        files, manifest, tmp_path / "r.zarr", CFG, progress=progress, log=messages.append
    )
    assert missing == ["test_000002", "test_000004", "test_000006"]
    assert shards == [[0, 1]] and messages == []  # images with no row: not a problem to log
    store = Store.open(tmp_path / "r.zarr", kind="regions")
    assert store.fields["features"].shape == (36, 8)  # 36 regions unless told
    assert store.read(0, 7)["n_regions"].tolist() == [36, 36, 0, 36, 0, 36, 0]
    assert store.samples_per_shard == 4
    assert store.notes()["test_000002"] == ["no_tsv_row", "no TSV row matches this key"]
    assert store.attrs["inputs"] == {
        "extractor": "import-butd-tsv",
        "version": "1",
        "params": {"files": ["a.tsv", "b.tsv"], "max_regions": 36},
        "weights_digest": None,
        "manifest_digest": manifest.digest,
    }
    import_butd_tsv(files, manifest, tmp_path / "r.zarr", CFG, log=messages.append)
    assert messages == [f"store {tmp_path / 'r.zarr'}: complete, made from the same inputs; kept"]
    one = import_butd_tsv(files, manifest, tmp_path / "one.zarr", CFG, max_regions=1)
    assert one == missing
    assert Store.open(tmp_path / "one.zarr").read(0, 2)["n_regions"].tolist() == [1, 1]
