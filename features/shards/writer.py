"""Building shards (``vse shards build``): the stores' fields, captions, labels, boxes and
scene graphs packed into tar files per split, ``sizes.json`` last."""

from __future__ import annotations

import io
import json
import re
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from pathlib import Path

import numpy as np
from pydantic import Field

from features.ingest.manifest import SPLITS, Manifest, caption_key
from features.shards.members import member_entry
from features.store.reader import Store
from features.store.spec import FieldSpec, StoreError
from infra.config import Section

SIZES = "sizes.json"


FORMAT = 3  # the layout above; sizes.json of other formats is refused (2: no members)


class ShardsConfig(Section):
    """``shards`` section of params.yaml."""

    samples_per_shard: int = Field(1000, ge=1, le=10_000_000)  # images per tar file
    images_per_group: int = Field(64, ge=1, le=100_000)  # images per tar sample


def member_name(text: str) -> str:
    return re.sub(r"[.\s/]", "_", text)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _add_fields(tar, index: list, prefix: str, store, rows: list[int]) -> None:
    """Every field of ``store`` at ``rows`` as members ``<prefix>.<field>.npy`` (ragged
    fields flat, with ``<prefix>.<field>_offsets.npy``)."""
    for field_name, values in store.read_indices(rows).items():
        if store.fields[field_name].ragged:
            flat, offsets = _flat(values, store.fields[field_name])
            _add(tar, index, f"{prefix}.{field_name}.npy", _npy(flat))
            _add(tar, index, f"{prefix}.{field_name}_offsets.npy", _npy(offsets))
        else:
            _add(tar, index, f"{prefix}.{field_name}.npy", _npy(values))


