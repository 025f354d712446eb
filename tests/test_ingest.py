"""Ingestion: readers for Karpathy JSON, UPMC Food-101 and the demo; validation; manifest."""

import csv
import json
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pytest

from features.demo import DemoConfig, build_dataset
from features.ingest.manifest import MANIFEST_COLUMNS, IngestError, read_manifest, write_manifest
from features.ingest.prepare import prepare
from features.ingest.readers import READERS, PrepareConfig
from features.ingest.validate import check_path, validate
from flows.cli import main

FIVE = ["a dog runs.", "a brown dog.", "dog on grass.", "the dog plays.", "an animal."]


def touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG fake")


def sentences(raws):
    return [{"raw": r, "tokens": r.split()} for r in raws]


@pytest.fixture
def karpathy(tmp_path):
    """A Flickr/COCO-style Karpathy JSON with one of each problem, and its images."""
    images = tmp_path / "images"
    entries = [  # (filepath, filename, split, captions)
        ("", "good.jpg", "train", FIVE),
        ("val2014", "COCO_val2014_01.jpg", "val", FIVE),  # COCO layout: filepath + filename
        ("", "rest.jpg", "restval", FIVE),
        ("", "test1.jpg", "test", FIVE),
        ("", "missing.jpg", "train", FIVE),
        ("", "emptycap.jpg", "train", FIVE[:4] + ["   "]),
        ("", "six.jpg", "train", FIVE + ["one more."]),
        ("..", "escape.jpg", "train", FIVE),  # exists, but outside the images root
        ("", "good.jpg", "val", FIVE),  # duplicate key
        ("", "adir.jpg", "train", FIVE),  # a directory, not a file
        ("", "weird.jpg", "dev", FIVE),
        ("", "allempty.jpg", "train", ["", " "]),
    ]
    data = {"dataset": "flickr30k", "images": []}
    for i, (filepath, filename, split, raws) in enumerate(entries):
        data["images"].append(
            {
                "filepath": filepath,
                "filename": filename,
                "split": split,
                "imgid": i,
                "sentences": sentences(raws),
            }
        )
        if filename not in ("missing.jpg", "adir.jpg"):
            touch(images / filepath / filename)
    (images / "adir.jpg").mkdir()
    # one caption with bytes that are not UTF-8, written into the JSON as raw bytes
    data["images"].append(
        {
            "filename": "latin1.jpg",
            "split": "train",
            "sentences": sentences(FIVE[:4] + ["CAF_MARKER"]),
        }
    )
    touch(images / "latin1.jpg")
    raw = json.dumps(data).encode().replace(b"CAF_MARKER", b"caf\xe9 au lait")
    (tmp_path / "dataset_flickr30k.json").write_bytes(raw)
    return tmp_path / "dataset_flickr30k.json", images


def run_reader(fmt, annotations, images, **cfg):
    cfg = PrepareConfig(format=fmt, **cfg)
    dataset = READERS[fmt](annotations, images, cfg)
    return dataset, *validate(
        dataset, images, cfg.captions_per_image, allow_symlinks_outside=cfg.allow_symlinks_outside
    )


def test_karpathy_reader_validates_every_problem(karpathy):
    dataset, records, report = run_reader("karpathy", *karpathy)
    kept = {r.key: r for r in records}
    assert set(kept) == {"good", "COCO_val2014_01", "rest", "test1", "emptycap", "six", "latin1"}
    assert kept["COCO_val2014_01"].path == "val2014/COCO_val2014_01.jpg"
    assert kept["rest"].split == "train"  # restval merged into train by default
    assert kept["good"].split == "train"  # the first of two duplicates wins
    assert kept["emptycap"].captions == FIVE[:4]
    assert len(kept["six"].captions) == 6 and kept["latin1"].captions == FIVE[:4]
    counts = report.counts()
    assert counts == {
        "malformed_record": 0,
        "missing_image": 1,
        "unreadable_path": 1,
        "path_escapes_root": 1,
        "duplicate_key": 1,
        "unknown_split": 1,
        "empty_caption": 3,
        "non_utf8_text": 1,
        "no_captions": 1,
        "bad_label": 0,
        "bad_boxes": 0,
        "bad_box_names": 0,
        "bad_box_attributes": 0,
        "symlink_escapes_root": 0,
        "caption_count": 3,
    }
    assert report.records_read == 13 and report.records_kept == 7
    assert report.records_with_errors == 8
    reasons = {(i.key, i.reason) for i in report.errors}
    assert ("missing", "missing_image") in reasons and ("latin1", "non_utf8_text") in reasons
    assert ("escape", "path_escapes_root") in reasons and ("weird", "unknown_split") in reasons


