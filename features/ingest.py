"""Ingestion: raw dataset annotations -> one validated, canonical manifest (parquet).

Readers turn each supported layout into :class:`Record` s:

- ``karpathy``: Karpathy split JSON (``dataset_flickr30k.json``, ``dataset_coco.json``):
  ``images[].filename``, ``filepath``, ``split`` (``restval`` merged into train by default,
  as VSE++ trains on "train + restval"), ``sentences[].raw``, ``imgid``.
- ``food101``: UPMC Food-101: class folders of images (``[split/]class/name.jpg``) and texts
  CSVs of ``image name, text, class`` named after their split (``train_titles.csv``); a
  seeded, hash-based part of train is held out as val, since the dataset has none.
- ``demo``: the synthetic demo dataset (:mod:`features.demo`), which is Karpathy JSON plus
  class labels, ground-truth boxes with names (the shapes) and, per box, its attributes
  (colour and size, from ``objects``): the boxes a detector trains on.

:func:`validate` checks every record and never aborts: problems go to an error list
(key, reason, detail) with counts, and :func:`error_fraction` lets the entry point fail
the run when too many records were bad. Optional fields (``label``, ``boxes``,
``box_names``) that are malformed drop their record as an error, never a crash; an image
path must stay inside the images root once symlinks are resolved (or lead into DVC's
cache), unless ``prepare.allow_symlinks_outside`` says otherwise.
"""

from __future__ import annotations

import configparser
import csv
import functools
import hashlib
import json
import math
import os
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field

from features.config import Section, Seed, UserError

MANIFEST_SCHEMA_VERSION = 2  # 2: box_attributes (version 1 reads as all-null)
SPLITS = ("train", "val", "test")
KARPATHY_SPLITS = SPLITS + ("restval",)  # restval survives only with prepare.restval = keep

# Reasons that drop a record or a caption (they count towards max_error_fraction) ...
ERRORS = (
    "malformed_record",
    "missing_image",
    "unreadable_path",
    "path_escapes_root",
    "symlink_escapes_root",
    "duplicate_key",
    "unknown_split",
    "empty_caption",
    "non_utf8_text",
    "no_captions",
    "bad_label",
    "bad_boxes",
    "bad_box_names",
    "bad_box_attributes",
)
# ... and reasons that are only reported: the record is kept as it is.
WARNINGS = ("caption_count",)


class PrepareConfig(Section):
    """``prepare`` section of params.yaml."""

    format: Literal["demo", "karpathy", "food101"] = "demo"
    captions_per_image: int = Field(5, ge=1)
    restval: Literal["train", "keep"] = "train"
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    seed: Seed = 0
    max_error_fraction: float = Field(0.01, ge=0.0, le=1.0)
    # image paths that resolve (through symlinks) outside the images root and DVC's cache
    allow_symlinks_outside: bool = False


class IngestError(UserError):
    """A dataset could not be read, or too many of its records were bad."""


@dataclass
class Record:
    """One image and its captions, as a reader found them (before validation)."""

    key: str
    path: str
    split: str
    captions: list = field(default_factory=list)
    label: int | None = None
    boxes: list | None = None
    box_names: list | None = None
    box_attributes: list | None = None  # one list of attribute names per box
    problem: str | None = None  # set by a reader that could not parse the record


@dataclass
class Dataset:
    name: str
    records: list[Record]
    class_names: list[str] | None = None


@dataclass
class Issue:
    key: str
    reason: str
    detail: str


@dataclass
class Report:
    records_read: int = 0
    records_kept: int = 0
    captions_kept: int = 0
    errors: list[Issue] = field(default_factory=list)
    warnings: list[Issue] = field(default_factory=list)

    def error(self, key: str, reason: str, detail: str) -> None:
        self.errors.append(Issue(key, reason, detail))

    @property
    def records_with_errors(self) -> int:
        return len({issue.key for issue in self.errors})

    @property
    def error_fraction(self) -> float:
        return self.records_with_errors / max(self.records_read, 1)

    def counts(self) -> dict[str, int]:
        counts = Counter(issue.reason for issue in self.errors + self.warnings)
        return {reason: counts.get(reason, 0) for reason in ERRORS + WARNINGS}

    def summary(self, splits: dict[str, int]) -> dict:
        """The figures written as DVC metrics and printed at the end of the stage."""
        return {
            "records_read": self.records_read,
            "records_kept": self.records_kept,
            "captions_kept": self.captions_kept,
            "records_with_errors": self.records_with_errors,
            "error_fraction": round(self.error_fraction, 6),
            "splits": splits,
            "counts": self.counts(),
        }


