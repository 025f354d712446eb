"""Bottom-up-attention TSV files, indexed, then imported into a regions store for a
manifest's images; regions stores exported as obj36 TSV files.

Two layouts, told apart by the number of tab-separated fields of a file's first row (or
``fmt``), each array base64-encoded raw bytes:

- ``butd``: Anderson et al.'s ``generate_tsv.py``: ``image_id, image_w, image_h,
  num_boxes, boxes, features`` (float32; WIDTH before height).
- ``obj36``: LXMERT's and py-bottom-up-attention's ``*_obj36.tsv``: ``img_id, img_h,
  img_w, objects_id, objects_conf, attrs_id, attrs_conf, num_boxes, boxes, features``
  (HEIGHT before width; ids int64, the rest float32). Object and attribute ids and
  confidences are kept in the store.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from features.exchange.precomp import (
    IMPORTER_VERSION,
    empty_non_finite,
    report_notes,
    store_indices,
    with_progress,
)
from features.ingest.manifest import IngestError, Manifest
from features.store.spec import FieldSpec, Provenance, StoreConfig, StoreError, regions_fields
from features.store.writer import StoreWriter

LABELS = ("objects", "attrs")  # obj36's per-region class ids and confidences


def label_fields(labels: Iterable[str]) -> list[str]:
    """The id and confidence fields of ``labels``: ``objects_id, objects_conf, ...``."""
    return [f"{x}_{y}" for x in labels for y in ("id", "conf")]


FORMATS = {  # each layout's tab-separated fields, in order
    "butd": ["image_id", "image_w", "image_h", "num_boxes", "boxes", "features"],
    "obj36": ["img_id", "img_h", "img_w", *label_fields(LABELS), "num_boxes", "boxes", "features"],
}


class MalformedRow(ValueError):
    """A TSV row that cannot be parsed; the message says where and why."""


class Source(NamedTuple):
    """What an import reads, for its provenance and messages."""

    extractor: str  # the provenance's extractor name
    first: Path  # the file named when nothing matches
    names: list[str]  # file names, in the provenance
    what: str  # "TSV" or "npz"
    unit: str  # one image's unit: "row" or "file"


def _decode(field: str, count: int, width: int | None, what: str, dtype=np.float32):
    """``count`` rows of ``width`` values (-1: any; None: one value per row)."""
    dtype = np.dtype(dtype)
    try:
        raw = base64.b64decode(field, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedRow(f"{what} is not base64") from None
    size = dtype.itemsize
    if len(raw) % size or (count and width == -1 and len(raw) % (size * count)):
        raise MalformedRow(f"{what}: {len(raw)} bytes do not hold {count} rows of {dtype}")
    values = np.frombuffer(raw, dtype=dtype)
    if count == 0:
        if len(values):
            raise MalformedRow(f"{what}: values for 0 boxes")
        return values.reshape((0,) if width is None else (0, max(width, 0)))
    try:
        return values.reshape((count,) if width is None else (count, width))
    except ValueError:
        per = "" if width is None else f" of {width}"
        raise MalformedRow(f"{what}: {len(values)} values for {count} rows{per}") from None


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
                        if not raw_id.isascii():
                            raise IngestError(
                                f"{path}:{line_no}: image_id {raw_id[:40]!r} is not ASCII text; "
                                "is this a bottom-up-attention TSV file?"
                            )
                        image_id = raw_id.decode("ascii")
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


def tsv_format(path: Path, fmt: str = "auto", probe: int = 100) -> str:
    """``butd`` or ``obj36``: ``fmt``, or told by the field count of the first of the
    file's first ``probe`` rows that has 6 or 10 fields (``butd`` if none has: its rows
    are then refused one by one, naming the fields expected)."""
    if fmt != "auto":
        if fmt not in FORMATS:
            raise IngestError(f"--format {fmt!r}: expected auto, {' or '.join(FORMATS)}")
        return fmt
    try:
        with open(path, "rb") as f:
            for _, line in zip(range(probe), f, strict=False):
                n = line.count(b"\t") + 1
                for name, fields in FORMATS.items():
                    if n == len(fields):
                        return name
    except OSError as err:
        raise IngestError(f"{path}: cannot read ({err.strerror or err})") from None
    return "butd"


def _read_tsv_row(path: Path, offset: int, line_no: int, fmt: str = "butd") -> dict:
    """One TSV row's boxes, features, image size (and, for obj36, object and attribute
    ids and confidences); :class:`MalformedRow` naming the file and line if it does not
    hold the fields of ``fmt``."""
    where = f"{path}:{line_no}"
    names = FORMATS[fmt]
    with open(path, "rb") as f:
        f.seek(offset)
        line = f.readline()
    try:
        fields = line.decode("ascii").rstrip("\r\n").split("\t")
    except UnicodeDecodeError:
        raise MalformedRow(f"{where}: not ASCII (base64) text") from None
    if len(fields) != len(names):
        raise MalformedRow(
            f"{where}: {len(fields)} tab-separated fields, expected {len(names)} "
            f"({', '.join(names)})"
        )
    row = dict(zip(names, fields, strict=True))
    w_name, h_name = ("image_w", "image_h") if fmt == "butd" else ("img_w", "img_h")
    try:
        n, w, h = int(row["num_boxes"]), int(row[w_name]), int(row[h_name])
    except ValueError:
        raise MalformedRow(f"{where}: num_boxes, {w_name} and {h_name} must be integers") from None
    if n < 0 or w < 0 or h < 0 or n > 100_000:
        raise MalformedRow(f"{where}: num_boxes {n}, image {w}x{h} out of range")
    out = {
        "boxes": _decode(row["boxes"], n, 4, f"{where}: boxes"),
        "features": _decode(row["features"], n, -1, f"{where}: features"),
        "image_hw": (h, w),
    }
    for label in LABELS if fmt == "obj36" else ():
        ids = _decode(row[f"{label}_id"], n, None, f"{where}: {label}_id", np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= 2**31):
            raise MalformedRow(
                f"{where}: {label}_id {int(ids.min())}..{int(ids.max())} out of range"
            )
        out[f"{label}_id"] = ids
        out[f"{label}_conf"] = _decode(row[f"{label}_conf"], n, None, f"{where}: {label}_conf")
    return out


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
                    f"{ids[candidates[0]]}: manifest key {key!r} matches image ids {candidates} "
                    "by its trailing number; keep one of those rows, or name the rows by "
                    "manifest key"
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
    fmt: str = "auto",
) -> list[str]:
    """Import TSV features (``butd`` or ``obj36``, see the module) for the manifest's
    images; returns the keys with no TSV row. All files must be of one format."""
    formats = {path: tsv_format(path, fmt) for path in files}
    if len(set(formats.values())) > 1:
        first = {f: p for p, f in reversed(formats.items())}
        raise IngestError(
            f"{first['butd']} is a 6-field bottom-up-attention TSV and {first['obj36']} a "
            "10-field obj36 TSV; import them into separate stores"
        )
    kind = next(iter(formats.values()), "butd")
    index = index_tsv(files)
    return import_regions(
        {i: f"{p}:{line}" for i, (p, _, line) in index.items()},
        lambda image_id: _read_tsv_row(*index[image_id], kind),
        manifest,
        store_path,
        cfg,
        max_regions,
        source=Source("import-butd-tsv", files[0], sorted(p.name for p in files), "TSV", "row"),
        labels=LABELS if kind == "obj36" else (),
        expected=", ".join(FORMATS[kind]),
        progress=progress,
        log=log,
    )


def import_regions(
    ids: Mapping[str, str],
    read_row: Callable[[str], dict],
    manifest: Manifest,
    store_path: Path,
    cfg: StoreConfig,
    max_regions: int,
    source: Source,
    labels: tuple[str, ...],
    expected: str,
    progress: Callable[[Iterable], Iterable] | None = None,
    log: Callable[[str], None] = print,
) -> list[str]:
    """Write a regions store aligned with ``manifest`` from per-image rows: ``ids`` maps
    each file image id to where it is, ``read_row(id)`` returns its ``features`` (n, D),
    ``boxes`` (n, 4), ``image_hw`` and the ``labels`` arrays (n,), or raises
    :class:`MalformedRow`. Returns the keys with no row.

    Keys with no row, rows that cannot be parsed and rows with NaN or infinite values are
    stored empty (``valid = 0``, 0 regions, so the store stays aligned with the manifest)
    and noted by key in the store (``Store.notes()``)."""
    if max_regions < 1:
        raise IngestError(f"--max-regions {max_regions}: expected 1 or more")
    keys = manifest.table["key"].to_pylist()
    matched = match_keys(keys, ids)
    if not matched:
        raise IngestError(
            f"{source.first}: no {source.what} image_id matches a "
            f"manifest key (e.g. {keys[0] if keys else None!r} vs {next(iter(ids), None)!r})"
        )
    dim = None
    for image_id in matched.values():  # the feature size: the first row that parses
        try:
            dim = read_row(image_id)["features"].shape[1]
        except MalformedRow:
            continue
        if dim:
            break
    if not dim:
        raise IngestError(
            f"{source.first}: no {source.unit} of the {len(matched)} matched images can be "
            f"parsed as {expected} with boxes; is this a bottom-up-attention {source.what} file?"
        )
    params = {"files": source.names, "max_regions": max_regions}
    provenance = Provenance(source.extractor, IMPORTER_VERSION, params, None, manifest.digest)
    fields = {
        **regions_fields(max_regions, dim, labels=labels),
        "valid": FieldSpec((), "uint8"),
    }
    missing = f"no_{source.what.lower()}_{source.unit}"
    all_notes: dict[str, list[str]] = {}
    with StoreWriter(store_path, "regions", fields, keys, provenance, cfg, log=log) as writer:
        for shard in with_progress(progress, writer.pending_shards()):
            start, stop = writer.shard_range(shard)
            data = {
                name: np.full(
                    (stop - start, *spec.shape),
                    -1 if name.endswith("_id") else 0,
                    spec.dtype if spec.dtype != "float16" else np.float32,
                )
                for name, spec in fields.items()
            }
            notes: dict[str, list[str]] = {}
            for i, key in enumerate(keys[start:stop]):
                if key not in matched:
                    notes[key] = [missing, f"no {source.what} {source.unit} matches this key"]
                    continue
                try:
                    row = read_row(matched[key])
                    if row["features"].shape[1] != dim:
                        raise MalformedRow(
                            f"{ids[matched[key]]}: features of {row['features'].shape[1]} "
                            f"values per box, others {dim}"
                        )
                except MalformedRow as err:
                    notes[key] = ["malformed_row", str(err)]
                    continue
                r = min(max_regions, len(row["features"]))
                for name in ("features", "boxes", *label_fields(labels)):
                    data[name][i, :r] = row[name][:r]
                data["n_regions"][i] = r
                data["image_hw"][i] = row["image_hw"]
                data["valid"][i] = 1
            empty_non_finite(data, fields, keys[start:stop], notes)
            writer.write_shard(shard, data, notes)
            all_notes.update(notes)
    report_notes({k: v for k, v in all_notes.items() if v[0] != missing}, log)
    return [k for k in keys if k not in matched]


def _b64(values: np.ndarray, dtype) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")


def export_obj36(
    store,
    manifest: Manifest,
    out: Path,
    split: str | None = None,
    log: Callable[[str], None] = print,
    block: int = 256,
) -> tuple[int, list[str]]:
    """Write a regions store as an obj36 TSV (LXMERT's ``load_obj_tsv`` reads it): one row
    per manifest image (of ``split``, or all) with regions, ``img_id`` the manifest key,
    each image's ``n_regions`` regions. Ids are int64 and the rest float32, as in the
    files LXMERT distributes; a store without object/attribute labels writes id -1 and
    confidence 0 (said in one line). Images with no region (invalid, or no TSV row) are
    left out, as LXMERT's loader cannot read a 0-box row; returns (rows written, keys
    left out). The file is written aside and moved into place whole."""
    from infra.files import atomic_path

    if "boxes" not in store.fields:
        raise StoreError(
            f"{store.url}: this regions store has no boxes (a precomp import?); obj36 rows "
            "need them: import bottom-up-attention TSV or npz files, or extract regions"
        )
    table = manifest.table if split is None else manifest.split(split)
    keys = table["key"].to_pylist()
    index = store_indices(store, keys)
    absent = [x for x in LABELS if f"{x}_id" not in store.fields]
    if absent:
        log(
            f"export: {store.url} has no {' or '.join(absent)} labels; writing id -1 and "
            "confidence 0 for them"
        )
    names = ["features", "boxes", "n_regions", "image_hw"]
    names += label_fields(x for x in LABELS if x not in absent)
    written, skipped = 0, []
    with atomic_path(out) as tmp, open(tmp, "w", newline="") as f:
        for lo in range(0, len(index), block):
            data = store.read_indices(index[lo : lo + block], names)
            for i, key in enumerate(keys[lo : lo + block]):
                n = int(data["n_regions"][i])
                if n == 0:
                    skipped.append(key)
                    continue
                h, w = (int(v) for v in data["image_hw"][i])
                labels = []
                for x in LABELS:
                    ids = data[f"{x}_id"][i, :n] if x not in absent else np.full(n, -1)
                    conf = data[f"{x}_conf"][i, :n] if x not in absent else np.zeros(n)
                    labels += [_b64(ids, np.int64), _b64(conf, np.float32)]
                boxes, features = (_b64(data[x][i, :n], np.float32) for x in ("boxes", "features"))
                f.write("\t".join([key, str(h), str(w), *labels, str(n), boxes, features]) + "\n")
                written += 1
    return written, skipped
