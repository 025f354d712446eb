"""The manifest: one parquet row per image (key, path, split, captions, label, boxes), the
data contract every stage reads, with a content digest that feature stores record."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from infra.config import UserError

MANIFEST_SCHEMA_VERSION = 2  # 2: box_attributes (version 1 reads as all-null)
SPLITS = ("train", "val", "test")
KARPATHY_SPLITS = SPLITS + ("restval",)  # restval survives only with prepare.restval = keep


def caption_key(image_key: str, i: int) -> str:
    """The key of caption ``i`` of an image: ``<image key>#<i>`` (caption-level stores)."""
    return f"{image_key}#{i}"


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
    from infra.files import atomic_path

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
        for row in self.table.select(["key", "captions", "split"]).to_pylist():
            keys += [caption_key(row["key"], i) for i in range(len(row["captions"]))]
            texts += row["captions"]
            splits += [row["split"]] * len(row["captions"])
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
