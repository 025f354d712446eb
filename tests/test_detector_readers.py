"""Strict detector readers (issue 25.2): malformed COCO instances and Visual Genome records
are dropped and reported by key and reason, never coerced (a name string is not a list of
names) and never a traceback; past detector.max_error_fraction the stage stops in one line."""

import csv
import json

import pytest

from features.detector.config import DetectorConfig
from features.detector.data import (
    DetectionDataError,
    read_coco,
    read_visual_genome,
    report_problems,
)
from flows.cli import main

CFG = DetectorConfig(val_fraction=0.0, max_error_fraction=1.0)


def vg_object(object_id, name="man", **box):
    return {"object_id": object_id, "names": [name], "x": 1, "y": 2, "w": 10, "h": 20, **box}


def test_malformed_visual_genome_records_are_dropped_and_reported(tmp_path):
    good = [vg_object(11), vg_object(12, "shirt")]
    objects = [
        {"image_id": 1, "objects": good},
        {
            "image_id": 2,
            "objects": [
                {**vg_object(21), "names": "circle"},  # a string, not a list
                {k: v for k, v in vg_object(22).items() if k != "x"},
                vg_object(23, x="abc"),
                vg_object(24, y=True),
                vg_object(25, "shirt"),
            ],
        },
        {"objects": [vg_object(31)]},  # no image_id
        {"image_id": "4", "objects": [vg_object(41)]},
        "not an image",
    ]
    attributes = [
        {"image_id": 1, "attributes": [{"object_id": 11, "attributes": ["Tall"]}]},
        {"image_id": 2, "attributes": ["red", "round"]},  # strings, not objects
        {"image_id": 5, "attributes": [{"object_id": 12, "attributes": "red"}]},
    ]
    (tmp_path / "objects.json").write_text(json.dumps(objects))
    (tmp_path / "attributes.json").write_text(json.dumps(attributes))
    vg = read_visual_genome(tmp_path / "objects.json", tmp_path / "attributes.json", CFG)
    assert vg.classes == ["man", "shirt"]  # never c, d, h, s, t from "circle"
    assert [(im.key, im.names) for im in vg.images] == [("1", ["man", "shirt"]), ("2", ["shirt"])]
    assert vg.images[0].attributes == [["tall"], []]  # 12's "red" string: reported, not r,e,d
    problems = [(p.key, p.reason) for p in vg.problems]
    assert problems == [
        ("2 attributes", "malformed_attributes"),
        ("2 attributes", "malformed_attributes"),
        ("5 object 12", "malformed_attributes"),
        ("2 object 21", "malformed_names"),
        ("2 object 22", "malformed_box"),
        ("2 object 23", "malformed_box"),
        ("2 object 24", "malformed_box"),
        ("objects.json[2]", "malformed_image"),
        ("objects.json[3]", "malformed_image"),
        ("objects.json[4]", "malformed_image"),
    ]
    detail = {p.key: p.detail for p in vg.problems}
    assert detail["2 object 21"] == "names circle: expected a list of strings"
    assert (
        detail["2 object 23"]
        == "{'x': 'abc', 'y': 2, 'w': 10, 'h': 20}: x, y, w, h must be numbers"
    )
    assert vg.dropped == {"malformed_attributes": 3, "malformed_box": 3, "malformed_image": 3,
                          "malformed_names": 1}  # fmt: skip
    assert vg.records_read == 10  # 2 + 5 objects, 3 unreadable images
    summary = vg.summary()
    assert summary["records_read"] == 10 and summary["records_with_errors"] == 9


def coco(images, annotations, categories=({"id": 3, "name": "dog"},)):
    return {"images": images, "annotations": annotations, "categories": list(categories)}


def ann(i, bbox, category_id=3, image_id=7):
    return {"id": i, "image_id": image_id, "bbox": bbox, "category_id": category_id}


