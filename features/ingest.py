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
the run when too many records were bad.
"""

from __future__ import annotations

import csv
import hashlib
import json
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

from features.config import Section

MANIFEST_SCHEMA_VERSION = 2  # 2: box_attributes (version 1 reads as all-null)
SPLITS = ("train", "val", "test")
KARPATHY_SPLITS = SPLITS + ("restval",)  # restval survives only with prepare.restval = keep

# Reasons that drop a record or a caption (they count towards max_error_fraction) ...
ERRORS = (
    "malformed_record",
    "missing_image",
    "unreadable_path",
    "path_escapes_root",
    "duplicate_key",
    "unknown_split",
    "empty_caption",
    "non_utf8_text",
    "no_captions",
)
# ... and reasons that are only reported: the record is kept as it is.
WARNINGS = ("caption_count",)


class PrepareConfig(Section):
    """``prepare`` section of params.yaml."""

    format: Literal["demo", "karpathy", "food101"] = "demo"
    captions_per_image: int = Field(5, ge=1)
    restval: Literal["train", "keep"] = "train"
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    seed: int = 0
    max_error_fraction: float = Field(0.01, ge=0.0, le=1.0)


class IngestError(RuntimeError):
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
        split = str(image.get("split", ""))
        if split == "restval" and cfg.restval == "train":
            split = "train"
        records.append(
            Record(
                key=Path(filename).stem,
                path=posixpath.join(image.get("filepath") or "", filename),
                split=split,
                captions=[s.get("raw", "") for s in sentences],
                label=image.get("label"),
                boxes=image.get("boxes"),
                box_names=image.get("box_names"),
                box_attributes=image.get("box_attributes"),
            )
        )
    return Dataset(str(data.get("dataset", "karpathy")), records, data.get("class_names"))


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
        with open(csv_file, encoding="utf-8", errors="surrogateescape", newline="") as f:
            for line_no, row in enumerate(csv.reader(f), start=1):
                if line_no == 1 and row and row[0].strip().lower() in ("image name", "image_name"):
                    continue  # header
                if len(row) < 3:
                    key = f"<{csv_file.name}:{line_no}>"
                    rows.append(Record(key, "", split, problem="expected 3 columns"))
                    continue
                name, text, label = row[0].strip(), row[1], row[2].strip()
                path = posixpath.join(split if split_dir else "", label, name)
                key = Path(name).stem
                if split == "train" and _held_out(key, cfg.val_fraction, cfg.seed):
                    split_of_row = "val"
                else:
                    split_of_row = split
                rows.append(Record(key, path, split_of_row, [text], label=label))
    class_names = sorted({r.label for r in rows if r.problem is None})
    for r in rows:
        if r.problem is None:
            r.label = class_names.index(r.label)
    return Dataset("food101", rows, class_names)


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


def check_path(images_root: Path, path: str) -> tuple[str, str | None, str]:
    """Normalise ``path`` and check the file; returns ``(path, reason or None, detail)``.

    The escape check is lexical on purpose: images may be symlinks (a DVC cache in symlink
    mode, a shared dataset folder) that resolve outside the root legitimately.
    """
    if not path or "\x00" in path:
        return path, "unreadable_path", "empty path or NUL byte in path"
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
    return normalised, None, ""


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
) -> tuple[list[Record], Report]:
    """Keep the good records, drop bad captions and records, and report everything."""
    report = Report(records_read=len(dataset.records))
    kept: list[Record] = []
    seen: dict[str, str] = {}
    records = progress(dataset.records) if progress else dataset.records
    for record in records:
        key = record.key
        if record.problem:
            report.error(key, "malformed_record", record.problem)
            continue
        if key in seen:
            report.error(key, "duplicate_key", f"{record.path} has the same key as {seen[key]}")
            continue
        seen[key] = record.path
        record.path, reason, detail = check_path(images_root, record.path)
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
        box_problem = _box_problem(record)
        if box_problem:
            report.error(key, "malformed_record", box_problem)
        if reason or record.split not in KARPATHY_SPLITS or not captions or box_problem:
            continue  # the record cannot be used; its errors are reported above
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


def _box_problem(record: Record) -> str | None:
    """Why the record's boxes, names and attributes cannot be stored, if they cannot."""
    boxes, names, attributes = record.boxes, record.box_names, record.box_attributes
    if boxes is None:
        if names is not None or attributes is not None:
            return "box_names or box_attributes without boxes"
        return None
    if not isinstance(boxes, list) or not all(
        isinstance(b, list | tuple) and len(b) == 4 and all(isinstance(v, int | float) for v in b)
        for b in boxes
    ):
        return "boxes must be a list of [x1, y1, x2, y2]"
    for field_name, values in (("box_names", names), ("box_attributes", attributes)):
        if values is not None and (not isinstance(values, list) or len(values) != len(boxes)):
            return f"{field_name} must have one entry per box ({len(boxes)})"
    if names is not None and not all(isinstance(n, str) for n in names):
        return "box_names must be strings"
    if attributes is not None and not all(
        isinstance(a, list) and all(isinstance(v, str) for v in a) for a in attributes
    ):
        return "box_attributes must be one list of strings per box"
    return None


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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
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


def read_manifest(path: Path) -> Manifest:
    """Open a manifest written by :func:`write_manifest`, with a clear error otherwise."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise IngestError(f"{path}: cannot read manifest ({err}); run `vse prepare` first") from err
    raw = (table.schema.metadata or {}).get(b"vse")
    if raw is None:
        raise IngestError(f"{path}: not a vse manifest (no 'vse' metadata); run `vse prepare`")
    meta = json.loads(raw)
    if meta.get("schema_version") not in (1, MANIFEST_SCHEMA_VERSION):
        raise IngestError(
            f"{path}: manifest schema version {meta.get('schema_version')}, this code reads "
            f"{MANIFEST_SCHEMA_VERSION}; rerun `vse prepare` (dvc repro prepare)"
        )
    for name in NEWER_COLUMNS:  # a version-1 manifest: the column is all null
        if name not in table.column_names:
            field = MANIFEST_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return Manifest(
        table, meta["dataset"], meta["class_names"], meta["captions_per_image"], meta["digest"]
    )


def write_errors(report: Report, path: Path) -> None:
    """All errors and warnings as CSV rows ``key, severity, reason, detail``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", errors="backslashreplace", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "severity", "reason", "detail"])
        for severity, issues in (("error", report.errors), ("warning", report.warnings)):
            for issue in issues:
                writer.writerow([issue.key, severity, issue.reason, issue.detail])


def split_counts(records: list[Record]) -> dict[str, int]:
    counts = Counter(r.split for r in records)
    return {s: counts[s] for s in KARPATHY_SPLITS if s in SPLITS or counts[s]}
