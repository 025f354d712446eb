"""SCAN/VSE++ "precomp" folders in and out, and what the other importers share.

A precomp split is ``{split}_ims.npy`` (N, 36, 2048) float32, ``{split}_caps.txt``
(captions_per_image lines per image, in image order) and, optionally, ``{split}_ids.txt``
(one id per image, or one per caption). ``_ims.npy`` has one row per image, or one row per
caption (the reference loaders' ``im_div = 1``: each image's row repeated for each of its
captions), recognised by the repeated rows. Import makes a manifest and a regions store (no
boxes: the precomp format has none); export writes one row per image, so numbers can be
cross-checked against the reference code bases on identical inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from features.ingest.manifest import (
    Dataset,
    IngestError,
    Manifest,
    Record,
    manifest_digest,
    read_manifest,
    write_manifest,
)
from features.ingest.validate import check_key
from features.store.spec import FieldSpec, Provenance, StoreConfig, StoreError, regions_fields
from features.store.writer import StoreWriter
from infra.config import one_line
from infra.finite import NON_FINITE, finite_rows

PRECOMP_SPLITS = {"train": "train", "dev": "val", "test": "test", "testall": "test"}


IMPORTER_VERSION = "1"


def with_progress(progress, items):
    return progress(items) if progress else items


def _read_utf8(path: Path) -> str:
    """A text file as UTF-8, or a one-line error naming the file and line."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise IngestError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise IngestError(f"{path}:{line}: not valid UTF-8; re-encode the file") from None


def _load_features(path: Path) -> np.ndarray:
    """A precomp ``*_ims.npy``, memory-mapped, checked: (N, regions, dim) real numbers."""
    try:
        ims = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - any malformed or truncated file: one line
        detail = one_line(err)
        raise IngestError(
            f"{path}: not a readable .npy array ({type(err).__name__}: {detail}); re-create "
            "it with numpy.save or download it again"
        ) from None
    if not isinstance(ims, np.ndarray) or ims.dtype.kind not in "fiu" or ims.ndim != 3:
        raise IngestError(
            f"{path}: {getattr(ims, 'dtype', type(ims).__name__)} array of shape "
            f"{getattr(ims, 'shape', '?')}; expected real numbers of shape (images, regions, dim)"
        )
    if 0 in ims.shape:
        raise IngestError(f"{path}: shape {ims.shape} holds no features")
    return ims


