"""Boxes to train the bottom-up detector on, from the formats people train detectors on.

- ``manifest``: a project manifest with ``boxes``, ``box_names`` and (optional)
  ``box_attributes`` (the demo: shape = class; colour and size = attributes); splits from
  the manifest.
- ``coco``: COCO instances JSON (``instances_train2017.json``: ``images``,
  ``annotations`` with ``bbox`` as x, y, w, h and ``category_id``, ``categories``); no
  attributes. Crowd annotations are left out, as in torchvision's COCO recipe. A second
  file (``instances_val2017.json``) gives val; without it ``val_fraction`` of train is held
  out by a seeded hash of the image id.
- ``vg``: Visual Genome ``objects.json`` (per image: objects with ``object_id``,
  ``names``, ``x``, ``y``, ``w``, ``h``) and ``attributes.json`` (per image: objects with
  ``object_id`` and ``attributes``). Names are lower-cased and stripped; the
  ``max_classes`` most frequent object names and ``max_attributes`` most frequent
  attributes of the train split are kept, as bottom-up attention kept 1600 and 400
  (their further merging of synonyms is not reproduced). Images are ``<image_id>.jpg``
  under the images root or its ``VG_100K``/``VG_100K_2`` folders; val is a seeded hash
  hold-out (Visual Genome has no official split).

Every reader returns a :class:`DetectionDataset`: images with boxes in pixels (x1, y1, x2,
y2), class names, per-box attribute lists (or none), and counts of what it left out.
Readers are strict, like ``prepare``: a malformed record (a string where a list of names
belongs, a coordinate that is not a number, a category id not in ``categories``, a box
wholly outside its image) is never coerced; it is dropped and reported by key and reason
(:func:`report_problems` writes them and fails past ``detector.max_error_fraction``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from features.detector.config import DetectorConfig
from features.ingest.manifest import Manifest
from features.ingest.readers import held_out
from features.ingest.validate import Issue, Report, write_errors
from infra.config import UserError, one_line


class DetectionDataError(UserError):
    """Annotations that cannot train a detector; the message names the file and why."""


@dataclass
class DetectionImage:
    key: str
    path: str  # relative to the images root
    split: str
    boxes: list[list[float]]  # (G, 4) x1, y1, x2, y2 in pixels
    names: list[str]  # (G,) class names
    attributes: list[list[str]] | None = None  # (G,) attribute names per box


@dataclass
class DetectionDataset:
    name: str
    images: list[DetectionImage]
    classes: list[str]  # model label k + 1 is classes[k] (0 is background)
    attributes: list[str]  # attribute head class k + 1 is attributes[k] (0: none)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> count
    problems: list[Issue] = field(default_factory=list)  # malformed records, by key
    records_read: int = 0  # annotations (COCO) or objects (Visual Genome) read

    def split(self, name: str) -> list[DetectionImage]:
        return [im for im in self.images if im.split == name]

    def summary(self) -> dict:
        splits = Counter(im.split for im in self.images)
        return {
            "dataset": self.name,
            "images": dict(sorted(splits.items())),
            "boxes": sum(len(im.boxes) for im in self.images),
            "classes": len(self.classes),
            "attributes": len(self.attributes),
            "dropped": dict(sorted(self.dropped.items())),
            "records_read": self.records_read,
            "records_with_errors": len({p.key for p in self.problems}),
        }


def report_problems(dataset: DetectionDataset, cfg: DetectorConfig, errors: Path) -> None:
    """Write every malformed record (``key, severity, reason, detail``, as prepare's
    report) to ``errors``; fail in one line when more than ``max_error_fraction`` of the
    records read were malformed."""
    report = Report(records_read=dataset.records_read, errors=dataset.problems)
    write_errors(report, errors)
    if report.error_fraction > cfg.max_error_fraction:
        raise DetectionDataError(
            f"{report.records_with_errors} of {report.records_read} annotation records "
            f"({report.error_fraction:.2%}) are malformed, more than "
            f"detector.max_error_fraction = {cfg.max_error_fraction:.2%}; see {errors}"
        )


class _Problems:
    """Malformed records of one reader: each dropped, counted by reason, kept by key."""

    def __init__(self, dropped: Counter):
        self.dropped, self.issues = dropped, []

    def __call__(self, key: str, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        self.issues.append(Issue(key, reason, one_line(detail, 300)))


def _number(value) -> bool:
    """A JSON number (not a bool, not a numeric string), finite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _load_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DetectionDataError(f"{path}: no such file ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DetectionDataError(f"{path}: not valid JSON ({what}): {err}") from None


def _valid_box(x1: float, y1: float, x2: float, y2: float) -> bool:
    return x2 > x1 and y2 > y1


def read_manifest_boxes(manifest: Manifest, cfg: DetectorConfig) -> DetectionDataset:
    """Images of a manifest that have boxes; classes and attributes sorted by name. Its
    records are the boxes (prepare has validated them)."""
    images, dropped, boxes_read = [], Counter(), 0
    for row in manifest.table.to_pylist():
        boxes_read += len(row["boxes"] or [])
        if not row["boxes"]:
            dropped["images_without_boxes"] += 1
            continue
        names = row["box_names"] or []
        if len(names) != len(row["boxes"]):
            raise DetectionDataError(
                f"manifest image {row['key']}: {len(row['boxes'])} boxes but "
                f"{len(names)} box_names; a detector needs a name per box (rerun vse prepare)"
            )
        keep = [i for i, b in enumerate(row["boxes"]) if _valid_box(*b)]
        dropped["degenerate_boxes"] += len(row["boxes"]) - len(keep)
        attributes = row.get("box_attributes")
        images.append(
            DetectionImage(
                row["key"],
                row["path"],
                row["split"],
                [list(map(float, row["boxes"][i])) for i in keep],
                [names[i] for i in keep],
                [list(attributes[i] or []) for i in keep] if attributes else None,
            )
        )
    if not images:
        raise DetectionDataError(
            "the manifest has no ground-truth boxes (boxes / box_names columns); a detector "
            "trains on datasets with boxes: the demo, COCO instances or Visual Genome"
        )
    classes = sorted({n for im in images for n in im.names})
    attributes = sorted({a for im in images for attrs in im.attributes or [] for a in attrs})
    return DetectionDataset(
        manifest.dataset, images, classes, attributes, _clean(dropped), records_read=boxes_read
    )


def read_coco(train_json: Path, val_json: Path | None, cfg: DetectorConfig) -> DetectionDataset:
    """COCO instances JSON: train (and val) images with their non-crowd boxes; malformed
    annotations and boxes wholly outside their image are dropped and reported."""
    categories: dict[int, str] = {}
    images: list[DetectionImage] = []
    dropped: Counter = Counter()
    problem = _Problems(dropped)
    read = 0
    for path, split in ((train_json, "train"), (val_json, "val")):
        if path is None:
            continue
        data = _load_json(path, "COCO instances")
        if not isinstance(data, dict) or not all(
            isinstance(data.get(k), list) for k in ("images", "annotations", "categories")
        ):
            raise DetectionDataError(
                f"{path}: expected COCO instances JSON with images, annotations and categories"
            )
        for cat in data["categories"]:
            if (
                not isinstance(cat, dict)
                or not isinstance(cat.get("id"), int)
                or not (isinstance(cat.get("name"), str) and cat["name"].strip())
            ):
                raise DetectionDataError(
                    f"{path}: category {str(cat)[:80]} is not {{'id': integer, 'name': text}}; "
                    "fix the categories list"
                )
            if categories.setdefault(cat["id"], cat["name"]) != cat["name"]:
                raise DetectionDataError(
                    f"{path}: category {cat['id']} is {cat['name']!r} here but "
                    f"{categories[cat['id']]!r} in {train_json}"
                )
        sizes: dict[int, tuple[float, float]] = {}
        files: dict[int, str] = {}
        for i, image in enumerate(data["images"]):
            ok = isinstance(image, dict) and isinstance(image.get("id"), int)
            if not ok or not isinstance(image.get("file_name"), str) or not image["file_name"]:
                problem(f"{path.name}:images[{i}]", "malformed_image", f"{str(image)[:120]}")
                continue
            files[image["id"]] = image["file_name"]
            if _number(image.get("width")) and _number(image.get("height")):
                sizes[image["id"]] = (image["width"], image["height"])
        boxes: dict[int, list] = {}
        for i, ann in enumerate(data["annotations"]):
            read += 1
            has_id = isinstance(ann, dict) and "id" in ann
            key = f"{path.name}:" + (f"annotation {ann['id']}" if has_id else f"annotations[{i}]")
            if not isinstance(ann, dict):
                problem(key, "malformed_annotation", f"{type(ann).__name__}, not an object")
                continue
            if ann.get("iscrowd"):
                dropped["crowd_boxes"] += 1
                continue
            bbox = ann.get("bbox")
            if not isinstance(bbox, list) or len(bbox) != 4 or not all(map(_number, bbox)):
                problem(key, "malformed_bbox", f"bbox {str(bbox)[:80]}: expected [x, y, w, h]")
                continue
            if ann.get("category_id") not in categories or isinstance(ann["category_id"], bool):
                problem(key, "unknown_category", f"category_id {ann.get('category_id')!r} "
                        f"is not in {path.name}'s categories")  # fmt: skip
                continue
            if ann.get("image_id") not in files:
                problem(key, "unknown_image", f"image_id {ann.get('image_id')!r} is not in "
                        f"{path.name}'s images")  # fmt: skip
                continue
            x, y, w, h = (float(v) for v in bbox)
            if not _valid_box(x, y, x + w, y + h):
                dropped["degenerate_boxes"] += 1
                continue
            width, height = sizes.get(ann["image_id"], (math.inf, math.inf))
            if x >= width or y >= height or x + w <= 0 or y + h <= 0:
                problem(key, "box_outside_image", f"bbox {bbox} lies outside the "
                        f"{width}x{height} image {files[ann['image_id']]}")  # fmt: skip
                continue
            boxes.setdefault(ann["image_id"], []).append(([x, y, x + w, y + h], ann["category_id"]))
        for image_id in sorted(files):
            own = boxes.get(image_id, [])
            if not own:
                dropped["images_without_boxes"] += 1
                continue
            key = Path(files[image_id]).stem
            held = val_json is None and held_out(key, cfg.val_fraction, cfg.seed)
            images.append(
                DetectionImage(
                    key,
                    files[image_id],
                    "val" if held else split,
                    [b for b, _ in own],
                    [categories[c] for _, c in own],
                )
            )
    classes = [categories[c] for c in sorted(categories)]
    return DetectionDataset("coco", images, classes, [], _clean(dropped), problem.issues, read)


def _vg_path(images_root: Path | None, image_id: int) -> str:
    name = f"{image_id}.jpg"
    if images_root is not None:
        for folder in ("", "VG_100K", "VG_100K_2"):
            if (images_root / folder / name).is_file():
                return f"{folder}/{name}" if folder else name
    return name


def _clean_name(name) -> str:
    return " ".join(str(name).lower().split())


def read_visual_genome(
    objects_json: Path,
    attributes_json: Path | None,
    cfg: DetectorConfig,
    images_root: Path | None = None,
) -> DetectionDataset:
    """Visual Genome objects (first name of each) with their attributes; the most frequent
    ``max_classes`` names and ``max_attributes`` attributes of train are kept."""
    objects = _load_json(objects_json, "Visual Genome objects")
    if not isinstance(objects, list):
        raise DetectionDataError(f"{objects_json}: expected a list of images with 'objects'")
    dropped: Counter = Counter()
    problem = _Problems(dropped)
    attrs_of = _vg_attributes(attributes_json, problem) if attributes_json else {}
    raw = []
    read = 0
    for i, image in enumerate(objects):
        image_id = image.get("image_id") if isinstance(image, dict) else None
        if not isinstance(image_id, int) or isinstance(image_id, bool):
            read += 1
            problem(f"{objects_json.name}[{i}]", "malformed_image",
                    f"image_id {image_id!r}: expected an integer")  # fmt: skip
            continue
        key = str(image_id)
        split = "val" if held_out(key, cfg.val_fraction, cfg.seed) else "train"
        boxes = []
        objs = image.get("objects") or []
        if not isinstance(objs, list):
            read += 1
            problem(key, "malformed_image", f"objects is a {type(objs).__name__}, not a list")
            continue
        for j, obj in enumerate(objs):
            read += 1
            where = f"{key} object {obj.get('object_id', j) if isinstance(obj, dict) else j}"
            if not isinstance(obj, dict):
                problem(where, "malformed_object", f"{type(obj).__name__}, not an object")
                continue
            names = obj["names"] if "names" in obj else [obj["name"]] if "name" in obj else []
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                problem(where, "malformed_names", f"names {str(names)[:80]}: expected a list "
                        "of strings")  # fmt: skip
                continue
            shown = {k: obj.get(k) for k in ("x", "y", "w", "h")}
            if not all(map(_number, shown.values())):
                problem(where, "malformed_box", f"{shown}: x, y, w, h must be numbers")
                continue
            x, y, w, h = map(float, shown.values())
            names = [n for n in names if n.strip()]
            if not names or not _valid_box(x, y, x + w, y + h):
                dropped["degenerate_boxes" if names else "unnamed_boxes"] += 1
                continue
            boxes.append(([x, y, x + w, y + h], _clean_name(names[0]), obj.get("object_id")))
        raw.append((key, image_id, split, boxes))
    train = [(n, oid) for _, _, split, bs in raw if split == "train" for _, n, oid in bs]
    classes = _most_frequent(Counter(n for n, _ in train), cfg.max_classes)
    known = set(classes)
    attr_counts = Counter(a for n, oid in train if n in known for a in attrs_of.get(oid, []))
    attributes = _most_frequent(attr_counts, cfg.max_attributes)
    kept_attrs = set(attributes)
    images = []
    for key, image_id, split, bs in raw:
        own = [(b, n, oid) for b, n, oid in bs if n in known]
        dropped["rare_class_boxes"] += len(bs) - len(own)
        if not own:
            dropped["images_without_boxes"] += 1
            continue
        images.append(
            DetectionImage(
                key,
                _vg_path(images_root, image_id),
                split,
                [b for b, _, _ in own],
                [n for _, n, _ in own],
                [[a for a in attrs_of.get(oid, []) if a in kept_attrs] for _, _, oid in own],
            )
        )
    return DetectionDataset(
        "visual_genome", images, classes, attributes, _clean(dropped), problem.issues, read
    )


def _most_frequent(counts: Counter, k: int) -> list[str]:
    """The ``k`` most frequent names (ties: by name), sorted by name."""
    return sorted(sorted(counts, key=lambda n: (-counts[n], n))[:k])


def _vg_attributes(path: Path, problem: _Problems) -> dict[int, list[str]]:
    """object_id -> its attribute names from ``attributes.json``; malformed entries are
    reported and left out."""
    data = _load_json(path, "Visual Genome attributes")
    if not isinstance(data, list):
        raise DetectionDataError(f"{path}: expected a list of images with 'attributes'")
    attrs_of: dict[int, list[str]] = {}
    for i, image in enumerate(data):
        image_id = image.get("image_id", i) if isinstance(image, dict) else i
        objs = (image.get("attributes") or []) if isinstance(image, dict) else None
        if not isinstance(objs, list):
            problem(f"{path.name}[{i}]", "malformed_attributes", f"{str(image)[:80]}")
            continue
        for obj in objs:
            if not isinstance(obj, dict) or not isinstance(obj.get("object_id"), int):
                problem(f"{image_id} attributes", "malformed_attributes",
                        f"{str(obj)[:80]}: expected an object with object_id")  # fmt: skip
                continue
            names = obj.get("attributes") or []
            if not isinstance(names, list) or not all(isinstance(a, str) for a in names):
                problem(f"{image_id} object {obj['object_id']}", "malformed_attributes",
                        f"attributes {str(names)[:80]}: expected a list of strings")  # fmt: skip
                continue
            attrs_of[obj["object_id"]] = list(
                dict.fromkeys(_clean_name(a) for a in names if a.strip())
            )
    return attrs_of


def _clean(counts: Counter) -> dict[str, int]:
    return {k: v for k, v in sorted(counts.items()) if v}