# --------------------------------------------------------------------------- readers


def _read_text(path: Path) -> str:
    """Read a text file as UTF-8; undecodable bytes survive as surrogates to be reported."""
    try:
        return path.read_bytes().decode("utf-8", errors="surrogateescape")
    except OSError as err:
        raise IngestError(f"{path}: cannot read annotations ({err.strerror or err})") from err


def read_karpathy(annotations: Path, images_root: Path, cfg: PrepareConfig) -> Dataset:
    """Karpathy split JSON, plus the optional ``label``/``boxes``/``box_names``/
    ``box_attributes`` of datasets with boxes."""
    try:
        data = json.loads(_read_text(annotations))
    except json.JSONDecodeError as err:
        raise IngestError(f"{annotations}: not valid JSON ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise IngestError(
            f"{annotations}: no top-level 'images' list; expected the Karpathy split JSON "
            "layout of dataset_flickr30k.json / dataset_coco.json"
        )
    class_names = data.get("class_names")
    if class_names is not None and not (
        isinstance(class_names, list)
        and all(isinstance(c, str) and _is_utf8(c) for c in class_names)
    ):
        raise IngestError(
            f"{annotations}: 'class_names' must be a list of strings, got "
            f"{type(class_names).__name__}; fix or remove it"
        )
    records = []
    for i, image in enumerate(data["images"]):
        filename = image.get("filename") if isinstance(image, dict) else None
        if not isinstance(filename, str) or not filename:
            records.append(Record(f"<images[{i}]>", "", "", problem="no 'filename'"))
            continue
        sentences = image.get("sentences", [])
        if not isinstance(sentences, list) or not all(isinstance(s, dict) for s in sentences):
            records.append(Record(Path(filename).stem, filename, "", problem="bad 'sentences'"))
            continue
        filepath = image.get("filepath") or ""
        if not isinstance(filepath, str):
            records.append(Record(Path(filename).stem, filename, "", problem="bad 'filepath'"))
            continue
        split = str(image.get("split", ""))
        if split == "restval" and cfg.restval == "train":
            split = "train"
        records.append(
            Record(
                key=Path(filename).stem,
                path=posixpath.join(filepath, filename),
                split=split,
                captions=[s.get("raw", "") for s in sentences],
                label=image.get("label"),
                boxes=image.get("boxes"),
                box_names=image.get("box_names"),
                box_attributes=image.get("box_attributes"),
            )
        )
    name = str(data.get("dataset", "karpathy"))
    return Dataset(name if _is_utf8(name) else "karpathy", records, class_names)