def _rows_per_image(ims: np.ndarray, path: Path, block_bytes: int = 1 << 26) -> int:
    """Rows per image of an ``_ims.npy`` with as many rows as captions: k when every image's
    row is repeated k times in a row (one row per caption, ``im_div = 1`` in VSE++/SCAN's
    loaders), 1 when rows 0 and 1 differ (one caption per image); rows that repeat for the
    first image but not for every image are a one-line error. Rows compare byte for byte
    (a copied row is the same bytes, NaN included), read about ``block_bytes`` at a time."""
    n, k = len(ims), 1
    while k < n and ims[k].tobytes() == ims[0].tobytes():
        k += 1
    if k == 1:
        return 1
    what = (
        f"{path}: rows 0-{k - 1} hold one image {k} times (one row per caption, as in "
        "VSE++/SCAN's im_div = 1)"
    )
    todo = f"save one row per image, or {k} identical rows for every image"
    if n % k:
        raise IngestError(f"{what}, but its {n} rows are not a whole number of images; {todo}")
    row = ims.nbytes // n  # bytes per row
    step = max(1, block_bytes // (row * k)) * k  # whole images per block
    for lo in range(0, n, step):
        block = np.ascontiguousarray(ims[lo : lo + step])  # (rows, regions, dim)
        rows = block.view(np.uint8).reshape(len(block) // k, k, row)  # (images, k, bytes)
        differ = (rows != rows[:, :1]).any(axis=2)  # (images, k)
        if differ.any():
            image, copy = (int(i) for i in np.argwhere(differ)[0])
            first = lo + image * k
            raise IngestError(f"{what}, but row {first + copy} differs from row {first}; {todo}")
    return k


def read_precomp_split(folder: Path, name: str) -> tuple[np.ndarray, list[str], list[str]]:
    """Memory-mapped features, captions and one key per image of one precomp split."""
    ims_path, caps_path = folder / f"{name}_ims.npy", folder / f"{name}_caps.txt"
    for path in (ims_path, caps_path):
        if not path.is_file():
            raise IngestError(
                f"{path}: missing; a precomp split needs {name}_ims.npy and {name}_caps.txt"
            )
    ims = _load_features(ims_path)
    captions = _read_utf8(caps_path).splitlines()
    if len(captions) < len(ims) or len(captions) % len(ims):
        raise IngestError(
            f"{ims_path}: {ims.shape} features for {len(captions)} captions in {caps_path.name}; "
            "expected (N, regions, dim) and a whole number of captions per image (1 or more)"
        )
    if len(captions) == len(ims) > 1:
        ims = ims[:: _rows_per_image(ims, ims_path)]
    per_image = len(captions) // len(ims)
    ids_path = folder / f"{name}_ids.txt"
    if ids_path.exists():
        keys = _read_utf8(ids_path).split()
        if len(keys) == len(captions) and per_image > 1:
            keys = keys[::per_image]  # one id per caption
        if len(keys) != len(ims):
            raise IngestError(f"{ids_path}: {len(keys)} ids for {len(ims)} images")
        for key in keys:
            if problem := check_key(key):
                raise IngestError(f"{ids_path}: {problem}")
        if len(set(keys)) != len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise IngestError(f"{ids_path}: id {twice!r} occurs more than once")
    else:
        keys = [f"{name}_{i:06d}" for i in range(len(ims))]
    return ims, captions, keys


def empty_non_finite(data: dict, fields: dict, keys: list[str], notes: dict) -> None:
    """Samples of one shard whose values are not finite as stored: emptied (``valid``
    0, no regions) and noted by key, like a bad image."""
    bad: dict[int, list[str]] = {}
    for name, spec in fields.items():
        if np.dtype(spec.dtype).kind != "f" or name not in data:
            continue
        with np.errstate(over="ignore", invalid="ignore"):
            stored = data[name].astype(spec.dtype)
        for i in np.flatnonzero(~finite_rows(stored)):
            bad.setdefault(int(i), []).append(name)
    for i, names in sorted(bad.items()):
        for values in data.values():
            values[i] = 0
        notes[keys[i]] = [NON_FINITE, f"{', '.join(names)}: NaN or infinite values"]


def report_notes(notes: dict, log: Callable[[str], None]) -> None:
    """One line per reason: how many samples were stored empty, and which."""
    by_reason: dict[str, list[str]] = {}
    for key, (reason, detail) in notes.items():
        by_reason.setdefault(reason, []).append(f"{key} ({detail.split(':')[0]})")
    for reason, items in sorted(by_reason.items()):
        log(
            f"import: {len(items)} images stored empty (valid = 0) for {reason}: "
            + ", ".join(items[:10])
            + (", ..." if len(items) > 10 else "")
            + " (Store.notes() lists them all)"
        )


def import_precomp(
    folder: Path,
    splits: list[str],
    manifest_path: Path,
    store_path: Path,
    cfg: StoreConfig,
    progress: Callable[[Iterable], Iterable] | None = None,
    log: Callable[[str], None] = print,
) -> Manifest:
    """Import precomp splits as one manifest and one regions store (same key order).

    Every file is read and checked before anything is written; the store is written
    (aside, then moved into place) before the manifest, so neither is ever partial."""
    parts, records = [], []
    if not splits:
        raise IngestError("no precomp split given; pass --splits train dev test")
    for name in splits:
        if name not in PRECOMP_SPLITS:
            raise IngestError(f"precomp split {name!r}: expected one of {list(PRECOMP_SPLITS)}")
        ims, captions, keys = read_precomp_split(folder, name)
        per_image = len(captions) // len(ims)
        for i, key in enumerate(keys):
            caps = captions[i * per_image : (i + 1) * per_image]
            records.append(Record(key, "", PRECOMP_SPLITS[name], caps))
        parts.append(ims)
    duplicates = len(records) - len({r.key for r in records})
    if duplicates:
        raise IngestError(
            f"{folder}: {duplicates} image ids occur in more than one split "
            f"of {splits}; import overlapping splits (test, testall) separately"
        )
    n_regions, dim = parts[0].shape[1:]
    if any(p.shape[1:] != (n_regions, dim) for p in parts):
        raise IngestError(f"{folder}: splits {splits} have different feature shapes")
    per_image = len(records[0].captions)
    dataset = Dataset("precomp", records)
    provenance = Provenance(
        "import-precomp",
        IMPORTER_VERSION,
        {"folder": folder.name, "splits": splits},
        None,
        manifest_digest(records, dataset.class_names),
    )
    fields = {**regions_fields(n_regions, dim, boxes=False), "valid": FieldSpec((), "uint8")}
    keys = [r.key for r in records]
    starts = np.cumsum([0] + [len(p) for p in parts])
    notes: dict[str, list[str]] = {}
    with StoreWriter(store_path, "regions", fields, keys, provenance, cfg, log=log) as writer:
        for shard in with_progress(progress, writer.pending_shards()):
            start, stop = writer.shard_range(shard)
            data = {
                "features": _rows(parts, starts, start, stop).astype(np.float32, copy=False),
                "n_regions": np.full(stop - start, n_regions, np.int32),
                "image_hw": np.zeros((stop - start, 2), np.int32),  # not in the format
                "valid": np.ones(stop - start, np.uint8),
            }
            shard_notes: dict[str, list[str]] = {}
            empty_non_finite(data, fields, keys[start:stop], shard_notes)
            writer.write_shard(shard, data, shard_notes)
            notes.update(shard_notes)
    report_notes(notes, log)
    write_manifest(records, dataset, per_image, manifest_path)
    return read_manifest(manifest_path)


def _rows(parts: list[np.ndarray], starts: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of the concatenation of ``parts``, without concatenating them."""
    out = []
    for part, offset in zip(parts, starts[:-1], strict=True):
        lo, hi = max(start - offset, 0), min(stop - offset, len(part))
        if lo < hi:
            out.append(np.asarray(part[lo:hi]))
    return np.concatenate(out)


def store_indices(store, keys: list[str]) -> np.ndarray:
    """The store rows of ``keys``, or a one-line error naming a key the store lacks."""
    try:
        return np.array([store.index(key) for key in keys], dtype=np.int64)
    except KeyError as err:
        raise StoreError(
            f"{err.args[0]}; export with the manifest the store was built from"
        ) from None


def export_precomp(
    store,
    manifest: Manifest,
    split: str,
    out_dir: Path,
    name: str | None = None,
    n_regions: int = 36,
) -> Path:
    """Write ``{name}_ims.npy`` (float32, padded/cut to ``n_regions``), ``{name}_caps.txt``
    and ``{name}_ids.txt`` for one manifest split, in manifest order."""
    name = name or {"val": "dev"}.get(split, split)
    table = manifest.split(split).to_pylist()
    counts = {len(r["captions"]) for r in table}
    if len(counts) > 1:
        raise IngestError(
            f"split {split}: images have {sorted(counts)} captions; the precomp "
            "layout needs the same number for every image"
        )
    from infra.files import atomic_path, write_text

    index = store_indices(store, [r["key"] for r in table])
    dim = store.fields["features"].shape[-1]
    # each file is written aside and moved into place whole
    with atomic_path(out_dir / f"{name}_ims.npy") as tmp:
        ims = np.lib.format.open_memmap(
            tmp, mode="w+", dtype=np.float32, shape=(len(table), n_regions, dim)
        )
        for lo in range(0, len(index), 256):
            block = store.read_indices(index[lo : lo + 256], ["features"])["features"]
            r = min(n_regions, block.shape[1])
            ims[lo : lo + len(block), :r] = block[:, :r]
        ims.flush()
        del ims
    caps = "".join(c.replace("\n", " ") + "\n" for row in table for c in row["captions"])
    write_text(out_dir / f"{name}_caps.txt", caps)
    write_text(out_dir / f"{name}_ids.txt", "".join(r["key"] + "\n" for r in table))
    return out_dir / f"{name}_ims.npy"
