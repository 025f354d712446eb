"""The store writer: creates or resumes a store in ``<store>.incomplete``, commits it shard by
shard (data, then the shard's marker), finalizes it and moves it into place."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Self

import numpy as np
import zarr

from features.store.integrity import (
    checksums_text,
    file_checksum,
    local_fs,
    read_checksums,
    recorded_files,
    store_files,
)
from features.store.layout import (
    CHECKSUMS,
    CHECKSUMS_CHUNK,
    COMMITS,
    EXTRAS,
    FLAT_KEYS,
    LOCK,
    MANIFEST,
    SEPARATOR,
    SHARD_LOCKS,
    STRINGS,
    chunk_key,
    field_codecs,
    incomplete_path,
    is_temp,
    write_every_chunk,
)
from features.store.locks import release, take_lock
from features.store.raw import write_marker, write_raw_shard
from features.store.spec import (
    RAGGED_ROWS_PER_SAMPLE,
    SCHEMA_VERSION,
    FieldSpec,
    Provenance,
    StoreConfig,
    StoreError,
)
from infra.files import replace_dir, sweep_stale


class BaseWriter:
    """A store writer used as a context manager (``open`` on entry, ``close`` on exit),
    writing the shards in ``only`` of which those in ``committed`` are done."""

    only: list[int]
    committed: set[int]

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pending_shards(self) -> list[int]:
        """This writer's uncommitted shards, in order."""
        return [k for k in self.only if k not in self.committed]


