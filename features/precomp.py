"""Importers and exporters for precomputed region features people already have.

- SCAN/VSE++ "precomp" folders: ``{split}_ims.npy`` (N, 36, 2048) float32, ``{split}_caps.txt``
  (captions_per_image lines per image, in image order) and, optionally, ``{split}_ids.txt``
  (one id per image, or one per caption). Import makes a manifest and a regions store
  (no boxes: the precomp format has none); export writes the same layout from a store, so
  numbers can be cross-checked against the reference code bases on identical inputs.
- bottom-up-attention TSV files (tab-separated ``image_id, image_w, image_h, num_boxes,
  boxes, features``; boxes and features base64-encoded float32): imported into a regions
  store aligned with an existing manifest, matched by key or by the trailing integer of
  the key (COCO file stems end in the image id).
"""

from __future__ import annotations

import base64
import csv
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from features.ingest import (
    Dataset,
    IngestError,
    Manifest,
    Record,
    read_manifest,
    write_manifest,
)
from features.store import Provenance, StoreConfig, StoreWriter, regions_fields

PRECOMP_SPLITS = {"train": "train", "dev": "val", "test": "test", "testall": "test"}
TSV_FIELDS = ["image_id", "image_w", "image_h", "num_boxes", "boxes", "features"]
IMPORTER_VERSION = "1"


def _progress(progress, items):
    return progress(items) if progress else items


# --------------------------------------------------------------------------- precomp


def read_precomp_split(folder: Path, name: str) -> tuple[np.ndarray, list[str], list[str]]:
    """Memory-mapped features, captions and one key per image of one precomp split."""
    ims_path, caps_path = folder / f"{name}_ims.npy", folder / f"{name}_caps.txt"
    for path in (ims_path, caps_path):
        if not path.exists():
            raise IngestError(
                f"{path}: missing; a precomp split needs {name}_ims.npy and {name}_caps.txt"
            )
    ims = np.load(ims_path, mmap_mode="r")
    captions = caps_path.read_text(encoding="utf-8").splitlines()
    if ims.ndim != 3 or len(captions) % len(ims):
        raise IngestError(
            f"{ims_path}: {ims.shape} features for {len(captions)} captions; expected "
            "(N, regions, dim) and a whole number of captions per image"
        )
    per_image = len(captions) // len(ims)
    ids_path = folder / f"{name}_ids.txt"
    if ids_path.exists():
        ids = ids_path.read_text().split()
        if len(ids) == len(captions) and per_image > 1:
            ids = ids[::per_image]  # one id per caption
        if len(ids) != len(ims):
            raise IngestError(f"{ids_path}: {len(ids)} ids for {len(ims)} images")
        keys = [str(i) for i in ids]
    else:
        keys = [f"{name}_{i:06d}" for i in range(len(ims))]
    return ims, captions, keys