def _held_out(key: str, fraction: float, seed: int) -> bool:
    """Deterministic, order-independent choice of the val part of a train split."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_food101(annotations: Path, images_root: Path, cfg: PrepareConfig) -> Dataset:
    """UPMC Food-101: ``annotations`` is one texts CSV or a folder of ``{split}*.csv``."""
    csv_files = sorted(annotations.glob("*.csv")) if annotations.is_dir() else [annotations]
    if not csv_files:
        raise IngestError(f"{annotations}: no *.csv texts files (expected train_titles.csv ...)")
    rows = []
    for csv_file in csv_files:
        split = next((s for s in SPLITS if csv_file.name.startswith(s)), None)
        if split is None:
            raise IngestError(
                f"{csv_file}: cannot tell its split; name texts files train*.csv, val*.csv "
                "or test*.csv"
            )
        split_dir = (images_root / split).is_dir()
        try:
            rows += _food101_rows(csv_file, split, split_dir, cfg)
        except OSError as err:
            raise IngestError(f"{csv_file}: cannot read ({err.strerror or err})") from None
    class_names = sorted({r.label for r in rows if r.problem is None})
    for r in rows:
        if r.problem is None:
            r.label = class_names.index(r.label)
    return Dataset("food101", rows, class_names)


def _food101_rows(csv_file: Path, split: str, split_dir: bool, cfg: PrepareConfig) -> list:
    """The records of one Food-101 texts CSV (``image name, text, class``)."""
    rows = []
    with open(csv_file, encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        try:
            for row in reader:
                line_no = reader.line_num
                if line_no == 1 and row and row[0].strip().lower() in ("image name", "image_name"):
                    continue  # header
                if len(row) < 3:
                    key = f"<{csv_file.name}:{line_no}>"
                    rows.append(Record(key, "", split, problem="expected 3 columns"))
                    continue
                name, text, label = row[0].strip(), row[1], row[2].strip()
                key = Path(name).stem
                if not (_is_utf8(name) and _is_utf8(label)) or not label:
                    problem = f"line {line_no}: image name or class is empty or not UTF-8"
                    rows.append(Record(f"<{csv_file.name}:{line_no}>", "", split, problem=problem))
                    continue
                path = posixpath.join(split if split_dir else "", label, name)
                if split == "train" and _held_out(key, cfg.val_fraction, cfg.seed):
                    split_of_row = "val"
                else:
                    split_of_row = split
                rows.append(Record(key, path, split_of_row, [text], label=label))
        except csv.Error as err:
            raise IngestError(
                f"{csv_file}:{reader.line_num}: not readable as CSV ({err})"
            ) from None
    return rows


def read_demo(annotations: Path, images_root: Path, cfg: PrepareConfig) -> Dataset:
    """The demo's Karpathy JSON; each box's attributes are its object's colour and size."""
    dataset = read_karpathy(annotations, images_root, cfg)
    objects = {}
    data = json.loads(_read_text(annotations))
    for image in data["images"]:
        if isinstance(image, dict) and isinstance(image.get("filename"), str):
            objects[Path(image["filename"]).stem] = image.get("objects")
    for record in dataset.records:
        described = objects.get(record.key)
        if record.problem is None and isinstance(described, list) and record.box_attributes is None:
            record.box_attributes = [
                [o.get("color"), o.get("size")] if isinstance(o, dict) else None for o in described
            ]
    return dataset


READERS: dict[str, Callable[[Path, Path, PrepareConfig], Dataset]] = {
    "karpathy": read_karpathy,
    "demo": read_demo,
    "food101": read_food101,
}


# --------------------------------------------------------------------------- validation


def _dvc_caches(images_root: Path) -> list[Path]:
    """The DVC cache of the repository holding ``images_root`` (``.dvc/cache``, or the
    ``cache.dir`` its config names), where DVC may check images out as symlinks."""
    for folder in [images_root.absolute(), *images_root.absolute().parents]:
        dvc = folder / ".dvc"
        if dvc.is_dir():
            caches = [dvc / "cache"]
            for name in ("config", "config.local"):
                parser = configparser.ConfigParser()
                try:
                    parser.read_string(
                        "\n".join(line.strip() for line in (dvc / name).read_text().splitlines())
                    )
                except (OSError, configparser.Error, UnicodeDecodeError):
                    continue
                if parser.has_option("cache", "dir"):
                    caches.append(dvc / parser.get("cache", "dir"))  # relative to .dvc/
            return caches
    return []


@functools.cache
def _allowed_roots(images_root: Path) -> tuple[Path, ...]:
    """Where an image may resolve to: inside the images root or DVC's cache."""
    return tuple(p.resolve() for p in [images_root, *_dvc_caches(images_root)])


def check_path(
    images_root: Path, path: str, allow_symlinks_outside: bool = False
) -> tuple[str, str | None, str]:
    """Normalise ``path`` and check the file; returns ``(path, reason or None, detail)``.

    The path must stay inside the root lexically (no ``..``, not absolute), and, unless
    ``allow_symlinks_outside``, once symlinks are resolved: inside the images root or the
    repository's DVC cache (DVC in symlink mode checks images out as links into it).
    """
    if not path or "\x00" in path or not _is_utf8(path):
        return path, "unreadable_path", "empty path, NUL byte in path or not valid UTF-8"
    normalised = posixpath.normpath(path.replace("\\", "/"))
    if posixpath.isabs(normalised) or normalised == ".." or normalised.startswith("../"):
        return path, "path_escapes_root", f"{path!r} is outside the images root"
    full = images_root / normalised
    try:
        if not full.is_file():
            if full.exists():
                return normalised, "unreadable_path", f"{full} is not a regular file"
            return normalised, "missing_image", f"{full} does not exist"
    except OSError as err:
        return normalised, "unreadable_path", f"{full}: {err.strerror or err}"
    if not os.access(full, os.R_OK):
        return normalised, "unreadable_path", f"{full}: permission denied"
    if not allow_symlinks_outside:
        resolved = full.resolve()
        roots = _allowed_roots(images_root)
        if not any(resolved.is_relative_to(root) for root in roots):
            return (
                normalised,
                "symlink_escapes_root",
                f"{full} resolves to {resolved}, outside the images root {roots[0]} and DVC's "
                "cache; set prepare.allow_symlinks_outside: true if that is intended",
            )
    return normalised, None, ""


INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234e38


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_label(label, class_names: list[str] | None) -> str | None:
    """What is wrong with an optional class label, or None: an int indexing the classes."""
    if label is None:
        return None
    if not isinstance(label, int) or isinstance(label, bool):
        return f"label {label!r} is {type(label).__name__}, not a class index"
    limit = len(class_names) if class_names is not None else INT32_MAX + 1
    if not 0 <= label < limit:
        return f"label {label} is outside 0..{limit - 1}" + (
            f" ({len(class_names)} class_names)" if class_names is not None else ""
        )
    return None


def check_boxes(boxes) -> str | None:
    """What is wrong with optional boxes, or None: a list of ``[x1, y1, x2, y2]`` finite
    float32 numbers with ``x1 <= x2`` and ``y1 <= y2``."""
    if boxes is None:
        return None
    if not isinstance(boxes, list):
        return f"boxes is {type(boxes).__name__}, not a list of [x1, y1, x2, y2]"
    for i, box in enumerate(boxes):
        if not isinstance(box, list) or len(box) != 4 or not all(map(_is_number, box)):
            return f"box {i} is {str(box)[:60]}, not [x1, y1, x2, y2] numbers"
        if not all(math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in box):
            return f"box {i} {box} has a value that is not a finite float32"
        if box[0] > box[2] or box[1] > box[3]:
            return f"box {i} {box} has x1 > x2 or y1 > y2"
    return None


def check_box_names(names, boxes) -> str | None:
    """What is wrong with optional box names, or None: one string per box."""
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) and _is_utf8(n) for n in names):
        return f"box_names is {str(names)[:60]!r}, not a list of (UTF-8) strings"
    if not isinstance(boxes, list) or len(names) != len(boxes):
        count = len(boxes) if isinstance(boxes, list) else "no"
        return f"{len(names)} box_names for {count} boxes"
    return None


def check_box_attributes(attributes, boxes) -> str | None:
    """What is wrong with optional box attributes, or None: one list of strings per box."""
    if attributes is None:
        return None
    if not isinstance(attributes, list) or not all(
        isinstance(a, list) and all(isinstance(v, str) and _is_utf8(v) for v in a)
        for a in attributes
    ):
        return f"box_attributes is {str(attributes)[:60]!r}, not one list of strings per box"
    if not isinstance(boxes, list) or len(attributes) != len(boxes):
        count = len(boxes) if isinstance(boxes, list) else "no"
        return f"{len(attributes)} box_attributes for {count} boxes"
    return None