class StoreWriter(BaseWriter):
    """Create or resume a store and commit it shard by shard.

    The store is built in ``<path>.incomplete`` and moved to ``path`` when its last shard
    is committed. A rerun resumes the incomplete store from its committed shards, or starts
    it over if it was made from other inputs or is damaged (it is this writer's own folder).

    ``keys`` fixes the samples and their order up front (from the manifest). Dense shards
    can be committed in any order; a store with ragged fields commits in order, because
    a shard's rows start where the previous shard's end. Use as a context manager::

        with StoreWriter(path, "regions", fields, keys, provenance, cfg) as writer:
            for shard in writer.pending_shards():
                start, stop = writer.shard_range(shard)
                writer.write_shard(shard, {"features": ..., ...})

    Several processes can fill a dense store's shards concurrently: :class:`ShardWriter`.
    """

    def __init__(
        self,
        path: str | Path,
        kind: str,
        fields: Mapping[str, FieldSpec],
        keys: Sequence[str],
        provenance: Provenance,
        cfg: StoreConfig | None = None,
        log=print,
    ):
        self.target = Path(path)
        self.path = incomplete_path(self.target)  # where the store is built
        self.kind = kind
        self.fields = dict(fields)
        self.keys = list(keys)
        self.n = len(self.keys)
        self.provenance = provenance
        self.cfg = cfg = cfg or StoreConfig()
        self.fingerprint = provenance.fingerprint(kind, self.fields)
        self.n_shards = -(-self.n // cfg.samples_per_shard)
        self.only = list(range(self.n_shards))  # the shards this writer writes
        self.log = log
        self._lock_file = None
        self.reused = False  # the complete store at `target` was made from the same inputs

    # -- lifecycle

    def open(self) -> None:
        if self._target_is_this_store():
            self.reused, self.committed = True, set(range(self.n_shards))
            self.log(f"store {self.target}: complete, made from the same inputs; kept")
            return
        if self.target.exists():
            if not (self.target / "zarr.json").is_file():
                raise StoreError(
                    f"{self.target} exists and is not a feature store; remove it or choose "
                    "another output path"
                )
            self.log(
                f"store {self.target}: made from other inputs or with another layout; "
                "starting it over (the old store is replaced once the new one is complete)"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire_lock()
        for temp in self.path.rglob("*"):  # a killed writer's temporary files
            if is_temp(temp.name):
                temp.unlink()
        sweep_stale(self.target)  # what a killed move into place left
        # no shard writer can hold a lock while we hold .lock exclusively
        shutil.rmtree(self.path / SHARD_LOCKS, ignore_errors=True)
        existing = self._existing_attrs()
        if existing is not None and self._difference(existing):
            self.log(
                f"store {self.target}: the incomplete store was made from other inputs or "
                f"with another layout ({self._difference(existing)}); starting it over"
            )
            existing = None
        if existing is None:
            for child in self.path.iterdir():
                if child.name != LOCK:
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            self._create()
        markers = self._open_group()
        if self.committed:
            self.log(
                f"store {self.path}: resuming, {len(self.committed)}/{self.n_shards} shards done"
            )
        if self._ragged_names():
            with write_every_chunk():
                self._truncate_ragged(markers)

    def close(self) -> None:
        if self._lock_file is None:
            return
        (self.path / LOCK).unlink(missing_ok=True)
        if len(self.committed) == self.n_shards:
            if not self.group.attrs["vse"].get("complete"):
                self._finalize()
            fs, root = local_fs(self.path)
            if read_checksums(fs, root)[0] is None:
                write_checksums(self.group, self.commits[:], fs, root)
            replace_dir(self.path, self.target)  # still holding the lock's descriptor
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            release(self._lock_file)
            self._lock_file = None

    def _acquire_lock(self, shared: bool = False) -> None:
        """``.lock``: exclusively for a whole-store writer, shared by shard writers."""

        def refused(holder: str) -> StoreError:
            return StoreError(
                f"store {self.path} is locked by a running writer ({holder}); wait for it "
                "to finish, or stop it, before writing this store"
            )

        label = "shard writer " if shared else ""
        self._lock_file = take_lock(self.path / LOCK, refused, shared, label)

    def _open_group(self) -> list[str]:
        """The store's group, commit markers and arrays, kept (each lookup through the group
        costs ~1 ms; a resized array must be the one object that knows its shape); sets
        ``committed`` from the commit markers read now, and returns them."""
        self.group = zarr.open_group(self.path, mode="r+")
        self.commits = self.group[COMMITS]
        names = [[n, f"{n}_offsets"] if s.ragged else [n] for n, s in self.fields.items()]
        self._arrays = {name: self.group[name] for group in names for name in group}
        markers = self.commits[:]
        self.committed = {k for k, m in enumerate(markers) if m}
        return markers

    def _layout_attrs(self) -> dict:
        """The layout params, and the chunk keys' separator (a store with other keys is
        started over)."""
        return {**self.cfg.model_dump(), "chunk_key_separator": SEPARATOR}

    def _existing_attrs(self) -> dict | None:
        """The attributes of the incomplete store, or None if there is none, it was cut
        short while being created, or it is damaged: this folder is the writer's own, so
        it is then started over."""
        try:
            group = zarr.open_group(self.path, mode="r")
            attrs = dict(group.attrs["vse"])
            group[COMMITS][:]  # created last: present once creation finished
        except Exception:  # noqa: BLE001 - any damage means: start over
            return None
        return attrs

    def _difference(self, attrs: dict) -> str | None:
        """The first of a store's identity attributes that differs from this writer's, as
        ``"name found != mine"`` (fingerprints cut to 12 characters); None: the same store."""
        mine = {
            "schema_version": SCHEMA_VERSION,
            "fingerprint": self.fingerprint,
            "layout": self._layout_attrs(),
            "n": self.n,
        }
        for name, value in mine.items():
            found = attrs.get(name)
            if found != value:
                if name == "fingerprint":
                    found, value = str(found)[:12], value[:12]
                return f"{name} {found} != {value}"
        return None

    def _target_is_this_store(self) -> bool:
        """Whether ``target`` holds a complete store made from the same inputs."""
        try:
            attrs = dict(zarr.open_group(self.target, mode="r").attrs["vse"])
        except Exception:  # noqa: BLE001 - absent or not a store: it is (re)built
            return False
        if read_checksums(*local_fs(self.target))[0] is None:
            return False  # no checksum manifest (damaged, or made by an older version)
        return bool(attrs.get("complete")) and self._difference(attrs) is None

    def _create(self) -> None:
        """The empty store: attributes, keys and field arrays, then the commit markers'
        array, last, so that a store cut short while being created has none."""
        cfg = self.cfg
        group = zarr.create_group(self.path)  # mode "w" would delete the lock file
        group.attrs["vse"] = {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "inputs": asdict(self.provenance),
            "fields": {k: asdict(v) for k, v in self.fields.items()},
            "layout": self._layout_attrs(),
            "n": self.n,
            "n_shards": self.n_shards,
            "complete": False,
        }
        keys = group.create_array(
            "keys", shape=(self.n,), chunks=(max(self.n, 1),), dtype=str, **STRINGS, **FLAT_KEYS
        )
        if self.n:
            keys[:] = np.asarray(self.keys, dtype=object)
        chunk = cfg.samples_per_chunk
        for name, spec in self.fields.items():
            if spec.ragged:
                rows_chunk = chunk * RAGGED_ROWS_PER_SAMPLE
                rows_shard = cfg.samples_per_shard * RAGGED_ROWS_PER_SAMPLE
                rows_shard -= rows_shard % rows_chunk
                group.create_array(
                    name,
                    shape=(0, *spec.shape),
                    chunks=(rows_shard, *spec.shape),
                    dtype=spec.dtype,
                    fill_value=0,
                    **field_codecs(cfg, (rows_chunk, *spec.shape)),
                    **FLAT_KEYS,
                )
                name, spec = f"{name}_offsets", FieldSpec((), "int64")
            group.create_array(
                name,
                shape=(self.n, *spec.shape),
                chunks=(cfg.samples_per_shard, *spec.shape),
                dtype=spec.dtype,
                fill_value=0,
                **field_codecs(cfg, (chunk, *spec.shape)),
                **FLAT_KEYS,
            )
        group.create_array(
            COMMITS, shape=(self.n_shards,), chunks=(1,), dtype=str, **STRINGS, **FLAT_KEYS
        )

    def _ragged_names(self) -> list[str]:
        return [name for name, spec in self.fields.items() if spec.ragged]

    def _truncate_ragged(self, markers) -> None:
        """Make ragged arrays look exactly as they did after the last in-order commit.

        A killed writer may have grown an array or written part of a row shard; rewriting
        the boundary shard from its committed rows drops that garbage, so the resumed run
        ends bitwise identical to an uninterrupted one.
        """
        first_gap = next((k for k, m in enumerate(markers) if not m), self.n_shards)
        for k in range(first_gap, self.n_shards):  # later markers would be out of order
            if markers[k]:
                self.commits[k] = ""
                self.committed.discard(k)
        committed_rows = {name: 0 for name in self._ragged_names()}
        for marker in markers[:first_gap]:
            committed_rows.update({k: v[1] for k, v in json.loads(marker)["rows"].items()})
        for name, rows in committed_rows.items():
            array = self._arrays[name]
            if array.shape[0] == rows:
                continue
            shard_rows = array.shards[0]
            start = rows - rows % shard_rows
            keep = array[start:rows]
            for index in range(start // shard_rows, -(-array.shape[0] // shard_rows)):
                (self.path / chunk_key(name, index, array.ndim)).unlink(missing_ok=True)
            array.resize((rows, *array.shape[1:]))
            if len(keep):
                array[start:rows] = keep

    # -- writing

    def shard_range(self, shard: int) -> tuple[int, int]:
        start = shard * self.cfg.samples_per_shard
        return start, min(start + self.cfg.samples_per_shard, self.n)

    def write_shard(
        self, shard: int, data: Mapping[str, Any], notes: Mapping[str, Any] | None = None
    ) -> None:
        """Write all fields of ``shard`` then its commit marker.

        ``data[name]`` is an array of shape ``(stop - start, *shape)`` for a dense field, or
        a list of ``(rows_i, *shape)`` arrays, one per sample, for a ragged field. ``notes``
        (JSON-able, e.g. the shard's bad inputs) are kept in the marker, so they survive a
        crash with the shard they describe.
        """
        with write_every_chunk():
            self._write_shard(shard, data, dict(notes or {}))

    def _write_shard(self, shard: int, data: Mapping[str, Any], notes: dict) -> None:
        start, stop = self.shard_range(shard)
        if set(data) != set(self.fields):
            raise StoreError(
                f"store {self.path}: shard {shard} has fields {sorted(data)}, the store "
                f"expects {sorted(self.fields)}"
            )
        ragged = self._ragged_names()
        if ragged and any(k not in self.committed for k in range(shard)):
            raise StoreError(
                f"store {self.path}: shard {shard} written before an earlier shard; stores "
                "with ragged fields are committed in order"
            )
        files: dict[str, str] = {}
        rows: dict[str, list[int]] = {}
        for name, spec in self.fields.items():
            if spec.ragged:
                rows[name] = self._write_ragged(name, spec, start, stop, data[name], files)
                continue
            array = np.asarray(data[name], dtype=spec.dtype)
            if array.shape != (stop - start, *spec.shape):
                raise StoreError(
                    f"store {self.path}: field {name!r} of shard {shard} has shape "
                    f"{array.shape}, expected {(stop - start, *spec.shape)}"
                )
            self._write_dense(name, shard, array, files)
        for rel, checksum in files.items():
            if not checksum:
                files[rel] = file_checksum((self.path / rel).read_bytes())
        marker = dict(shard=shard, start=start, stop=stop, rows=rows, files=files, notes=notes)
        self._write_marker(shard, json.dumps(marker, sort_keys=True))
        self.committed.add(shard)

    @property
    def _raw(self) -> bool:
        """Whether dense shard files are laid out by hand (:mod:`features.store.raw`, for
        uncompressed stores) rather than written through Zarr's API (compressed ones)."""
        return self.cfg.compression == "none"

    def _write_dense(self, name: str, shard: int, array: np.ndarray, files: dict) -> None:
        """Shard ``shard`` of dense array ``name`` (all its rows); its checksum into
        ``files`` (empty: read back once the shard's files are written)."""
        rel = chunk_key(name, shard, array.ndim)
        if self._raw:
            per_shard = self.cfg.samples_per_shard
            files[rel] = write_raw_shard(
                self.path / rel, [array], self.cfg.samples_per_chunk, per_shard
            )
        else:
            start = shard * self.cfg.samples_per_shard
            self._arrays[name][start : start + len(array)] = array
            files[rel] = ""

    def _write_marker(self, shard: int, text: str) -> None:
        """Commit shard ``shard``: its marker (:func:`features.store.raw.write_marker`)."""
        write_marker(self.path / chunk_key(COMMITS, shard, 1), text)

    def _write_ragged(self, name, spec, start, stop, samples, files) -> list[int]:
        """Rows of samples ``start:stop`` after the rows so far, and their offsets. A row
        shard file that already holds rows is rewritten: its rows so far, then the new
        ones (laid out by hand in uncompressed stores, else through Zarr's API)."""
        if len(samples) != stop - start:
            raise StoreError(
                f"store {self.path}: ragged field {name!r} got {len(samples)} samples for "
                f"shard range {start}:{stop}"
            )
        values = self._arrays[name]
        first = values.shape[0]
        lengths = [len(s) for s in samples]
        offsets = first + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._write_dense(f"{name}_offsets", start // self.cfg.samples_per_shard, offsets, files)
        last = first + sum(lengths)
        if last > first:
            flat = np.concatenate([np.asarray(s, dtype=spec.dtype) for s in samples])
            if flat.shape[1:] != spec.shape:
                raise StoreError(
                    f"store {self.path}: ragged field {name!r} rows have shape "
                    f"{flat.shape[1:]}, expected {spec.shape}"
                )
            values.resize((last, *spec.shape))
            shard_rows, chunk_rows = values.shards[0], values.chunks[0]
            for index in range(first // shard_rows, (last - 1) // shard_rows + 1):
                rel = chunk_key(name, index, values.ndim)
                files[rel] = ""
                if not self._raw:
                    continue
                lo, hi = index * shard_rows, min(last, (index + 1) * shard_rows)
                pieces = [flat[max(lo - first, 0) : hi - first]]
                if lo < first:  # the file's rows so far come first: read them back
                    kept = np.fromfile(
                        self.path / rel,
                        np.dtype(spec.dtype).newbyteorder("<"),
                        count=(first - lo) * int(np.prod(spec.shape, dtype=np.int64)),
                    )
                    pieces.insert(0, kept.reshape(first - lo, *spec.shape))
                files[rel] = write_raw_shard(self.path / rel, pieces, chunk_rows, shard_rows)
            if not self._raw:
                values[first:last] = flat
        return [int(first), int(last)]

    def write_extra(self, name: str, array: np.ndarray) -> None:
        """A store-level array that is not per sample (e.g. a fitted projection), one file,
        checksummed like the shards. Nothing to do when the complete store is reused."""
        if self.reused:
            return
        array = np.asarray(array)
        extra = self.group.create_array(
            name,
            shape=array.shape,
            dtype=array.dtype,
            chunks=array.shape or (1,),
            overwrite=True,
            **EXTRAS,
        )
        extra[...] = array
        rel = "/".join([name, "c"] + ["0"] * array.ndim) if array.ndim else f"{name}/c"
        attrs = dict(self.group.attrs["vse"])
        attrs.setdefault("extras", {})[name] = file_checksum((self.path / rel).read_bytes())
        attrs["extras_files"] = {**attrs.get("extras_files", {}), name: rel}
        self.group.attrs["vse"] = attrs

    def _finalize(self) -> None:
        attrs = dict(self.group.attrs["vse"])
        counts = {"samples": self.n, "shards": self.n_shards}
        for name in self._ragged_names():
            counts[f"{name}_rows"] = int(self.group[name].shape[0])
        attrs.update(complete=True, counts=counts)
        self.group.attrs["vse"] = attrs


class ShardWriter(StoreWriter):
    """One of several processes filling disjoint ``shards`` of a dense store concurrently.

    It opens a store that a :class:`StoreWriter` created (never creates, resumes ragged
    rows or starts one over), writes only its shards, each under its own lock, and never
    finalizes: open a :class:`StoreWriter` once every shard writer is done to finalize the
    store."""

    def __init__(self, *args, shards: Sequence[int], **kwargs):
        super().__init__(*args, **kwargs)
        self._shard_lock_files: list = []
        self.only = own_shards(self.path, shards, self.n_shards)

    def open(self) -> None:
        """The shared store lock, then one exclusive lock per own shard."""
        ragged = self._ragged_names()
        if ragged:
            raise StoreError(
                f"store {self.path}: ragged field(s) {ragged} put each shard's rows after the "
                "previous shard's, so this store is written in order by one writer; open it "
                "with a StoreWriter (and do not fan its shards out)"
            )
        if not (self.path / "zarr.json").is_file():
            raise StoreError(
                f"store {self.path} does not exist; create it first with one StoreWriter "
                "(the coordinator), then start the shard writers"
            )
        self._acquire_lock(shared=True)
        try:
            existing = self._existing_attrs()
            difference = "not readable" if existing is None else self._difference(existing)
            if difference:
                raise StoreError(
                    f"store {self.path} was made from other inputs or with another layout "
                    f"({difference}); a shard writer never starts a store over: recreate it "
                    "with one StoreWriter (the coordinator) first"
                )
            self._lock_shards()
            self._open_group()  # after locking: a shard done meanwhile is skipped
            # a killed writer's temporary files of our shards: swept by atomic_path
        except BaseException:
            self.close()
            raise

    def _lock_shards(self) -> None:
        folder = self.path / SHARD_LOCKS
        folder.mkdir(exist_ok=True)
        for shard in self.only:

            def refused(holder: str, shard=shard) -> StoreError:
                return StoreError(
                    f"store {self.path}: shard {shard} is being written by another shard "
                    f"writer ({holder}); give each writer its own shards"
                )

            self._shard_lock_files.append(take_lock(folder / str(shard), refused))

    def close(self) -> None:
        """Release the shard locks (their files stay: only the whole-store writer sweeps
        them) and the shared store lock; nothing is finalized."""
        for handle in self._shard_lock_files:
            release(handle)
        self._shard_lock_files = []
        self._release_lock()

    def _write_shard(self, shard: int, data: Mapping[str, Any], notes: dict) -> None:
        check_own_shard(self.path, shard, self.only)
        super()._write_shard(shard, data, notes)


def own_shards(store, shards: Sequence[int], n_shards: int) -> list[int]:
    """A shard writer's shards, sorted; one out of the store's range is refused."""
    only = sorted({int(k) for k in shards})
    outside = [k for k in only if not 0 <= k < n_shards]
    if outside:
        raise StoreError(
            f"store {store}: shard(s) {outside} out of range; it has {n_shards} shards "
            f"(0..{n_shards - 1})"
        )
    return only


def check_own_shard(store, shard: int, only: list[int]) -> None:
    if shard not in only:
        raise StoreError(
            f"store {store}: shard {shard} is not one of this shard writer's shards {only}; "
            "another writer may be writing it"
        )


def write_checksums(group, markers: Sequence[str], fs, root: str) -> None:
    """The checksum manifest of the finalized store ``group`` (its files at ``root`` on
    ``fs``), written last: a store with it is whole. Chunks keep the checksums their commit
    ``markers`` recorded (so damage after a commit still shows); the rest (metadata, keys,
    markers, extras) are checksummed now (CRC-32C)."""
    files = recorded_files([json.loads(marker) for marker in markers], group.attrs["vse"])
    manifest = group.create_array(
        CHECKSUMS, shape=(1,), chunks=(1,), dtype=str, overwrite=True, **MANIFEST
    )
    for rel in store_files(fs, root):
        if rel not in files and rel != CHECKSUMS_CHUNK:
            files[rel] = file_checksum(fs.cat_file(f"{root}/{rel}"))
    manifest[0] = checksums_text(files)
