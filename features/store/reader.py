"""Reading a store, local or at an fsspec URL: only committed shards, random access by index
or key, and the vectorised gathers training reads through."""

from __future__ import annotations

import functools
import json
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import zarr

from features.store.gather import padded_rows, take_rows
from features.store.integrity import verify_store
from features.store.layout import COMMITS, INCOMPLETE, chunk_key
from features.store.raw import contiguous_rows, shard_index
from features.store.spec import SCHEMA_VERSION, FieldSpec, StoreError
from infra.config import one_line
from infra.files import is_url

IN_MEMORY_BYTES = 64 << 20  # a reader keeps an array this small in memory (read once)


MAX_MAPS = 4096  # shard files a reader keeps mapped (each holds a file descriptor)


CACHED_CHUNKS = 16  # chunks a reader of a remote or compressed store keeps


class Kept:
    """The ``size`` values last made, by key: ``kept(key, make)`` returns the kept value
    or keeps ``make()``, dropping the least recently used one when full."""

    def __init__(self, size: int):
        self.size, self.items = size, OrderedDict()

    def __call__(self, key, make):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        if len(self.items) >= self.size:
            self.items.popitem(last=False)
        value = self.items[key] = make()
        return value


class Geometry(NamedTuple):
    """How an array lies in its shard files: shape, rows per chunk and per shard file,
    little-endian dtype."""

    shape: tuple[int, ...]
    chunk_rows: int
    shard_rows: int
    dtype: np.dtype


# what a store's "vse" attributes must hold, and of which type, to be read
_ATTRS = {
    "kind": str,
    "fingerprint": str,
    "inputs": dict,
    "fields": dict,
    "layout": dict,
    "n": int,
    "n_shards": int,
}


def _damaged(url: str, what: str, err: BaseException | str) -> StoreError:
    detail = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    detail = one_line(detail, 200)
    return StoreError(
        f"{url}: {what} is damaged ({detail}); run `vse store verify {url}` to see which "
        "files, then rebuild the store (dvc repro) or restore it from the DVC cache"
    )


def _open_group(url: str | Path, storage_options: dict | None = None):
    url = str(url)
    if url.startswith("s3://"):
        from infra.config import require_extra

        require_extra("s3fs", "s3", f"reading {url}")
    try:
        with warnings.catch_warnings(action="ignore"):
            group = zarr.open_group(url, mode="r", storage_options=storage_options)
            attrs = dict(group.attrs["vse"])
    except (FileNotFoundError, KeyError) as err:
        raise StoreError(
            f"{url}: not a feature store (no Zarr group with 'vse' attributes); check the path "
            "or build it with its DVC stage"
        ) from err
    except Exception as err:  # noqa: BLE001 - unreadable metadata: damaged
        raise _damaged(url, "its metadata (zarr.json)", err) from None
    if attrs.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{url}: store schema version {attrs.get('schema_version')}, this code reads "
            f"{SCHEMA_VERSION}; rebuild the store"
        )
    wrong = [k for k, t in _ATTRS.items() if not isinstance(attrs.get(k), t)]
    if wrong or not isinstance(attrs["inputs"].get("manifest_digest"), str):
        raise _damaged(url, "its metadata (zarr.json)", f"bad or missing {wrong or 'inputs'}")
    return group, attrs