def test_malformed_coco_annotations_are_dropped_and_reported(tmp_path):
    image = {"id": 7, "file_name": "000007.jpg", "width": 100, "height": 50}
    annotations = [
        ann(1, [10, 10, 20, 20]),
        ann(2, [10, 10, 20]),  # 3 numbers
        ann(3, [10, 10, 20, 20], category_id=999),  # KeyError: 999 before
        ann(4, [200, 10, 20, 20]),  # wholly right of the 100 px wide image
        ann(5, [10, -40, 20, 30]),  # wholly above
        ann(6, [90, 40, 20, 20]),  # partly outside: kept
        ann(7, ["10", 10, 20, 20]),
        ann(8, [10, 10, 20, 20], image_id=8),
        ["not", "an", "annotation"],
    ]
    (tmp_path / "train.json").write_text(json.dumps(coco([image], annotations)))
    data = read_coco(tmp_path / "train.json", None, CFG)
    assert data.classes == ["dog"] and len(data.images) == 1
    assert data.images[0].boxes == [[10.0, 10.0, 30.0, 30.0], [90.0, 40.0, 110.0, 60.0]]
    reported = {p.key: (p.reason, p.detail) for p in data.problems}
    assert sorted(reported) == [f"train.json:annotation {i}" for i in (2, 3, 4, 5, 7, 8)] + [
        "train.json:annotations[8]"
    ]
    assert reported["train.json:annotation 2"] == (
        "malformed_bbox",
        "bbox [10, 10, 20]: expected [x, y, w, h]",
    )
    assert reported["train.json:annotation 3"] == (
        "unknown_category",
        "category_id 999 is not in train.json's categories",
    )
    assert reported["train.json:annotation 4"] == (
        "box_outside_image",
        "bbox [200, 10, 20, 20] lies outside the 100x50 image 000007.jpg",
    )
    assert reported["train.json:annotation 5"][0] == "box_outside_image"
    assert reported["train.json:annotation 7"][0] == "malformed_bbox"
    assert reported["train.json:annotation 8"] == (
        "unknown_image",
        "image_id 8 is not in train.json's images",
    )
    assert reported["train.json:annotations[8]"] == ("malformed_annotation", "list, not an object")
    assert data.records_read == 9 and len(data.problems) == 7
    # a category that is not {id, name} is the file's problem: one line
    bad = coco([image], [], categories=[{"id": "3", "name": "dog"}])
    (tmp_path / "cats.json").write_text(json.dumps(bad))
    with pytest.raises(DetectionDataError) as err:
        read_coco(tmp_path / "cats.json", None, CFG)
    assert str(err.value) == (
        f"{tmp_path / 'cats.json'}: category {{'id': '3', 'name': 'dog'}} is not "
        "{'id': integer, 'name': text}; fix the categories list"
    )


def test_the_error_report_and_the_fraction_that_fails_the_stage(tmp_path, repo_root, capsys):
    objects = [{"image_id": 1, "objects": [vg_object(1), {**vg_object(2), "names": "circle"}]}]
    (tmp_path / "objects.json").write_text(json.dumps(objects))
    vg = read_visual_genome(tmp_path / "objects.json", None, CFG)
    report_problems(vg, CFG.model_copy(update={"max_error_fraction": 0.5}), tmp_path / "e.csv")
    with open(tmp_path / "e.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["key", "severity", "reason", "detail"],
        ["1 object 2", "error", "malformed_names", "names circle: expected a list of strings"],
    ]
    strict = CFG.model_copy(update={"max_error_fraction": 0.4})
    with pytest.raises(DetectionDataError) as err:
        report_problems(vg, strict, tmp_path / "e.csv")
    assert str(err.value) == (
        "1 of 2 annotation records (50.00%) are malformed, more than "
        f"detector.max_error_fraction = 40.00%; see {tmp_path / 'e.csv'}"
    )
    # through the command: one line, before any training, and the report is there
    (tmp_path / "images").mkdir()
    out = tmp_path / "det"
    code = main(["--params", str(repo_root / "params.yaml"), "train", "detector",
                 "--vg-objects", str(tmp_path / "objects.json"), "--images",
                 str(tmp_path / "images"), "--out", str(out), "--metrics",
                 str(tmp_path / "m.json"), "--plot", str(tmp_path / "p.png")])  # fmt: skip
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err_lines) == 1, err_lines
    assert "1 of 2 annotation records (50.00%) are malformed" in err_lines[0]
    assert (out / "errors.csv").is_file() and not (out / "detector.pt").exists()