def check_key(key) -> str | None:
    """What is wrong with an image key, or None: caption keys are ``<key>#<i>``."""
    if not isinstance(key, str) or not key.strip() or not _is_utf8(key):
        return "empty image key (file name), or not valid UTF-8"
    if "#" in key or any(c in key for c in "\n\r\t\x00"):
        return f"image key {key!r} holds '#' or a control character (caption keys are key#i)"
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate(
    dataset: Dataset,
    images_root: Path,
    captions_per_image: int,
    progress: Callable[[Iterable], Iterable] | None = None,
    allow_symlinks_outside: bool = False,
) -> tuple[list[Record], Report]:
    """Keep the good records, drop bad captions and records, and report everything."""
    report = Report(records_read=len(dataset.records))
    kept: list[Record] = []
    seen: dict[str, str] = {}
    records = progress(dataset.records) if progress else dataset.records
    for record in records:
        key = record.key
        problem = record.problem or check_key(key)
        if problem:
            report.error(str(key), "malformed_record", problem)
            continue
        if key in seen:
            report.error(key, "duplicate_key", f"{record.path} has the same key as {seen[key]}")
            continue
        seen[key] = record.path
        record.path, reason, detail = check_path(images_root, record.path, allow_symlinks_outside)
        if reason:
            report.error(key, reason, detail)
        if record.split not in KARPATHY_SPLITS:
            report.error(
                key,
                "unknown_split",
                f"split {record.split!r} is not one of {', '.join(SPLITS)}",
            )
        captions = []
        for i, caption in enumerate(record.captions):
            if not isinstance(caption, str):
                report.error(
                    key,
                    "malformed_record",
                    f"caption {i} is {type(caption).__name__}, not text",
                )
            elif not _is_utf8(caption):
                report.error(key, "non_utf8_text", f"caption {i} is not valid UTF-8: {caption!r}")
            elif not caption.strip():
                report.error(key, "empty_caption", f"caption {i} is empty or whitespace")
            else:
                captions.append(caption.strip())
        if not captions:
            report.error(key, "no_captions", "no usable caption left")
        fields = [
            ("bad_label", check_label(record.label, dataset.class_names)),
            ("bad_boxes", check_boxes(record.boxes)),
            ("bad_box_names", check_box_names(record.box_names, record.boxes)),
            ("bad_box_attributes", check_box_attributes(record.box_attributes, record.boxes)),
        ]
        for field_reason, field_detail in fields:
            if field_detail:
                report.error(key, field_reason, field_detail)
        if reason or record.split not in KARPATHY_SPLITS or not captions:
            continue  # the record cannot be used; its errors are reported above
        if any(detail for _, detail in fields):
            continue  # a malformed optional field: the record is dropped, reported above
        if len(captions) != captions_per_image:
            report.warnings.append(
                Issue(
                    key,
                    "caption_count",
                    f"{len(captions)} captions, expected {captions_per_image} (kept)",
                )
            )
        record.captions = captions
        kept.append(record)
    report.records_kept = len(kept)
    report.captions_kept = sum(len(r.captions) for r in kept)
    return kept, report


# --------------------------------------------------------------------------- manifest

MANIFEST_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("path", pa.string()),
        ("split", pa.string()),
        ("captions", pa.list_(pa.string())),
        ("label", pa.int32()),
        ("boxes", pa.list_(pa.list_(pa.float32(), 4))),
        ("box_names", pa.list_(pa.string())),
        ("box_attributes", pa.list_(pa.list_(pa.string()))),
    ]
)
MANIFEST_COLUMNS = MANIFEST_SCHEMA.names
# Columns added after version 1: left out of the digest when null, so datasets without
# them keep their digest (and their feature stores stay valid).
NEWER_COLUMNS = ("box_attributes",)