def test_restval_can_be_kept(karpathy):
    _, records, _ = run_reader("karpathy", *karpathy, restval="keep")
    assert {r.key: r.split for r in records}["rest"] == "restval"


def test_path_checks(tmp_path):
    touch(tmp_path / "a" / "x.jpg")
    assert check_path(tmp_path, "a/./x.jpg") == ("a/x.jpg", None, "")
    assert check_path(tmp_path, "a/../a/x.jpg")[1] is None  # stays inside: fine
    assert check_path(tmp_path, "a/../../x.jpg")[1] == "path_escapes_root"
    assert check_path(tmp_path, "/etc/passwd")[1] == "path_escapes_root"
    assert check_path(tmp_path, "")[1] == "unreadable_path"
    assert check_path(tmp_path, "a")[1] == "unreadable_path"
    (tmp_path / "link.jpg").symlink_to(tmp_path / "a" / "x.jpg")  # DVC symlink caches
    assert check_path(tmp_path, "link.jpg")[1] is None


def test_not_a_karpathy_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"annotations": []}')
    with pytest.raises(IngestError, match="no top-level 'images' list"):
        READERS["karpathy"](bad, tmp_path, PrepareConfig())
    bad.write_text("{oops")
    with pytest.raises(IngestError, match="not valid JSON"):
        READERS["karpathy"](bad, tmp_path, PrepareConfig())


