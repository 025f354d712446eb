"""WebDataset shards: per-split training samples packed from the manifest and the stores,
for streaming training (many machines, object storage). The only code that knows the
shard layout.

A shard is a standard tar file (``{split}-{index:06d}.tar``, any WebDataset reader opens
it); each WebDataset sample in it is a *group* of up to ``images_per_group`` consecutive
images of the split (few, large members: tar parsing is per member, so the per-image
cost of streaming is that of copying bytes) with all their captions::

    <key>.meta.json                  {"keys", "index" (split positions), "labels",
                                      "captions", "boxes", "box_names"} per image, and
                                      "scene_graphs" per caption when packed
    <key>.<store>.<field>.npy        each field of each packed image store, (G, ...)
    <key>.text.<field>.npy           a caption-level text store field: dense (C, ...),
    <key>.text.<field>_offsets.npy   or ragged: the captions' rows back to back and where
                                     each caption starts (C + 1,)

Arrays are ``.npy`` members (``np.load`` reads them). ``sizes.json`` records what the
shards were built from (manifest digest, each packed store's kind, fingerprint and
fields, the scene graphs' digest) and, per shard, its split and counts of images,
captions and groups: a reader refuses shards built from other inputs
(:func:`check_sources`). Identical inputs give identical bytes (fixed tar headers).

Reading (:func:`read_groups`) parses the tar headers itself and decodes members with
numpy: a local shard is memory-mapped, so a group's arrays are views of the page cache
(no copy until a batch is gathered); an ``s3://`` (any fsspec URL) shard is read
sequentially. :class:`GroupColumns` gathers batch rows from a buffer of groups with the
same vectorised gathers as the stores (``gather``, ``gather_ragged``), so training builds
a batch from shards with the code that builds it from stores.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import re
import tarfile
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import Field

from features.config import Section
from features.ingest import SPLITS, Manifest
from features.store import FieldSpec, Store, StoreError, padded_rows, take_rows

SIZES = "sizes.json"
FORMAT = 2  # the layout above; sizes.json of other formats is refused
TAR_BLOCK = 512


class ShardsConfig(Section):
    """``shards`` section of params.yaml."""

    samples_per_shard: int = Field(1000, ge=1, le=10_000_000)  # images per tar file
    images_per_group: int = Field(64, ge=1, le=100_000)  # images per tar sample


# --------------------------------------------------------------------------- writing


def _safe(text: str) -> str:
    return re.sub(r"[.\s/]", "_", text)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _add_fields(tar, prefix: str, store, rows: list[int]) -> None:
    """Every field of ``store`` at ``rows`` as members ``<prefix>.<field>.npy`` (ragged
    fields flat, with ``<prefix>.<field>_offsets.npy``)."""
    for field_name, values in store.read_indices(rows).items():
        if store.fields[field_name].ragged:
            flat, offsets = _flat(values, store.fields[field_name])
            _add(tar, f"{prefix}.{field_name}.npy", _npy(flat))
            _add(tar, f"{prefix}.{field_name}_offsets.npy", _npy(offsets))
        else:
            _add(tar, f"{prefix}.{field_name}.npy", _npy(values))


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A member with fixed metadata, so identical inputs give identical bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


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
    from features.files import atomic_path

    if "://" not in str(out):
        out = Path(out)
        if out.exists() and not _is_shards_folder(out):
            raise StoreError(
                f"{out} exists and is not a shards folder (no {SIZES}, or files other than "
                "shards); remove it or choose another --out"
            )
        with atomic_path(out, directory=True) as tmp:
            return _build(
                manifest, stores, tmp, cfg, progress, text, scene_graphs, scene_graphs_digest, None
            )
    return _build(
        manifest,
        stores,
        out,
        cfg,
        progress,
        text,
        scene_graphs,
        scene_graphs_digest,
        storage_options,
    )


def _is_shards_folder(folder: Path) -> bool:
    """A folder ``build_shards`` made (and may replace): only tars and ``sizes.json``."""
    if not folder.is_dir():
        return False
    names = {p.name for p in folder.iterdir()}
    return not names or (SIZES in names and all(n == SIZES or n.endswith(".tar") for n in names))


def _build(
    manifest, stores, out, cfg, progress, text, scene_graphs, scene_graphs_digest, storage_options
) -> dict:
    import fsspec

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
    fs, root = fsspec.core.url_to_fs(str(out), **(storage_options or {}))
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    for old in fs.glob(f"{root}/*.tar"):
        fs.rm(old)
    if fs.exists(f"{root}/{SIZES}"):
        fs.rm(f"{root}/{SIZES}")
    rows = manifest.table.to_pylist()
    caption_rows = text_rows(text, rows) if text else None
    sizes = {
        "format": FORMAT,
        "manifest_digest": manifest.digest,
        "images_per_group": cfg.images_per_group,
        "stores": {name: _describe(store) for name, store in named.items()},
        "scene_graphs": scene_graphs_digest if scene_graphs is not None else None,
        "shards": {},
    }
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
                    local, split, chunk, positions, stores, text, caption_rows, scene_graphs, cfg
                )
                fs.put_file(str(local), f"{root}/{name}")
            sizes["shards"][name] = {"split": split, **counts}
    with fs.open(f"{root}/{SIZES}", "w") as f:  # last: shards without it are not read
        f.write(json.dumps(sizes, indent=1, sort_keys=True) + "\n")
    return sizes


def _describe(store: Store) -> dict:
    return {
        "kind": store.kind,
        "fingerprint": store.fingerprint,
        "fields": {
            k: {"shape": list(v.shape), "dtype": v.dtype, "ragged": v.ragged}
            for k, v in store.fields.items()
        },
    }


def text_rows(text: Store, rows: list[dict]) -> dict[str, int]:
    """Row of each caption key (``<image>#<i>``) in the text store."""
    keys = [f"{r['key']}#{j}" for r in rows for j in range(len(r["captions"]))]
    return {k: text.index(k) for k in keys}


def _write_shard(path, split, chunk, positions, stores, text, caption_rows, graphs, cfg) -> dict:
    counts = {"images": len(chunk), "captions": 0, "groups": 0}
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for g in range(0, len(chunk), cfg.images_per_group):
            group = chunk[g : g + cfg.images_per_group]
            key = f"{split}-{positions[group[0]['key']]:09d}"
            captions = [f"{r['key']}#{j}" for r in group for j in range(len(r["captions"]))]
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
            _add(tar, f"{key}.meta.json", json.dumps(meta, sort_keys=True).encode())
            image_keys = [r["key"] for r in group]
            for name, store in stores.items():
                rows = [store.index(k) for k in image_keys]
                _add_fields(tar, f"{key}.{_safe(name)}", store, rows)
            if text is not None:
                _add_fields(tar, f"{key}.text", text, [caption_rows[c] for c in captions])
            counts["captions"] += len(captions)
            counts["groups"] += 1
    return counts


def _flat(values: list[np.ndarray], spec: FieldSpec) -> tuple[np.ndarray, np.ndarray]:
    lengths = [len(v) for v in values]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if not values or not offsets[-1]:
        return np.zeros((0, *spec.shape), spec.dtype), offsets
    return np.concatenate([np.asarray(v, spec.dtype) for v in values]), offsets


def read_scene_graphs(folder: Path) -> dict[str, dict]:
    """Scene graphs of a scene-graph folder by caption key (without the caption text)."""
    from features.scenegraph_files import read_graph_rows

    rows = read_graph_rows(folder)
    return {r.pop("key"): {k: v for k, v in r.items() if k != "caption"} for r in rows}


# --------------------------------------------------------------------------- reading


def _join(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def read_sizes(url: str | Path, storage_options: dict | None = None) -> dict:
    """``sizes.json`` of the shards at ``url`` (a folder or an fsspec URL)."""
    import fsspec

    path = _join(str(url), SIZES)
    try:
        with fsspec.open(path, "r", **(storage_options or {})) as f:
            sizes = json.load(f)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; build the shards with `vse shards build`") from None
    if sizes.get("format") != FORMAT:
        raise StoreError(
            f"{path}: shards of format {sizes.get('format', 1)}, this code reads format "
            f"{FORMAT}; rebuild them with `vse shards build`"
        )
    return sizes


def shard_names(sizes: Mapping, split: str) -> list[str]:
    return sorted(n for n, s in sizes["shards"].items() if s["split"] == split)


def check_sources(
    url: str,
    sizes: Mapping,
    manifest_digest: str,
    stores: Mapping[str, Store],
    scene_graphs_digest: str | None = None,
) -> dict[str, str]:
    """Which packed store holds each of ``stores`` (role -> name in the shards), refusing
    shards built from another manifest, without a store, or with other scene graphs."""
    where = _join(str(url), SIZES)
    if sizes["manifest_digest"] != manifest_digest:
        raise StoreError(
            f"{where}: built from manifest {sizes['manifest_digest'][:12]}, training uses "
            f"{manifest_digest[:12]}; rebuild the shards (vse shards build) from these stores"
        )
    by_print = {s["fingerprint"]: name for name, s in sizes["stores"].items()}
    found = {}
    for role, store in stores.items():
        if store.fingerprint not in by_print:
            raise StoreError(
                f"{where}: no packed store has the fingerprint {store.fingerprint[:12]} of "
                f"{store.url} ({role}); rebuild the shards with `vse shards build` and "
                f"--{'text' if role == 'text' else 'store ' + role + '='}{store.url}"
            )
        found[role] = by_print[store.fingerprint]
    if scene_graphs_digest is not None and sizes.get("scene_graphs") != scene_graphs_digest:
        raise StoreError(
            f"{where}: the shards hold {'other' if sizes.get('scene_graphs') else 'no'} scene "
            "graphs than the scene-graph folder in use; rebuild them with --scenegraphs"
        )
    return found


@dataclass
class Group:
    """One packed group: its metadata and arrays (views of the mapped shard when local)."""

    meta: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n_images(self) -> int:
        return len(self.meta["keys"])

    @property
    def caption_image(self) -> np.ndarray:
        """``(C,)`` image row (within the group) of each caption."""
        counts = [len(c) for c in self.meta["captions"]]
        return np.repeat(np.arange(len(counts)), counts)


_NPY_HEADER = re.compile(
    rb"\{'descr': '([<>|][a-z]\d+)', 'fortran_order': False, 'shape': \(([\d, ]*)\), \}"
)


def decode_npy(data) -> np.ndarray:
    """``.npy`` bytes (or a buffer) -> array without copying the data (numpy's own reader
    parses the header with ``ast`` and copies)."""
    view = memoryview(data)
    if bytes(view[:6]) == b"\x93NUMPY" and view[6] == 1:
        header_len = int.from_bytes(view[8:10], "little")
        match = _NPY_HEADER.match(bytes(view[10 : 10 + header_len]))
        if match:
            shape = tuple(int(d) for d in match.group(2).split(b",") if d.strip())
            dtype = np.dtype(match.group(1).decode())
            return np.frombuffer(view, dtype, offset=10 + header_len).reshape(shape)
    return np.load(io.BytesIO(bytes(view)), allow_pickle=False)


def _members(url: str, storage_options: dict | None) -> Iterator[tuple[str, memoryview]]:
    """``(name, data)`` of each regular member of the tar at ``url``: a local file is
    memory-mapped (the data are views of it), a remote one read in sequence."""
    if "://" not in url or url.startswith("file://"):
        view = _mapped(url.removeprefix("file://"))
        if len(view):
            yield from _parse(lambda offset, n: view[offset : offset + n], len(view))
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    with fs.open(path, "rb", block_size=16 << 20) as f:
        position = [0]

        def read_remote(offset: int, n: int) -> memoryview:
            if offset != position[0]:
                f.seek(offset)
            data = f.read(n)
            position[0] = offset + len(data)
            return memoryview(data)

        yield from _parse(read_remote, None)


_MAPPED: OrderedDict = OrderedDict()  # local shards stay mapped between epochs
MAX_MAPPED = 1024


def _mapped(path: str) -> memoryview:
    """The local file ``path`` memory-mapped (kept, while unchanged): its pages are
    mapped once, not faulted in again every epoch. Populated: the kernel maps every page
    of the file at once, cheaper than faulting them in one by one."""
    stat = Path(path).stat()
    key = (path, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key in _MAPPED:
        _MAPPED.move_to_end(key)
        return _MAPPED[key]
    if not stat.st_size:
        return memoryview(b"")
    with open(path, "rb") as f:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        view = memoryview(mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ))
    if len(_MAPPED) >= MAX_MAPPED:
        _MAPPED.popitem(last=False)
    _MAPPED[key] = view
    return view


def _parse(read: Callable[[int, int], memoryview], size: int | None):
    """Walk tar headers (ustar, GNU long names, pax paths) from offset 0."""
    offset, long_name = 0, None
    while size is None or offset + TAR_BLOCK <= size:
        header = bytes(read(offset, TAR_BLOCK))
        if len(header) < TAR_BLOCK or header == b"\0" * TAR_BLOCK:
            return
        name = header[:100].split(b"\0", 1)[0].decode()
        if header[257:263] == b"ustar\0":  # POSIX ustar: a path may be split in two
            prefix = header[345:500].split(b"\0", 1)[0].decode()
            name = f"{prefix}/{name}" if prefix else name
        length = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        kind = header[156:157]
        data_at = offset + TAR_BLOCK
        offset = data_at + -(-length // TAR_BLOCK) * TAR_BLOCK
        if kind == b"L":  # GNU long name: the next member's name
            long_name = bytes(read(data_at, length)).split(b"\0", 1)[0].decode()
            continue
        if kind == b"x":  # pax header: a path record names the next member
            for record in bytes(read(data_at, length)).decode().splitlines():
                _, _, item = record.partition(" ")
                if item.startswith("path="):
                    long_name = item[5:]
            continue
        if kind in (b"0", b"\0"):
            yield (long_name or name), read(data_at, length)
        long_name = None


def read_groups(url: str, storage_options: dict | None = None) -> Iterator[Group]:
    """The groups of one shard, in order."""
    current: Group | None = None
    key = None
    for name, data in _members(url, storage_options):
        base = name.rsplit("/", 1)[-1]
        member_key, _, suffix = base.partition(".")
        if member_key != key:
            if current is not None:
                yield current
            current, key = Group({}), member_key
        if suffix == "meta.json":
            current.meta = json.loads(bytes(data))
        elif suffix.endswith(".npy"):
            current.arrays[suffix[: -len(".npy")]] = decode_npy(data)
    if current is not None:
        yield current


class GroupColumns:
    """The rows of one packed store (``prefix``: its name in the shards, or "text") over
    a list of groups laid end to end: ``gather`` and ``gather_ragged`` as a
    :class:`features.store.Store` has them, with row ``i`` the i-th image (or caption) of
    the concatenated groups."""

    def __init__(self, groups: list[Group], prefix: str, fields: Mapping, per_group: str):
        self.groups, self.prefix = groups, _safe(prefix) if prefix != "text" else "text"
        self.fields = {
            k: FieldSpec(tuple(v["shape"]), v["dtype"], v["ragged"]) for k, v in fields.items()
        }
        counts = [
            len(g.meta["keys"])
            if per_group == "images"
            else sum(len(c) for c in g.meta["captions"])
            for g in groups
        ]
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._offsets: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def gather(self, name: str, rows, alloc=np.empty) -> np.ndarray:
        spec = self.fields[name]
        out = alloc((len(rows), *spec.shape), np.dtype(spec.dtype))
        key = f"{self.prefix}.{name}"
        take_rows(lambda k: self.groups[k].arrays[key], self.starts, np.asarray(rows), out)
        return out

    def gather_ragged(self, name: str, rows, alloc=np.empty) -> tuple[np.ndarray, np.ndarray]:
        spec = self.fields[name]
        key = f"{self.prefix}.{name}"
        if name not in self._offsets:  # the groups' offsets joined, and where each starts
            pieces, bases, total = [], [], 0
            for g in self.groups:
                offsets = g.arrays[f"{key}_offsets"]
                pieces.append(offsets[:-1] + total)
                bases.append(total)
                total += int(offsets[-1])
            joined = np.concatenate([*pieces, [total]]).astype(np.int64)
            self._offsets[name] = (joined, np.asarray(bases, np.int64))
        offsets, bases = self._offsets[name]

        def take(value_rows, out, positions):
            take_rows(lambda k: self.groups[k].arrays[key], bases, value_rows, out, positions)

        return padded_rows(take, offsets, np.asarray(rows), spec.shape, spec.dtype, alloc)