def manifest_digest(records: list[Record], class_names: list[str] | None) -> str:
    """SHA-256 over the manifest's content (not its file bytes, which depend on the writer)."""
    h = hashlib.sha256()
    h.update(json.dumps(class_names).encode())
    for r in records:
        row = {
            c: getattr(r, c)
            for c in MANIFEST_COLUMNS
            if c not in NEWER_COLUMNS or getattr(r, c) is not None
        }
        h.update(json.dumps(row, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def write_manifest(
    records: list[Record], dataset: Dataset, captions_per_image: int, out: Path
) -> dict:
    """Write the manifest parquet; dataset-level facts go to the schema metadata under ``vse``."""
    meta = {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "dataset": dataset.name,
        "class_names": dataset.class_names,
        "captions_per_image": captions_per_image,
        "digest": manifest_digest(records, dataset.class_names),
    }
    columns = {c: [getattr(r, c) for r in records] for c in MANIFEST_COLUMNS}
    table = pa.table(columns, schema=MANIFEST_SCHEMA.with_metadata({"vse": json.dumps(meta)}))
    from features.files import atomic_path

    with atomic_path(out) as tmp:
        pq.write_table(table, tmp)
    return meta


@dataclass(frozen=True)
class Manifest:
    table: pa.Table
    dataset: str
    class_names: list[str] | None
    captions_per_image: int
    digest: str

    def __len__(self) -> int:
        return self.table.num_rows

    def split(self, name: str) -> pa.Table:
        return self.table.filter(pc.equal(self.table["split"], name))

    def caption_rows(self) -> tuple[list[str], list[str], list[str]]:
        """Caption keys ``<image>#<i>``, texts and splits, in manifest order."""
        keys, texts, splits = [], [], []
        for key, captions, split in zip(
            self.table["key"].to_pylist(),
            self.table["captions"].to_pylist(),
            self.table["split"].to_pylist(),
            strict=True,
        ):
            keys += [f"{key}#{i}" for i in range(len(captions))]
            texts += captions
            splits += [split] * len(captions)
        return keys, texts, splits


def read_manifest(path: Path) -> Manifest:
    """Open a manifest written by :func:`write_manifest`, with a clear error otherwise."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise IngestError(f"{path}: cannot read manifest ({err}); run `vse prepare` first") from err
    raw = (table.schema.metadata or {}).get(b"vse")
    if raw is None:
        raise IngestError(f"{path}: not a vse manifest (no 'vse' metadata); run `vse prepare`")
    try:
        meta = json.loads(raw)
        version = meta.get("schema_version")
    except (ValueError, AttributeError):
        raise IngestError(f"{path}: damaged manifest metadata; rerun `vse prepare`") from None
    if version not in (1, MANIFEST_SCHEMA_VERSION):
        raise IngestError(
            f"{path}: manifest schema version {version}, this code reads "
            f"{MANIFEST_SCHEMA_VERSION}; rerun `vse prepare` (dvc repro prepare)"
        )
    for name in NEWER_COLUMNS:  # a version-1 manifest: the column is all null
        if name not in table.column_names:
            field = MANIFEST_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    missing += [
        k for k in ("dataset", "class_names", "captions_per_image", "digest") if k not in meta
    ]
    if missing:
        raise IngestError(f"{path}: damaged manifest (no {missing}); rerun `vse prepare`")
    return Manifest(
        table, meta["dataset"], meta["class_names"], meta["captions_per_image"], meta["digest"]
    )


def write_errors(report: Report, path: Path) -> None:
    """All errors and warnings as CSV rows ``key, severity, reason, detail``."""
    from features.files import atomic_path

    with (
        atomic_path(path) as tmp,
        open(tmp, "w", encoding="utf-8", errors="backslashreplace", newline="") as f,
    ):
        writer = csv.writer(f)
        writer.writerow(["key", "severity", "reason", "detail"])
        for severity, issues in (("error", report.errors), ("warning", report.warnings)):
            for issue in issues:
                writer.writerow([issue.key, severity, issue.reason, issue.detail])


def split_counts(records: list[Record]) -> dict[str, int]:
    counts = Counter(r.split for r in records)
    return {s: counts[s] for s in KARPATHY_SPLITS if s in SPLITS or counts[s]}


# --------------------------------------------------------------------------- stage


def prepare(
    annotations: Path,
    images_root: Path,
    cfg: PrepareConfig,
    out: Path,
    errors: Path,
    metrics: Path,
    log: Callable[[str], None] = print,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> dict:
    """Stage ``prepare``: read the raw dataset, validate every record, write the errors
    CSV and the metrics JSON, then the manifest, unless more than ``max_error_fraction``
    of the records have errors (an :class:`IngestError` naming the errors file)."""
    from features.files import write_json

    if not images_root.is_dir():
        raise IngestError(f"{images_root}: images root is not a directory")
    dataset = READERS[cfg.format](annotations, images_root, cfg)
    records, report = validate(
        dataset,
        images_root,
        cfg.captions_per_image,
        progress=progress,
        allow_symlinks_outside=cfg.allow_symlinks_outside,
    )
    summary = report.summary(split_counts(records))
    write_errors(report, errors)
    write_json(metrics, summary)
    counts = ", ".join(f"{k} {v}" for k, v in summary["counts"].items() if v) or "none"
    splits = ", ".join(f"{k} {v}" for k, v in summary["splits"].items())
    log(
        f"prepare: {dataset.name}: read {report.records_read} records, kept "
        f"{report.records_kept} ({splits}) with {report.captions_kept} captions\n"
        f"prepare: problems: {counts}\n"
        f"prepare: report: {errors} (every problem by key), {metrics} (counts)"
    )
    if report.error_fraction > cfg.max_error_fraction:
        raise IngestError(
            f"{report.records_with_errors} of {report.records_read} records "
            f"({report.error_fraction:.2%}) have errors, more than "
            f"prepare.max_error_fraction = {cfg.max_error_fraction:.2%}; see {errors}"
        )
    meta = write_manifest(records, dataset, cfg.captions_per_image, out)
    log(f"prepare: wrote {out} (digest {meta['digest'][:12]})")
    return summary