def _add(tar: tarfile.TarFile, index: list, name: str, data: bytes) -> None:
    """A member with fixed metadata, so identical inputs give identical bytes; its name,
    size and CRC-32C appended to ``index`` (the shard's ``members`` in sizes.json)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))
    index.append(member_entry(name, data))


def build_shards(
    manifest: Manifest,
    stores: Mapping[str, Store],
    out: str | Path,
    cfg: ShardsConfig | None = None,
    progress: Callable[[Iterable], Iterable] | None = None,
    text: Store | None = None,
    scene_graphs: Mapping[str, dict] | None = None,
    scene_graphs_digest: str | None = None,
    storage_options: dict | None = None,
) -> dict:
    """Write every split's shards and ``sizes.json`` to ``out`` (a folder or an fsspec
    URL such as ``s3://bucket/shards``); returns the sizes.

    ``stores`` are image-level (one row per manifest image); ``text`` is the caption-level
    text store; ``scene_graphs`` (caption key -> graph) go into each group's metadata, with
    ``scene_graphs_digest`` (of the graphs file) recorded for the check.

    A local folder is built aside and moved into place whole (a folder that is not a
    shards folder is refused, not replaced); remote shards lose their old ``sizes.json``
    first and get the new one last, so readers never take a half-written set."""
    import fsspec

    from infra.files import atomic_path, is_url

    remote = is_url(out)
    if not remote and Path(out).exists() and not _is_shards_folder(Path(out)):
        raise StoreError(
            f"{out} exists and is not a shards folder (no {SIZES}, or files other than "
            "shards); remove it or choose another --out"
        )
    cfg = cfg or ShardsConfig()
    named = {**stores, **({"text": text} if text else {})}
    for name, store in named.items():
        if store.manifest_digest != manifest.digest:
            raise StoreError(
                f"store {name!r} ({store.url}) was built from manifest "
                f"{store.manifest_digest[:12]}, not from this one ({manifest.digest[:12]}); "
                "rebuild it (dvc repro)"
            )
    if "text" in stores:
        raise StoreError("--store text=...: 'text' names the caption-level store; use --text")
    rows = manifest.table.to_pylist()
    sizes = {
        "format": FORMAT,
        "manifest_digest": manifest.digest,
        "images_per_group": cfg.images_per_group,
        "stores": {name: _describe(store) for name, store in named.items()},
        "scene_graphs": scene_graphs_digest if scene_graphs is not None else None,
        "shards": {},
    }
    with nullcontext(out) if remote else atomic_path(Path(out), directory=True) as target:
        options = storage_options if remote and storage_options else {}
        fs, root = fsspec.core.url_to_fs(str(target), **options)
        root = root.rstrip("/")
        fs.makedirs(root, exist_ok=True)
        for old in fs.glob(f"{root}/*.tar"):
            fs.rm(old)
        if fs.exists(f"{root}/{SIZES}"):
            fs.rm(f"{root}/{SIZES}")
        positions = {}  # image key -> position in its split
        for split in SPLITS:
            split_rows = [r for r in rows if r["split"] == split]
            positions.update({r["key"]: i for i, r in enumerate(split_rows)})
            starts = range(0, len(split_rows), cfg.samples_per_shard)
            for k, start in enumerate(progress(starts) if progress else starts):
                name = f"{split}-{k:06d}.tar"
                chunk = split_rows[start : start + cfg.samples_per_shard]
                with tempfile.TemporaryDirectory() as tmp:
                    local = Path(tmp) / name
                    counts = _write_shard(
                        local, split, chunk, positions, stores, text, scene_graphs, cfg
                    )
                    fs.put_file(str(local), f"{root}/{name}")
                sizes["shards"][name] = {"split": split, **counts}
        with fs.open(f"{root}/{SIZES}", "w") as f:  # last: shards without it are not read
            f.write(json.dumps(sizes, indent=1, sort_keys=True) + "\n")
    return sizes


def _is_shards_folder(folder: Path) -> bool:
    """A folder ``build_shards`` made (and may replace): only tars and ``sizes.json``."""
    if not folder.is_dir():
        return False
    names = {p.name for p in folder.iterdir()}
    return not names or (SIZES in names and all(n == SIZES or n.endswith(".tar") for n in names))


def _describe(store: Store) -> dict:
    """A packed store in ``sizes.json``: its kind, fingerprint and fields as it records them."""
    return {"kind": store.kind, "fingerprint": store.fingerprint, "fields": store.attrs["fields"]}


def _write_shard(path, split, chunk, positions, stores, text, graphs, cfg) -> dict:
    counts = {"images": len(chunk), "captions": 0, "groups": 0}
    index: list = []
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for g in range(0, len(chunk), cfg.images_per_group):
            group = chunk[g : g + cfg.images_per_group]
            key = f"{split}-{positions[group[0]['key']]:09d}"
            captions = [caption_key(r["key"], j) for r in group for j in range(len(r["captions"]))]
            meta = {
                "keys": [r["key"] for r in group],
                "index": [positions[r["key"]] for r in group],
                "labels": [r["label"] for r in group],
                "captions": [r["captions"] for r in group],
                "boxes": [r["boxes"] for r in group],
                "box_names": [r["box_names"] for r in group],
            }
            if graphs is not None:
                meta["scene_graphs"] = [graphs.get(c) for c in captions]
            _add(tar, index, f"{key}.meta.json", json.dumps(meta, sort_keys=True).encode())
            for name, store in stores.items():
                rows = [store.index(k) for k in meta["keys"]]
                _add_fields(tar, index, f"{key}.{member_name(name)}", store, rows)
            if text is not None:
                _add_fields(tar, index, f"{key}.text", text, [text.index(c) for c in captions])
            counts["captions"] += len(captions)
            counts["groups"] += 1
    return {**counts, "bytes": Path(path).stat().st_size, "members": index}


def _flat(values: list[np.ndarray], spec: FieldSpec) -> tuple[np.ndarray, np.ndarray]:
    lengths = [len(v) for v in values]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if not values or not offsets[-1]:
        return np.zeros((0, *spec.shape), spec.dtype), offsets
    return np.concatenate([np.asarray(v, spec.dtype) for v in values]), offsets


def read_scene_graphs(folder: Path) -> dict[str, dict]:
    """Scene graphs of a scene-graph folder by caption key (without the caption text)."""
    from features.scenegraph.files import read_graph_rows

    rows = read_graph_rows(folder)
    return {r.pop("key"): {k: v for k, v in r.items() if k != "caption"} for r in rows}