@dataclass
class Store:
    """A read-only store, local or at an fsspec URL (``s3://bucket/regions.zarr``).

    Only committed shards are readable. Random access by index (``store[3]``) or key
    (``store["img_001"]``) returns a dict of the fields of one sample.
    """

    url: str
    group: Any
    attrs: dict
    committed: np.ndarray  # (n_shards,) bool
    storage_options: dict | None = None
    _key_index: dict[str, int] | None = field(default=None, repr=False)
    _offsets: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    _memory: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    _arrays: dict = field(default_factory=dict, repr=False)
    _geometries: dict[str, Geometry] = field(default_factory=dict, repr=False)
    # shard files' rows as views of their mappings; chunks read through Zarr
    _shard_views: Kept = field(default_factory=lambda: Kept(MAX_MAPS), repr=False)
    _zarr_chunks: Kept = field(default_factory=lambda: Kept(CACHED_CHUNKS), repr=False)

    @classmethod
    def open(
        cls,
        url: str | Path,
        *,
        kind: str | None = None,
        fingerprint: str | None = None,
        manifest_digest: str | None = None,
        require_complete: bool = True,
        storage_options: dict | None = None,
    ) -> Store:
        group, attrs = _open_group(url, storage_options)
        try:
            with warnings.catch_warnings(action="ignore"):
                markers = group[COMMITS][:]
            committed = np.array([bool(m) for m in markers], dtype=bool)
            store = cls(str(url), group, attrs, committed, storage_options)
            store.fields  # noqa: B018 - parse the field specs now, not in the middle of a run
            store.attrs["layout"]["samples_per_shard"]  # noqa: B018
        except Exception as err:  # noqa: BLE001 - unreadable markers or attributes: damaged
            raise _damaged(str(url), "its commit markers or attributes", err) from None
        if len(committed) != attrs["n_shards"]:
            raise _damaged(
                str(url), "its commit markers", f"{len(committed)} for {attrs['n_shards']} shards"
            )
        if kind and attrs["kind"] != kind:
            raise StoreError(f"{url}: a {attrs['kind']} store, expected a {kind} store")
        if fingerprint and attrs["fingerprint"] != fingerprint:
            raise StoreError(
                f"{url}: fingerprint {attrs['fingerprint'][:12]} does not match the requested "
                f"{fingerprint[:12]}; the store was made from other inputs, rebuild it"
            )
        if manifest_digest and attrs["inputs"]["manifest_digest"] != manifest_digest:
            raise StoreError(
                f"{url}: built from manifest {attrs['inputs']['manifest_digest'][:12]}, but the "
                f"manifest in use is {manifest_digest[:12]}; rebuild the store (dvc repro) "
                "or use the manifest it was built from"
            )
        if require_complete and not committed.all():
            raise StoreError(
                f"{url}: incomplete, {int(committed.sum())} of {len(committed)} shards "
                "committed; rerun its extraction to resume it"
            )
        return store

    # -- facts

    @property
    def kind(self) -> str:
        return self.attrs["kind"]

    @property
    def fingerprint(self) -> str:
        return self.attrs["fingerprint"]

    @property
    def manifest_digest(self) -> str:
        return self.attrs["inputs"]["manifest_digest"]

    @property
    def fields(self) -> dict[str, FieldSpec]:
        return {
            k: FieldSpec(tuple(v["shape"]), v["dtype"], v["ragged"])
            for k, v in self.attrs["fields"].items()
        }

    @property
    def samples_per_shard(self) -> int:
        return self.attrs["layout"]["samples_per_shard"]

    @property
    def samples_per_chunk(self) -> int:
        return self.attrs["layout"]["samples_per_chunk"]

    def __len__(self) -> int:
        return self.attrs["n"]

    @property
    def keys(self) -> np.ndarray:
        return self.group["keys"][:]

    def index(self, key: str) -> int:
        if self._key_index is None:
            self._key_index = {k: i for i, k in enumerate(self.keys)}
        try:
            return self._key_index[key]
        except KeyError:
            raise KeyError(f"{self.url}: no sample with key {key!r}") from None

    def markers(self) -> list[dict | None]:
        return [json.loads(m) if m else None for m in self.group[COMMITS][:]]

    def extra(self, name: str) -> np.ndarray:
        """A store-level array written with ``StoreWriter.write_extra``."""
        if name not in self.attrs.get("extras", {}):
            raise StoreError(f"{self.url}: no store-level array {name!r}")
        return self.group[name][...]

    def notes(self) -> dict[str, Any]:
        """The notes of all committed shards merged (e.g. every bad input by key)."""
        merged: dict[str, Any] = {}
        for marker in self.markers():
            if marker:
                merged.update(marker.get("notes", {}))
        return merged

    # -- reading

    def _check_committed(self, shards: np.ndarray) -> None:
        if self.committed[shards].all():  # the common case: no set built
            return
        missing = sorted({int(k) for k in shards[~self.committed[shards]]})
        raise StoreError(
            f"{self.url}: samples lie in uncommitted shard(s) {missing}; rerun the "
            "extraction to finish the store"
        )

    def _checked(self, indices: Sequence[int]) -> np.ndarray:
        """``indices`` as int64, each in range and in a committed shard."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            bad = indices[(indices < 0) | (indices >= len(self))][0]
            raise IndexError(f"{self.url}: index {bad} out of range for {len(self)} samples")
        self._check_committed(indices // self.samples_per_shard)
        return indices

    def offsets(self, name: str) -> np.ndarray:
        """(N+1,) row offsets of a ragged field: sample i is rows offsets[i]:offsets[i+1]."""
        if name not in self._offsets:
            starts = self._array(f"{name}_offsets")[:]
            self._offsets[name] = np.append(starts, self._array(name).shape[0]).astype(np.int64)
        return self._offsets[name]

    def read(
        self, start: int, stop: int, fields: Sequence[str] | None = None, *, copy: bool = True
    ) -> dict:
        """Fields of samples ``start:stop``; a ragged field comes as a list of arrays.

        With ``copy=False`` dense fields of a local, uncompressed store may come back as
        read-only views of the memory-mapped shard files.
        """
        shards = range(start // self.samples_per_shard, -(-stop // self.samples_per_shard))
        if not all(self.committed[k] for k in shards):  # (a few shards: no array built)
            self._check_committed(np.asarray(shards))
        out: dict[str, Any] = {}
        for name in fields or self.fields:
            spec = self.fields[name]
            if spec.ragged:
                offsets = self.offsets(name)
                flat = self.group[name][offsets[start] : offsets[stop]]
                cuts = offsets[start : stop + 1] - offsets[start]
                out[name] = [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            elif self._mappable:
                view = self._mapped_slice(name, start, stop)
                out[name] = np.array(view) if copy else view
            else:
                out[name] = self.group[name][start:stop]
        return out

    @property
    def _mappable(self) -> bool:
        """Local and uncompressed: chunks are raw bytes at offsets in the shard files."""
        return self.attrs["layout"]["compression"] == "none" and not is_url(self.url)

    def _mapped_slice(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of array ``name`` from its mapped shard files (a view when
        they lie in one)."""
        shape, _, shard_rows, dtype = self._geometry(name)
        pieces = [
            self._shard_rows(name, k)[max(start - k * shard_rows, 0) : stop - k * shard_rows]
            for k in range(start // shard_rows, -(-stop // shard_rows))
        ]
        if not pieces:
            return np.empty((0, *shape[1:]), dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _array(self, name: str):
        """Zarr array ``name``, kept (each lookup through the group costs ~1 ms)."""
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    def _geometry(self, name: str) -> Geometry:
        """How array ``name`` lies in its shard files, kept."""
        if name not in self._geometries:
            array = self._array(name)
            self._geometries[name] = Geometry(
                tuple(array.shape),
                array.chunks[0],
                array.shards[0],
                np.dtype(array.dtype).newbyteorder("<"),
            )
        return self._geometries[name]

    def _shard_rows(self, name: str, k: int) -> np.ndarray:
        """Rows ``k * shard_rows:(k + 1) * shard_rows`` of array ``name`` (a field, or a
        ragged field's rows) as one array, kept (a mapping holds a file descriptor): a view
        of its memory-mapped shard file when its chunks lie back to back in order (what the
        writer and Zarr produce), else read through Zarr."""

        def view():
            shape, chunk_rows, shard_rows, dtype = self._geometry(name)
            separator = self.attrs["layout"].get("chunk_key_separator", "/")
            rel = chunk_key(name, k, len(shape), separator)
            data = np.memmap(Path(self.url) / rel, np.uint8, "r")
            index = shard_index(data, shard_rows // chunk_rows)
            rows = min(shape[0], (k + 1) * shard_rows) - k * shard_rows
            mapped = contiguous_rows(data, index, rows, chunk_rows, shape[1:], dtype)
            return self._zarr_rows(name, k, shard_rows) if mapped is None else mapped

        return self._shard_views((name, k), view)

    def _zarr_rows(self, name: str, k: int, rows: int) -> np.ndarray:
        """Rows ``k * rows:(k + 1) * rows`` of array ``name`` read through Zarr; the last
        few are kept (remote and compressed stores read a chunk at a time)."""
        return self._zarr_chunks(
            (name, k, rows), lambda: self._array(name)[k * rows : (k + 1) * rows]
        )

    def _take(self, name: str, rows: np.ndarray, out: np.ndarray, positions=None) -> None:
        """``out[positions] = rows`` of array ``name`` (a dense field's samples or a ragged
        field's value rows; ``rows`` valid): from memory when the array is small (read
        once), else one fancy-indexed copy per memory-mapped shard file touched (local,
        uncompressed stores) or per chunk read through Zarr (remote or compressed)."""
        shape, chunk_rows, shard_rows, dtype = self._geometry(name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if name not in self._memory and nbytes <= IN_MEMORY_BYTES:
            self._memory[name] = (
                np.array(self._mapped_slice(name, 0, shape[0]))
                if self._mappable
                else np.asarray(self._array(name)[...])
            )
        if name in self._memory:
            take_rows(lambda k: self._memory[name], np.zeros(1, np.int64), rows, out, positions)
            return
        if self._mappable:
            unit = shard_rows
            part = functools.partial(self._shard_rows, name)
        else:
            unit = chunk_rows
            part = functools.partial(self._zarr_rows, name, rows=unit)
        take_rows(part, np.arange(0, shape[0], unit, dtype=np.int64), rows, out, positions)

    def gather(self, name: str, indices: Sequence[int], alloc=np.empty) -> np.ndarray:
        """Dense field ``name`` of the samples at ``indices`` (any order, repeats allowed):
        ``(len(indices), *shape)`` in the stored dtype, in an array from ``alloc(shape,
        dtype)`` (e.g. a preallocated buffer), with one copy of the wanted samples only."""
        indices = self._checked(indices)
        spec = self.fields[name]
        if spec.ragged:
            raise StoreError(f"{self.url}: field {name!r} is ragged; use gather_ragged")
        out = alloc((len(indices), *spec.shape), np.dtype(spec.dtype))
        self._take(name, indices, out)
        return out

    def gather_ragged(
        self, name: str, indices: Sequence[int], alloc=np.empty
    ) -> tuple[np.ndarray, np.ndarray]:
        """Ragged field ``name`` of the samples at ``indices``, zero-padded: ``(B, L,
        *shape)`` with L the longest (at least 1), in an array from ``alloc``, and the
        ``(B,)`` int64 lengths. Only the samples' own rows are copied."""
        indices = self._checked(indices)
        spec = self.fields[name]
        if not spec.ragged:
            raise StoreError(f"{self.url}: field {name!r} is dense; use gather")
        take = functools.partial(self._take, name)
        return padded_rows(take, self.offsets(name), indices, spec.shape, spec.dtype, alloc)

    def __getitem__(self, item: int | str) -> dict:
        index = self.index(item) if isinstance(item, str) else int(item)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.url}: index {index} out of range for {len(self)} samples")
        return {name: value[0] for name, value in self.read(index, index + 1).items()}

    def read_indices(self, indices: Sequence[int], fields: Sequence[str] | None = None) -> dict:
        """Samples at arbitrary indices, in the given order: dense fields stacked, ragged
        ones as lists of arrays (views of one gathered block)."""
        indices = self._checked(indices)
        out: dict[str, Any] = {}
        for name in fields or self.fields:
            spec = self.fields[name]
            if not spec.ragged:
                out[name] = self.gather(name, indices)
                continue
            offsets = self.offsets(name)
            starts, lengths = offsets[indices], offsets[indices + 1] - offsets[indices]
            ends = np.cumsum(lengths)
            rows = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(
                starts - (ends - lengths), lengths
            )
            values = np.empty((len(rows), *spec.shape), np.dtype(spec.dtype))
            self._take(name, rows, values)
            out[name] = np.split(values, ends[:-1])
        return out

    def __getstate__(self) -> dict:
        """Picklable (e.g. for data-loading worker processes): handles are reopened."""
        state = dict(self.__dict__)
        state.update(group=None, _key_index=None, _memory={}, _arrays={})
        state.update(_shard_views=Kept(MAX_MAPS), _zarr_chunks=Kept(CACHED_CHUNKS))
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.group, _ = _open_group(self.url, self.storage_options)

    # -- integrity

    def verify(self) -> list[str]:
        """Recompute every file's checksum; returns problems, empty if intact
        (:func:`verify_store`)."""
        return verify_store(self.url, self.storage_options)

    def describe(self) -> dict:
        """What ``vse store info`` shows."""
        return {
            "url": self.url,
            "kind": self.kind,
            "samples": len(self),
            "complete": bool(self.committed.all()),
            "committed_shards": f"{int(self.committed.sum())}/{len(self.committed)}",
            "fingerprint": self.fingerprint,
            "fields": {k: asdict(v) for k, v in self.fields.items()},
            "layout": self.attrs["layout"],
            "inputs": self.attrs["inputs"],
            "counts": self.attrs.get("counts"),
        }


def find_stores(root: str | Path) -> Iterator[Path]:
    """Stores under a local folder (``*.zarr`` groups with 'vse' attributes), the incomplete
    ones being built (``*.zarr.incomplete``), and damaged ones: a ``*.zarr`` folder whose
    root ``zarr.json`` is unreadable or missing but that holds commit markers or a checksum
    manifest (:meth:`Store.open` then says what is wrong)."""
    root = Path(root)
    candidates = {p.parent for p in root.rglob("zarr.json")}
    candidates |= {p.parent.parent for p in root.rglob(f"{COMMITS}/zarr.json")}
    for store_dir in sorted(candidates):
        if not store_dir.name.endswith((".zarr", ".zarr" + INCOMPLETE)):
            continue
        try:
            attrs = json.loads((store_dir / "zarr.json").read_text()).get("attributes", {})
        except (OSError, ValueError, AttributeError):
            yield store_dir  # damaged (or cut short): listed, for `store ls` to report
            continue
        if isinstance(attrs, dict) and "vse" in attrs:
            yield store_dir


def join_by_key(stores: Mapping[str, Store], keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Row index of each key in each store; stores from different manifests are refused.

    Caption-level stores (keys ``<image>#<i>``) join with image-level ones by passing
    the image keys of the captions.
    """
    digests = {name: s.manifest_digest for name, s in stores.items()}
    if len(set(digests.values())) > 1:
        listing = ", ".join(f"{n}: {d[:12]}" for n, d in digests.items())
        raise StoreError(
            f"cannot join stores built from different manifests ({listing}); rebuild them "
            "from one manifest (dvc repro)"
        )
    rows = {}
    for name, store in stores.items():
        try:
            rows[name] = np.array([store.index(k) for k in keys], dtype=np.int64)
        except KeyError as err:
            raise StoreError(f"store {name!r}: {err.args[0]}") from None
    return rows