def import_precomp(
    folder: Path,
    splits: list[str],
    manifest_path: Path,
    store_path: Path,
    cfg: StoreConfig,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> Manifest:
    """Import precomp splits as one manifest and one regions store (same key order)."""
    parts, records = [], []
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
    meta = write_manifest(records, Dataset("precomp", records), per_image, manifest_path)
    provenance = Provenance(
        "import-precomp",
        IMPORTER_VERSION,
        {"folder": folder.name, "splits": splits},
        None,
        meta["digest"],
    )
    fields = regions_fields(n_regions, dim, boxes=False)
    keys = [r.key for r in records]
    starts = np.cumsum([0] + [len(p) for p in parts])
    with StoreWriter(store_path, "regions", fields, keys, provenance, cfg) as writer:
        for shard in _progress(progress, writer.pending_shards()):
            start, stop = writer.shard_range(shard)
            writer.write_shard(
                shard,
                {
                    "features": _rows(parts, starts, start, stop),
                    "n_regions": np.full(stop - start, n_regions),
                    "image_hw": np.zeros((stop - start, 2)),  # not in the precomp format
                },
            )
    return read_manifest(manifest_path)


def _rows(parts: list[np.ndarray], starts: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of the concatenation of ``parts``, without concatenating them."""
    out = []
    for part, offset in zip(parts, starts[:-1], strict=True):
        lo, hi = max(start - offset, 0), min(stop - offset, len(part))
        if lo < hi:
            out.append(np.asarray(part[lo:hi]))
    return np.concatenate(out)


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
    index = np.array([store.index(r["key"]) for r in table], dtype=np.int64)
    out_dir.mkdir(parents=True, exist_ok=True)
    dim = store.fields["features"].shape[-1]
    ims = np.lib.format.open_memmap(
        out_dir / f"{name}_ims.npy", mode="w+", dtype=np.float32, shape=(len(table), n_regions, dim)
    )
    for lo in range(0, len(index), 256):
        block = store.read_indices(index[lo : lo + 256], ["features"])["features"]
        r = min(n_regions, block.shape[1])
        ims[lo : lo + len(block), :r] = block[:, :r]
    ims.flush()
    with open(out_dir / f"{name}_caps.txt", "w", encoding="utf-8") as f:
        for row in table:
            f.writelines(c.replace("\n", " ") + "\n" for c in row["captions"])
    (out_dir / f"{name}_ids.txt").write_text("".join(r["key"] + "\n" for r in table))
    return out_dir / f"{name}_ims.npy"


# --------------------------------------------------------------------------- BUTD TSV


def _decode(field: str, count: int, width: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(field), dtype=np.float32).reshape(count, width)


def index_tsv(files: list[Path]) -> dict[str, tuple[Path, int]]:
    """Image id -> (file, byte offset of its line): one pass, no features kept in memory."""
    index = {}
    for path in files:
        with open(path, "rb") as f:
            offset = 0
            for line in f:
                index[line.split(b"\t", 1)[0].decode()] = (path, offset)
                offset += len(line)
    return index


def _read_tsv_row(path: Path, offset: int) -> dict:
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="ascii") as f:
        f.seek(offset)
        row = next(csv.DictReader(f, delimiter="\t", fieldnames=TSV_FIELDS))
    n = int(row["num_boxes"])
    return {
        "boxes": _decode(row["boxes"], n, 4),
        "features": _decode(row["features"], n, -1),
        "image_hw": (int(row["image_h"]), int(row["image_w"])),
    }


def match_keys(keys: list[str], ids: Iterable[str]) -> dict[str, str]:
    """Manifest key -> TSV image id, exactly or by the key's trailing integer."""
    ids = set(ids)
    by_number = {}
    for image_id in ids:
        if image_id.isdigit():
            by_number[int(image_id)] = image_id
    matched = {}
    for key in keys:
        if key in ids:
            matched[key] = key
        elif m := re.search(r"(\d+)$", key):
            if int(m.group(1)) in by_number:
                matched[key] = by_number[int(m.group(1))]
    return matched


def import_butd_tsv(
    files: list[Path],
    manifest: Manifest,
    store_path: Path,
    cfg: StoreConfig,
    max_regions: int = 36,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> list[str]:
    """Import TSV features for the manifest's images; returns the keys with no TSV row
    (stored with 0 regions, so the store stays aligned with the manifest)."""
    keys = manifest.table["key"].to_pylist()
    index = index_tsv(files)
    matched = match_keys(keys, index)
    if not matched:
        raise IngestError(
            f"{files[0]}: no TSV image_id matches a manifest key "
            f"(e.g. {keys[0]!r} vs {next(iter(index), None)!r})"
        )
    first = _read_tsv_row(*index[next(iter(matched.values()))])
    dim = first["features"].shape[1]
    provenance = Provenance(
        "import-butd-tsv",
        IMPORTER_VERSION,
        {"files": sorted(p.name for p in files), "max_regions": max_regions},
        None,
        manifest.digest,
    )
    fields = regions_fields(max_regions, dim)
    with StoreWriter(store_path, "regions", fields, keys, provenance, cfg) as writer:
        for shard in _progress(progress, writer.pending_shards()):
            start, stop = writer.shard_range(shard)
            n = stop - start
            data = {
                "features": np.zeros((n, max_regions, dim), np.float16),
                "boxes": np.zeros((n, max_regions, 4), np.float32),
                "n_regions": np.zeros(n, np.int32),
                "image_hw": np.zeros((n, 2), np.int32),
            }
            for i, key in enumerate(keys[start:stop]):
                if key not in matched:
                    continue
                row = _read_tsv_row(*index[matched[key]])
                r = min(max_regions, len(row["features"]))
                data["features"][i, :r] = row["features"][:r]
                data["boxes"][i, :r] = row["boxes"][:r]
                data["n_regions"][i] = r
                data["image_hw"][i] = row["image_hw"]
            writer.write_shard(shard, data)
    return [k for k in keys if k not in matched]
