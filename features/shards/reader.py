"""Reading WebDataset shards: ``sizes.json`` checked against the stores they were built from,
groups of samples parsed from the tar members, and the gathers of their columns."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from features.shards.members import members
from features.shards.writer import FORMAT, SIZES, member_name
from features.store.gather import padded_rows, take_rows
from features.store.reader import Store
from features.store.spec import FieldSpec, StoreError


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
                f"--{'text ' if role == 'text' else 'store ' + role + '='}{store.url}"
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


def read_groups(
    url: str,
    recorded: Mapping | None,
    storage_options: dict | None = None,
    keep: Callable[[int], bool] | None = None,
) -> Iterator[Group | None]:
    """The groups of one shard, in order, each member checked against ``recorded`` (the
    shard's entry in ``sizes.json``; None: unchecked, for benchmarks) before its group
    is yielded (:func:`features.shards.members.members`). With ``keep``, only groups
    ``i`` with ``keep(i)`` are decoded; the others come as None (a resume's skip)."""
    current: Group | None = None
    key, index = None, -1
    for name, data in members(url, recorded, storage_options):
        base = name.rsplit("/", 1)[-1]
        member_key, _, suffix = base.partition(".")
        if member_key != key:
            if index >= 0:
                yield current
            index += 1
            key = member_key
            current = Group({}) if keep is None or keep(index) else None
        if current is None:
            continue
        if suffix == "meta.json":
            current.meta = json.loads(bytes(data))
        elif suffix.endswith(".npy"):
            current.arrays[suffix[: -len(".npy")]] = decode_npy(data)
    if index >= 0:
        yield current


class GroupColumns:
    """The rows of one packed store (``prefix``: its name in the shards, or "text") over
    a list of groups laid end to end: ``gather`` and ``gather_ragged`` as a
    :class:`features.store.Store` has them, with row ``i`` the i-th image (or caption) of
    the concatenated groups."""

    def __init__(self, groups: list[Group], prefix: str, fields: Mapping, per_group: str):
        self.groups, self.prefix = groups, member_name(prefix) if prefix != "text" else "text"
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