DOCUMENTS = [  # read as json.loads reads them, images aside
    '{"images": [{"filename": "a.jpg"}, {"filename": "b.jpg"}], "dataset": "coco"}',
    ' \n{ "dataset" : "f30k" ,\r\n\t"images" : [ ] , "class_names": ["x", "y"] } \n',
    '{"images": [{"sentences": [{"raw": "a ] , } [ { \\" quote \\u00e9"}]}, 3, null, "s"]}',
    '{"images": {"filename": "a.jpg"}}',  # not a list
    '{"dataset": "coco"}',
    "{}",
    "[1, 2]",
    '"images"',
    '{"images": [1, 2], "images2": [3]}',
    '{"images": [NaN, -Infinity, 1e400]}',
]
MALFORMED = [
    "",
    "{oops",
    '{"images": [1, 2}',
    '{"images": [1, 2],}',
    '{"images": [1, 2,]}',
    '{"images": [1 2]}',
    '{"images" [1]}',
    "{images: [1]}",
    '{"images": [1]} x',
    '{"images": [1]',
    '{"images": [{"a": 1}], "dataset": "coco"',
    '{"images": [1], "x": }',
    '{"images": ["\x01"]}',  # a control character in a string
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_karpathy_images_are_decoded_one_at_a_time_as_json_loads_would(text):
    from features.ingest.readers import _scan_object

    items = []
    members = _scan_object(text, "images", items.append)
    whole = json.loads(text)
    if isinstance(whole, dict) and isinstance(whole.get("images"), list):
        assert items == whole.pop("images")
        assert members == whole
    else:
        assert members is None


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_karpathy_json_fails_as_json_loads_does(text):
    from features.ingest.readers import _scan_object

    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        _scan_object(text, "images", lambda item: None)


@pytest.fixture
def food101(tmp_path):
    images, texts = tmp_path / "images", tmp_path / "texts"
    texts.mkdir()
    rows = {"train": [], "test": []}
    for split in rows:
        for cls in ("pizza", "apple_pie", "sushi"):
            for i in range(10):
                name = f"{cls}_{split}_{i}.jpg"
                touch(images / split / cls / name)
                rows[split].append([name, f"best {cls} recipe number {i}", cls])
    rows["train"].append(["ghost.jpg", "a missing picture", "pizza"])
    rows["test"].append(["pizza_test_0.jpg", "again", "pizza"])  # duplicate key
    for split, split_rows in rows.items():
        with open(texts / f"{split}_titles.csv", "w", newline="") as f:
            writer = csv.writer(f)
            if split == "train":
                writer.writerow(["image name", "text", "class"])
            writer.writerows(split_rows)
    with open(texts / "train_titles.csv", "ab") as f:
        f.write(b'sushi_train_0b.jpg,"sushi \xff\xfe",sushi\n')
    touch(images / "train" / "sushi" / "sushi_train_0b.jpg")
    return texts, images


def test_food101_reader(food101):
    dataset, records, report = run_reader(
        "food101", *food101, captions_per_image=1, val_fraction=0.3
    )
    assert dataset.class_names == ["apple_pie", "pizza", "sushi"]
    by_key = {r.key: r for r in records}
    assert by_key["pizza_test_3"].path == "test/pizza/pizza_test_3.jpg"
    assert by_key["pizza_test_3"].label == 1 and by_key["pizza_test_3"].split == "test"
    assert by_key["sushi_train_2"].captions == ["best sushi recipe number 2"]
    splits = [r.split for r in records]
    assert splits.count("test") == 30 and 0 < splits.count("val") < 20
    assert splits.count("train") + splits.count("val") == 30
    counts = report.counts()
    assert counts["missing_image"] == 1 and counts["duplicate_key"] == 1
    assert counts["non_utf8_text"] == 1 and counts["no_captions"] == 1
    # the val hold-out depends on the key and seed only, not on row order
    _, again, _ = run_reader("food101", *food101, captions_per_image=1, val_fraction=0.3)
    assert [r.split for r in again] == splits


def test_demo_dataset_reads_labels_and_boxes(tmp_path):
    build_dataset(DemoConfig(n_train=3, n_val=2, n_test=2), tmp_path)
    dataset, records, report = run_reader("demo", tmp_path / "dataset.json", tmp_path / "images")
    assert report.errors == [] and report.warnings == [] and len(records) == 7
    assert dataset.name == "demo" and len(dataset.class_names) == 6
    assert all(r.label is not None and len(r.boxes) == len(r.box_names) >= 2 for r in records)
    data = json.loads((tmp_path / "dataset.json").read_text())
    for record, image in zip(records, data["images"], strict=True):
        expected = [[o["color"], o["size"]] for o in image["objects"]]
        assert record.box_attributes == expected  # one list per box: colour, size


def test_box_attributes_are_validated_and_stored(tmp_path, karpathy):
    annotations, images = karpathy
    data = json.loads(annotations.read_bytes().replace(b"\xe9", b"e"))
    good = data["images"][0]
    good.update(boxes=[[0, 0, 5, 5], [1, 1, 4, 4.5]], box_names=["dog", "ball"])
    good["box_attributes"] = [["brown", "small"], []]
    bad = data["images"][3]  # test1.jpg: one attribute list for two boxes
    bad.update(boxes=[[0, 0, 5, 5], [1, 1, 4, 4]], box_names=["a", "b"], box_attributes=[["x"]])
    annotations.write_text(json.dumps(data))
    dataset, records, report = run_reader("karpathy", annotations, images)
    problems = [(i.key, i.detail) for i in report.errors if i.reason == "bad_box_attributes"]
    assert ("test1", "1 box_attributes for 2 boxes") in problems
    assert "test1" not in {r.key for r in records}
    write_manifest(records, dataset, 5, tmp_path / "m.parquet")
    manifest = read_manifest(tmp_path / "m.parquet")
    rows = {r["key"]: r for r in manifest.table.to_pylist()}
    assert rows["good"]["box_attributes"] == [["brown", "small"], []]
    assert rows["rest"]["box_attributes"] is None
    field = manifest.table.schema.field("box_attributes")
    assert field.type == pa.list_(pa.list_(pa.string())) and field.nullable


def test_datasets_without_attributes_keep_their_digest_and_old_manifests_read(tmp_path, karpathy):
    """box_attributes came with manifest version 2: null values stay out of the digest, and
    a version-1 manifest (no such column) reads as all-null."""
    import hashlib

    import pyarrow.parquet as pq

    dataset, records, _ = run_reader("karpathy", *karpathy)
    meta = write_manifest(records, dataset, 5, tmp_path / "m.parquet")
    h = hashlib.sha256(json.dumps(dataset.class_names).encode())
    v1_columns = ["key", "path", "split", "captions", "label", "boxes", "box_names"]
    for r in records:  # the version-1 digest, written out
        row = {c: getattr(r, c) for c in v1_columns}
        h.update(json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    assert meta["digest"] == h.hexdigest()
    table = pq.read_table(tmp_path / "m.parquet").drop_columns(["box_attributes"])
    old_meta = {**meta, "schema_version": 1}
    pq.write_table(
        table.replace_schema_metadata({"vse": json.dumps(old_meta)}), tmp_path / "v1.parquet"
    )
    old = read_manifest(tmp_path / "v1.parquet")
    assert old.table.column_names == MANIFEST_COLUMNS and old.digest == meta["digest"]
    assert old.table["box_attributes"].null_count == len(old)


def test_manifest_round_trip_and_digest(tmp_path, karpathy):
    build_dataset(DemoConfig(n_train=3, n_val=2, n_test=2), tmp_path / "demo")
    dataset, records, _ = run_reader(
        "demo", tmp_path / "demo/dataset.json", tmp_path / "demo/images"
    )
    meta = write_manifest(records, dataset, 5, tmp_path / "m.parquet")
    manifest = read_manifest(tmp_path / "m.parquet")
    assert manifest.table.column_names == MANIFEST_COLUMNS and len(manifest) == 7
    assert manifest.digest == meta["digest"] and manifest.class_names == dataset.class_names
    row = manifest.table.slice(0, 1).to_pylist()[0]
    assert row["key"] == "train_00000" and len(row["captions"]) == 5
    assert row["boxes"][0] == pytest.approx(records[0].boxes[0])
    assert manifest.table.schema.field("boxes").type == pa.list_(pa.list_(pa.float32(), 4))
    assert len(manifest.split("val")) == 2
    # the digest follows the content
    records[0].captions = records[0].captions[:4]
    assert write_manifest(records, dataset, 5, tmp_path / "m2.parquet")["digest"] != meta["digest"]
    # Karpathy rows have no label or boxes: nulls, not fake values
    k_dataset, k_records, _ = run_reader("karpathy", *karpathy)
    write_manifest(k_records, k_dataset, 5, tmp_path / "k.parquet")
    k_row = read_manifest(tmp_path / "k.parquet").table.to_pylist()[0]
    assert k_row["label"] is None and k_row["boxes"] is None


def test_read_manifest_errors(tmp_path):
    with pytest.raises(IngestError, match="run `vse prepare` first"):
        read_manifest(tmp_path / "none.parquet")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(IngestError, match="not a vse manifest"):
        read_manifest(tmp_path / "other.parquet")


def prepare_cli(tmp_path, karpathy, max_error_fraction):
    params = tmp_path / "params.yaml"
    params.write_text(f"prepare:\n  format: karpathy\n  max_error_fraction: {max_error_fraction}\n")
    annotations, images = karpathy
    out = tmp_path / "out"
    args = [
        "--params",
        str(params),
        "prepare",
        "--annotations",
        str(annotations),
        "--images",
        str(images),
        "--out",
        str(out / "manifest.parquet"),
        "--errors",
        str(out / "errors.csv"),
        "--metrics",
        str(out / "metrics.json"),
    ]
    return out, args


def test_prepare_cli_reports_and_finishes(tmp_path, karpathy):
    out, args = prepare_cli(tmp_path, karpathy, 0.7)
    result = subprocess.run(["vse", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "read 13 records, kept 7" in result.stdout
    assert "missing_image 1" in result.stdout and "empty_caption 3" in result.stdout
    assert read_manifest(out / "manifest.parquet").table.num_rows == 7
    with open(out / "errors.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["key"], r["severity"], r["reason"]) for r in rows} >= {
        ("missing", "error", "missing_image"),
        ("six", "warning", "caption_count"),
    }
    assert sum(r["severity"] == "warning" for r in rows) == 3
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["records_kept"] == 7 and metrics["counts"]["duplicate_key"] == 1


def test_prepare_cli_fails_over_the_error_threshold(tmp_path, karpathy, capsys):
    out, args = prepare_cli(tmp_path, karpathy, 0)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "8 of 13 records" in err and str(out / "errors.csv") in err
    assert (out / "errors.csv").exists() and not (out / "manifest.parquet").exists()


def karpathy_with(tmp_path, images: list[dict], **top):
    """A Karpathy JSON of the given image entries (five captions each unless given), with
    their image files."""
    root = tmp_path / "images"
    for image in images:
        image.setdefault("split", "train")
        image.setdefault("sentences", sentences(FIVE))
        if isinstance(image.get("filename"), str) and image["filename"]:
            touch(root / image["filename"])
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps({"dataset": "x", "images": images, **top}))
    return path, root


def test_malformed_optional_fields_are_error_rows_never_a_crash(tmp_path):
    """The record is dropped as an error (reason, key, detail), the rest is written."""
    bad = {
        "l_text": {"label": "cat"},
        "l_big": {"label": 2**40},
        "l_neg": {"label": -1},
        "l_bool": {"label": True},
        "l_range": {"label": 6},
        "b_three": {"boxes": [[1, 2, 3]]},
        "b_text": {"boxes": [["a", 1, 2, 3]]},
        "b_flat": {"boxes": [1, 2, 3, 4]},
        "b_nan": {"boxes": [[0, 0, float("nan"), 4]]},
        "b_huge": {"boxes": [[0, 0, 1e39, 4]]},
        "b_order": {"boxes": [[5, 0, 1, 4]]},
        "b_str": {"boxes": "0 0 1 1"},
        "n_ints": {"boxes": [[0, 0, 1, 1]], "box_names": [1]},
        "n_count": {"boxes": [[0, 0, 1, 1]], "box_names": ["a", "b"]},
        "n_alone": {"box_names": ["a"]},
        "n_str": {"boxes": [[0, 0, 1, 1]], "box_names": "a"},
    }
    images = [{"filename": "ok.jpg", "label": 3, "boxes": [[0, 0, 2, 2]], "box_names": ["x"]}]
    images += [{"filename": f"{key}.jpg", **fields} for key, fields in bad.items()]
    annotations, root = karpathy_with(tmp_path, images, class_names=list("abcdef"))
    cfg = PrepareConfig(format="demo", max_error_fraction=1.0)
    out = tmp_path / "out"
    summary = prepare(
        annotations, root, cfg, out / "m.parquet", out / "e.csv", out / "j.json", log=print
    )
    assert summary["records_kept"] == 1
    manifest = read_manifest(out / "m.parquet").table.to_pylist()
    assert [r["key"] for r in manifest] == ["ok"] and manifest[0]["label"] == 3
    with open(out / "e.csv") as f:
        rows = {r["key"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(bad)
    for key, row in rows.items():
        reason = {"l": "bad_label", "b": "bad_boxes", "n": "bad_box_names"}[key[0]]
        assert (row["severity"], row["reason"]) == ("error", reason), key
        assert row["detail"]
    assert summary["counts"]["bad_boxes"] == 7 and summary["counts"]["bad_label"] == 5


def test_a_symlink_out_of_the_images_root_is_refused(tmp_path):
    repo = tmp_path / "repo"
    images = repo / "data" / "images"
    touch(images / "inside.jpg")
    touch(tmp_path / "secret" / "outside.jpg")
    touch(repo / ".dvc" / "cache" / "files" / "md5" / "ab" / "cdef")
    (images / "evil.jpg").symlink_to(tmp_path / "secret" / "outside.jpg")
    (images / "dir").symlink_to(tmp_path / "secret")  # a folder link leaving the root
    (images / "dvc.jpg").symlink_to(repo / ".dvc" / "cache" / "files" / "md5" / "ab" / "cdef")
    (images / "alias.jpg").symlink_to("inside.jpg")  # stays inside: fine
    entries = [{"filename": n} for n in ("inside.jpg", "evil.jpg", "dvc.jpg", "alias.jpg")]
    entries.append({"filename": "outside.jpg", "filepath": "dir"})
    annotations = tmp_path / "d.json"
    annotations.write_text(
        json.dumps(
            {"images": [{"split": "train", "sentences": sentences(FIVE), **e} for e in entries]}
        )
    )
    dataset, records, report = run_reader("karpathy", annotations, images)
    assert {r.key for r in records} == {"inside", "dvc", "alias"}
    assert {(i.key, i.reason) for i in report.errors} == {
        ("evil", "symlink_escapes_root"),
        ("outside", "symlink_escapes_root"),
    }
    assert "allow_symlinks_outside" in report.errors[0].detail
    _, records, report = run_reader("karpathy", annotations, images, allow_symlinks_outside=True)
    assert len(records) == 5 and report.errors == []


def test_two_prepare_runs_on_one_output_do_not_collide(tmp_path):
    build_dataset(DemoConfig(n_train=30, n_val=5, n_test=5), tmp_path / "demo")
    out = tmp_path / "out"
    args = [
        "vse",
        "prepare",
        "--annotations",
        str(tmp_path / "demo/dataset.json"),
        "--images",
        str(tmp_path / "demo/images"),
        "--out",
        str(out / "manifest.parquet"),
        "--errors",
        str(out / "errors.csv"),
        "--metrics",
        str(out / "metrics.json"),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    params = tmp_path / "params.yaml"
    params.write_text("prepare:\n  format: demo\n")
    runs = [
        subprocess.Popen([args[0], "--params", str(params), *args[1:]], env=env) for _ in range(2)
    ]
    assert [p.wait() for p in runs] == [0, 0]
    assert read_manifest(out / "manifest.parquet").table.num_rows == 40
    assert sorted(p.name for p in out.iterdir()) == [
        "errors.csv",
        "manifest.parquet",
        "metrics.json",
    ]
