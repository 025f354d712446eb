"""Bottom-up-attention TSV files (Anderson et al.'s ``generate_tsv.py``): indexed, then
imported into a regions store for a manifest's images."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

from features.exchange.precomp import (
    IMPORTER_VERSION,
    empty_non_finite,
    report_notes,
    with_progress,
)
from features.ingest.manifest import (
    IngestError,
    Manifest,
)
from features.store.spec import FieldSpec, Provenance, StoreConfig, regions_fields
from features.store.writer import StoreWriter

TSV_FIELDS = ["image_id", "image_w", "image_h", "num_boxes", "boxes", "features"]


class MalformedRow(ValueError):
    """A TSV row that cannot be parsed; the message says where and why."""


def _decode(field: str, count: int, width: int, what: str) -> np.ndarray:
    try:
        raw = base64.b64decode(field, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedRow(f"{what} is not base64") from None
    if len(raw) % 4 or (count and width == -1 and len(raw) % (4 * count)):
        raise MalformedRow(f"{what}: {len(raw)} bytes do not hold {count} rows of float32")
    values = np.frombuffer(raw, dtype=np.float32)
    if count == 0:
        if len(values):
            raise MalformedRow(f"{what}: values for 0 boxes")
        return values.reshape(0, max(width, 0))
    try:
        return values.reshape(count, width)
    except ValueError:
        raise MalformedRow(f"{what}: {len(values)} values for {count} rows of {width}") from None


def index_tsv(files: list[Path]) -> dict[str, tuple[Path, int, int]]:
    """Image id -> (file, byte offset, line number of its row): one pass, no features kept
    in memory. An id that is not text, or that occurs twice, is a one-line error."""
    index: dict[str, tuple[Path, int, int]] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                offset = 0
                for line_no, line in enumerate(f, start=1):
                    raw_id = line.split(b"\t", 1)[0].strip()
                    if raw_id:
                        try:
                            image_id = raw_id.decode("ascii")
                        except UnicodeDecodeError:
                            raise IngestError(
                                f"{path}:{line_no}: image_id {raw_id[:40]!r} is not ASCII text; "
                                "is this a bottom-up-attention TSV file?"
                            ) from None
                        if image_id in index:
                            first = index[image_id]
                            raise IngestError(
                                f"{path}:{line_no}: image_id {image_id!r} already at "
                                f"{first[0]}:{first[2]}; remove one of the two rows"
                            )
                        index[image_id] = (path, offset, line_no)
                    offset += len(line)
        except OSError as err:
            raise IngestError(f"{path}: cannot read ({err.strerror or err})") from None
    return index


def _read_tsv_row(path: Path, offset: int, line_no: int) -> dict:
    """One TSV row's boxes, features and image size; :class:`MalformedRow` naming the file
    and line if it is not ``image_id, image_w, image_h, num_boxes, boxes, features``."""
    where = f"{path}:{line_no}"
    with open(path, "rb") as f:
        f.seek(offset)
        line = f.readline()
    try:
        fields = line.decode("ascii").rstrip("\r\n").split("\t")
    except UnicodeDecodeError:
        raise MalformedRow(f"{where}: not ASCII (base64) text") from None
    if len(fields) != len(TSV_FIELDS):
        raise MalformedRow(
            f"{where}: {len(fields)} tab-separated fields, expected {len(TSV_FIELDS)} "
            f"({', '.join(TSV_FIELDS)})"
        )
    row = dict(zip(TSV_FIELDS, fields, strict=True))
    try:
        n, w, h = int(row["num_boxes"]), int(row["image_w"]), int(row["image_h"])
    except ValueError:
        raise MalformedRow(f"{where}: num_boxes, image_w and image_h must be integers") from None
    if n < 0 or w < 0 or h < 0 or n > 100_000:
        raise MalformedRow(f"{where}: num_boxes {n}, image {w}x{h} out of range")
    return {
        "boxes": _decode(row["boxes"], n, 4, f"{where}: boxes"),
        "features": _decode(row["features"], n, -1, f"{where}: features"),
        "image_hw": (h, w),
    }


def match_keys(keys: list[str], ids: Mapping[str, str]) -> dict[str, str]:
    """Manifest key -> file image id: the key itself, or else the id that is the key's
    trailing integer (COCO file stems end in the image id: ``391895`` for
    ``COCO_val2014_000000391895``). Each id maps to ONE key and each key to ONE id, or
    :class:`IngestError` names the id (or key) and its candidates in one line: an id ``1``
    next to keys ``train_00001`` and ``val_00001`` is not guessed at. ``ids`` maps each id
    to where it was read (``file:line``), which the error names."""
    by_number: dict[int, list[str]] = {}
    for image_id in ids:
        if image_id.isascii() and image_id.isdigit():
            by_number.setdefault(int(image_id), []).append(image_id)
    matched: dict[str, str] = {}
    claimed: dict[str, list[str]] = {}  # id -> the keys it matched
    for key in keys:
        if key in ids:
            image_id = key
        elif (m := re.search(r"(\d+)$", key)) and int(m.group(1)) in by_number:
            candidates = sorted(by_number[int(m.group(1))])
            if len(candidates) > 1:
                raise IngestError(
                    f"{ids[candidates[0]]}: manifest key {key!r} matches image ids {candidates} by its "
                    "trailing number; keep one of those rows, or name the rows by manifest key"
                )
            image_id = candidates[0]
        else:
            continue
        matched[key] = image_id
        claimed.setdefault(image_id, []).append(key)
    for image_id, owners in claimed.items():
        if len(owners) > 1:
            shown = ", ".join(owners[:5]) + (", ..." if len(owners) > 5 else "")
            raise IngestError(
                f"{ids[image_id]}: image id {image_id!r} matches {len(owners)} manifest keys "
                f"({shown}); name the rows by manifest key, or import each split with a "
                "manifest of that split only"
            )
    return matched


def import_butd_tsv(
    files: list[Path],
    manifest: Manifest,
    store_path: Path,
    cfg: StoreConfig,
    max_regions: int = 36,
    progress: Callable[[Iterable], Iterable] | None = None,
    log: Callable[[str], None] = print,
) -> list[str]:
    """Import TSV features for the manifest's images; returns the keys with no TSV row.

    Those, rows that cannot be parsed and rows with NaN or infinite values are stored
    empty (``valid = 0``, 0 regions, so the store stays aligned with the manifest) and
    noted by key in the store (``Store.notes()``)."""
    if max_regions < 1:
        raise IngestError(f"--max-regions {max_regions}: expected 1 or more")
    keys = manifest.table["key"].to_pylist()
    index = index_tsv(files)
    matched = match_keys(keys, {i: f"{p}:{line}" for i, (p, _, line) in index.items()})
    if not matched:
        raise IngestError(
            f"{files[0]}: no TSV image_id matches a manifest key "
            f"(e.g. {keys[0] if keys else None!r} vs {next(iter(index), None)!r})"
        )
    dim = None
    for image_id in matched.values():  # the feature size: the first row that parses
        try:
            dim = _read_tsv_row(*index[image_id])["features"].shape[1]
        except MalformedRow:
            continue
        if dim:
            break
    if not dim:
        raise IngestError(
            f"{files[0]}: no row of the {len(matched)} matched images can be parsed as "
            f"{', '.join(TSV_FIELDS)} with boxes; is this a bottom-up-attention TSV file?"
        )
    provenance = Provenance(
        "import-butd-tsv",
        IMPORTER_VERSION,
        {"files": sorted(p.name for p in files), "max_regions": max_regions},
        None,
        manifest.digest,
    )
    fields = {**regions_fields(max_regions, dim), "valid": FieldSpec((), "uint8")}
    all_notes: dict[str, list[str]] = {}
    with StoreWriter(store_path, "regions", fields, keys, provenance, cfg, log=log) as writer:
        for shard in with_progress(progress, writer.pending_shards()):
            start, stop = writer.shard_range(shard)
            n = stop - start
            data = {
                "features": np.zeros((n, max_regions, dim), np.float32),
                "boxes": np.zeros((n, max_regions, 4), np.float32),
                "n_regions": np.zeros(n, np.int32),
                "image_hw": np.zeros((n, 2), np.int32),
                "valid": np.zeros(n, np.uint8),
            }
            notes: dict[str, list[str]] = {}
            for i, key in enumerate(keys[start:stop]):
                if key not in matched:
                    notes[key] = ["no_tsv_row", "no TSV row matches this key"]
                    continue
                try:
                    row = _read_tsv_row(*index[matched[key]])
                    if row["features"].shape[1] != dim:
                        raise MalformedRow(
                            f"{index[matched[key]][0]}:{index[matched[key]][2]}: features "
                            f"of {row['features'].shape[1]} values per box, others {dim}"
                        )
                except MalformedRow as err:
                    notes[key] = ["malformed_row", str(err)]
                    continue
                r = min(max_regions, len(row["features"]))
                data["features"][i, :r] = row["features"][:r]
                data["boxes"][i, :r] = row["boxes"][:r]
                data["n_regions"][i] = r
                data["image_hw"][i] = row["image_hw"]
                data["valid"][i] = 1
            empty_non_finite(data, fields, keys[start:stop], notes)
            writer.write_shard(shard, data, notes)
            all_notes.update(notes)
    report_notes({k: v for k, v in all_notes.items() if v[0] != "no_tsv_row"}, log)
    return [k for k in keys if k not in matched]
