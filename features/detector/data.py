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
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from features.detector.config import DetectorConfig
from features.ingest.manifest import Manifest
from features.ingest.readers import held_out
from infra.config import UserError


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
        }


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
    """Images of a manifest that have boxes; classes and attributes sorted by name."""
    images, dropped = [], Counter()
    for row in manifest.table.to_pylist():
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
    return DetectionDataset(manifest.dataset, images, classes, attributes, _clean(dropped))


def read_coco(train_json: Path, val_json: Path | None, cfg: DetectorConfig) -> DetectionDataset:
    """COCO instances JSON: train (and val) images with their non-crowd boxes."""
    categories: dict[int, str] = {}
    images: list[DetectionImage] = []
    dropped: Counter = Counter()
    for path, split in ((train_json, "train"), (val_json, "val")):
        if path is None:
            continue
        data = _load_json(path, "COCO instances")
        if not isinstance(data, dict) or not {"images", "annotations", "categories"} <= set(data):
            raise DetectionDataError(
                f"{path}: expected COCO instances JSON with images, annotations and categories"
            )
        for cat in data["categories"]:
            if categories.setdefault(cat["id"], cat["name"]) != cat["name"]:
                raise DetectionDataError(
                    f"{path}: category {cat['id']} is {cat['name']!r} here but "
                    f"{categories[cat['id']]!r} in {train_json}"
                )
        boxes: dict[int, list] = {}
        for ann in data["annotations"]:
            if ann.get("iscrowd"):
                dropped["crowd_boxes"] += 1
                continue
            x, y, w, h = ann["bbox"]
            if not _valid_box(x, y, x + w, y + h):
                dropped["degenerate_boxes"] += 1
                continue
            boxes.setdefault(ann["image_id"], []).append(([x, y, x + w, y + h], ann["category_id"]))
        for image in sorted(data["images"], key=lambda im: im["id"]):
            own = boxes.get(image["id"], [])
            if not own:
                dropped["images_without_boxes"] += 1
                continue
            key = Path(image["file_name"]).stem
            image_split = split
            if val_json is None and held_out(key, cfg.val_fraction, cfg.seed):
                image_split = "val"
            images.append(
                DetectionImage(
                    key,
                    image["file_name"],
                    image_split,
                    [list(map(float, b)) for b, _ in own],
                    [categories[c] for _, c in own],
                )
            )
    classes = [categories[c] for c in sorted(categories)]
    return DetectionDataset("coco", images, classes, [], _clean(dropped))


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
    attrs_of: dict[int, list[str]] = {}
    if attributes_json is not None:
        for image in _load_json(attributes_json, "Visual Genome attributes"):
            for obj in image.get("attributes") or []:
                names = [_clean_name(a) for a in obj.get("attributes") or [] if str(a).strip()]
                attrs_of[obj["object_id"]] = list(dict.fromkeys(names))
    raw = []
    dropped: Counter = Counter()
    for image in objects:
        image_id = image["image_id"]
        key = str(image_id)
        split = "val" if held_out(key, cfg.val_fraction, cfg.seed) else "train"
        boxes = []
        for obj in image.get("objects") or []:
            names = obj.get("names") or ([obj["name"]] if "name" in obj else [])
            x, y, w, h = (float(obj[k]) for k in ("x", "y", "w", "h"))
            if not names or not _valid_box(x, y, x + w, y + h):
                dropped["degenerate_boxes" if names else "unnamed_boxes"] += 1
                continue
            boxes.append(([x, y, x + w, y + h], _clean_name(names[0]), obj.get("object_id")))
        raw.append((key, image_id, split, boxes))
    class_counts = Counter(n for _, _, s, bs in raw if s == "train" for _, n, _ in bs)
    classes = sorted(sorted(class_counts, key=lambda n: (-class_counts[n], n))[: cfg.max_classes])
    known = set(classes)
    attr_counts = Counter(
        a
        for _, _, s, bs in raw
        if s == "train"
        for _, n, oid in bs
        if n in known
        for a in attrs_of.get(oid, [])
    )
    attributes = sorted(
        sorted(attr_counts, key=lambda a: (-attr_counts[a], a))[: cfg.max_attributes]
    )
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
    return DetectionDataset("visual_genome", images, classes, attributes, _clean(dropped))


def _clean(counts: Counter) -> dict[str, int]:
    return {k: v for k, v in sorted(counts.items()) if v}
