"""The feature store: fingerprinted, crash-safe Zarr v3 groups. The only code that knows
their on-disk layout (WebDataset shards are in :mod:`features.shards`).

Layout of a store (a Zarr v3 group, readable with plain ``zarr.open_group``)::

    regions.zarr/
      zarr.json          group attributes under "vse": schema version, kind, fingerprint,
                         inputs (extractor, version, params, weights and manifest digests),
                         fields, layout; counts once complete (nothing that depends on
                         when or where it was written: same inputs, same bytes)
      keys/              (N,) str      sample keys (image keys, or caption keys `<image>#<i>`)
      <field>/           (N, ...)      a dense field, e.g. regions: features (N,R,D) f16,
                                       boxes (N,R,4) f32, n_regions (N,), image_hw (N,2)
      <field>/ + <field>_offsets/      a ragged field: rows of all samples back to back
                                       (rows, ...) and the row where each sample starts (N,)
      _commits/          (n_shards,) str, one file per shard: the commit marker of shard k,
                         JSON with its sample range, ragged row range and file checksums
      _checksums/        (1,) str, uncompressed: written last when the store is finalized,
                         the SHA-256 of every other file of the store (root and array
                         metadata, keys, markers, chunks), with a digest of itself

Dense fields are chunked along the sample axis (``samples_per_chunk``) inside Zarr shards
of ``samples_per_shard`` samples (the sharding codec: few, large files, since DVC hashes
every file of a directory output). The writer commits whole shards: it writes the data,
then the marker, each file by atomic rename (Zarr's local store writes a temp file and
renames it). A reader trusts only committed shards, so it never sees a half-written one; a
rerun after a crash rewrites every uncommitted shard and ends bitwise identical to an
uninterrupted run.

A store is built in ``<store>.incomplete`` and moved to its own path when its last
shard is committed, so a store at its path is always complete (and a DVC output is never
partial: no stage needs ``persist``). Writers lock ``<store>.incomplete/.lock`` with
``flock``. A whole-store writer (the default) holds it exclusively: it alone creates,
resumes, starts over and finalizes the store. A store of dense fields only can also be
filled by several processes at once (e.g. Dask workers), each a *shard writer*
(``StoreWriter(..., shards=[...])``): distinct shards are distinct files, so shard writers
share ``.lock`` and each holds an exclusive lock per shard (``.shard_locks/<k>``), commits
its own shards and never finalizes; a whole-store writer opened afterwards finalizes the
store, sweeps the lock files and moves it into place.

Integrity: every file is covered by a checksum. A shard's files are hashed into its commit
marker when it is committed; at finalization the checksum manifest (``_checksums``) lists
every file of the store (the markers' checksums for chunks, freshly computed ones for the
metadata, keys and markers). The manifest is self-checking: it is canonical JSON holding
a digest of its own listing, stored as one uncompressed string, so any changed or missing
byte of it shows. :func:`verify_store` checks a store file by file and never needs its
metadata to be readable.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import functools
import hashlib
import json
import os
import shutil
import socket
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import google_crc32c
import numcodecs
import numpy as np
import zarr
from pydantic import Field as PydanticField
from pydantic import model_validator

from features.config import Section, UserError
from features.files import replace_dir, sweep_stale

SCHEMA_VERSION = 1
COMMITS = "_commits"
CHECKSUMS = "_checksums"  # the checksum manifest, written last at finalization
CHECKSUMS_CHUNK = f"{CHECKSUMS}/c/0"
LOCK = ".lock"
SHARD_LOCKS = ".shard_locks"  # one lock file per shard held by a shard writer
RAGGED_ROWS_PER_SAMPLE = 16  # expected rows per sample of a ragged field, sizes its chunks
INCOMPLETE = ".incomplete"  # suffix of the folder a store is built in
IN_MEMORY_BYTES = 64 << 20  # a reader keeps an array this small in memory (read once)
MAX_MAPS = 4096  # shard files a reader keeps mapped (each holds a file descriptor)
CACHED_CHUNKS = 16  # chunks a reader of a remote or compressed store keeps


class StoreConfig(Section):
    """``store`` section of params.yaml: the on-disk layout of new stores."""

    samples_per_shard: int = PydanticField(256, ge=1)
    samples_per_chunk: int = PydanticField(64, ge=1)
    compression: Literal["none", "zstd"] = "none"

    @model_validator(mode="after")
    def _chunks_tile_shards(self) -> StoreConfig:
        if self.samples_per_shard % self.samples_per_chunk:
            raise ValueError(
                f"samples_per_shard ({self.samples_per_shard}) must be a multiple of "
                f"samples_per_chunk ({self.samples_per_chunk})"
            )
        return self


class StoreError(UserError):
    """A store is missing, locked, incomplete, corrupt or does not match what was asked."""


@dataclass(frozen=True)
class FieldSpec:
    """One array of a store: per-sample shape (per-row shape if ``ragged``) and dtype."""

    shape: tuple[int, ...]
    dtype: str
    ragged: bool = False


@dataclass(frozen=True)
class Provenance:
    """What made a store; its hash is the store's fingerprint."""

    extractor: str
    version: str
    params: Mapping[str, Any]
    weights_digest: str | None
    manifest_digest: str

    def fingerprint(self, kind: str, fields: Mapping[str, FieldSpec]) -> str:
        payload = {
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "fields": {k: asdict(v) for k, v in sorted(fields.items())},
            **asdict(self),
        }
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()


# Field sets of the store kinds that extractors write. Shapes are per sample.
def regions_fields(max_regions: int, dim: int, *, boxes: bool = True) -> dict[str, FieldSpec]:
    fields = {
        "features": FieldSpec((max_regions, dim), "float16"),
        "n_regions": FieldSpec((), "int32"),
        "image_hw": FieldSpec((2,), "int32"),
    }
    if boxes:
        fields["boxes"] = FieldSpec((max_regions, 4), "float32")
    return fields


def ragged_fields(dim: int, name: str = "features", dtype: str = "float16") -> dict:
    return {name: FieldSpec((dim,), dtype, ragged=True)}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_checksum(data) -> str:
    """Checksum of a store file's bytes, as commit markers record it: ``crc32c:<hex>``
    (CRC-32C, in hardware at ~10 GB/s: it detects corrupt and truncated files, as Zarr's
    own shard-index CRC-32C does, at a small fraction of a SHA-256's cost). Markers of
    older stores hold SHA-256 hex digests; :meth:`Store.verify` checks both."""
    return f"crc32c:{google_crc32c.value(_readonly(data)):08x}"


def _readonly(data):
    """``data`` as google_crc32c takes it (bytes, or a read-only array): no copy."""
    if isinstance(data, bytes):
        return data
    view = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    view = view.reshape(-1).view(np.uint8)
    view.flags.writeable = False
    return view


def _checksum_matches(data: bytes, recorded: str) -> bool:
    if recorded.startswith("crc32c:"):
        return file_checksum(data) == recorded
    return sha256_bytes(data) == recorded


SEPARATOR = "."  # chunk keys c.<k>.0.0: one file per shard, no directory per shard


def _chunk_key(field_name: str, index: int, ndim: int, separator: str = SEPARATOR) -> str:
    """Path of Zarr shard ``index`` (along axis 0) of an array, relative to the group:
    ``name/c.<index>.0..`` (stores made before the flat keys: ``name/c/<index>/0/..``)."""
    return f"{field_name}/" + separator.join(["c", str(index)] + ["0"] * (ndim - 1))


def _flat_keys() -> dict:
    return {"chunk_key_encoding": {"name": "default", "separator": SEPARATOR}}


def _codecs(cfg: StoreConfig) -> dict:
    compressors = zarr.codecs.ZstdCodec(level=1) if cfg.compression == "zstd" else None
    return {"compressors": compressors}


def _write_every_chunk():
    """Write chunks of zeros too, so each committed shard has a fixed set of files (the
    setting is not saved with an array, so it is set around every write)."""
    return zarr.config.set({"array.write_empty_chunks": True})


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _same_file(handle, path: Path) -> bool:
    """Whether an open file is still the one at ``path`` (not unlinked or replaced)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- writer


def incomplete_path(path: str | Path) -> Path:
    """Where the store ``path`` is built: ``<path>.incomplete``, moved to ``path`` once
    every shard is committed (so a store at its own path is always complete)."""
    path = Path(path)
    return path.with_name(path.name + INCOMPLETE)


class StoreWriter:
    """Create or resume a store and commit it shard by shard.

    The store is built in ``<path>.incomplete`` and moved to ``path`` when its last shard
    is committed. A run killed at any moment leaves ``path`` untouched; a rerun resumes the
    incomplete store from its committed shards, or starts it over if it was made from
    other inputs or is damaged (it is this writer's own folder). The outputs of a DVC
    stage are thus never partial, so no stage needs ``persist`` (which would cost it its
    run-cache entry).

    ``keys`` fixes the samples and their order up front (from the manifest). Dense shards
    can be committed in any order; a store with ragged fields commits in order, because
    a shard's rows start where the previous shard's end. Use as a context manager::

        with StoreWriter(path, "regions", fields, keys, provenance, cfg) as writer:
            for shard in writer.pending_shards():
                start, stop = writer.shard_range(shard)
                writer.write_shard(shard, {"features": ..., ...})

    With ``shards``, the writer is a *shard writer*: one of several processes filling
    disjoint shards of a dense store concurrently. It opens a store that a whole-store
    writer created (never creates, resumes ragged rows or starts one over), writes only
    the given shards, each under its own lock, and never finalizes: open a whole-store
    writer once every shard writer is done to finalize the store.
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
        shards: Sequence[int] | None = None,
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
        self.log = log
        self._lock_file = None
        self._shard_lock_files: list = []
        self.reused = False  # the complete store at `target` was made from the same inputs
        self.only: list[int] | None = None  # a shard writer's shards
        if shards is not None:
            self.only = sorted({int(k) for k in shards})
            outside = [k for k in self.only if not 0 <= k < self.n_shards]
            if outside:
                raise StoreError(
                    f"store {self.path}: shard(s) {outside} out of range; it has "
                    f"{self.n_shards} shards (0..{self.n_shards - 1})"
                )

    # -- lifecycle

    def __enter__(self) -> StoreWriter:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        if self.only is not None:
            self._open_shards()
            return
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
        for partial in self.path.rglob("*.partial"):  # temp files of a killed writer
            partial.unlink()
        sweep_stale(self.target)  # what a killed move into place left
        # no shard writer can hold a lock while we hold .lock exclusively
        shutil.rmtree(self.path / SHARD_LOCKS, ignore_errors=True)
        existing = self._existing_attrs()
        if existing is not None and not self._same_store(existing):
            self.log(
                f"store {self.target}: the incomplete store was made from other inputs or "
                f"with another layout (fingerprint {existing.get('fingerprint', '?')[:12]} != "
                f"{self.fingerprint[:12]}); starting it over"
            )
            existing = None
        if existing is None:
            self._clear()
            self._create()
        self.group = zarr.open_group(self.path, mode="r+")
        self.commits = self.group[COMMITS]
        markers = self.commits[:]
        self.committed = {k for k, m in enumerate(markers) if m}
        if self.committed:
            self.log(
                f"store {self.path}: resuming, {len(self.committed)}/{self.n_shards} shards done"
            )
        if self._ragged_names():
            with _write_every_chunk():
                self._truncate_ragged(markers)

    def close(self) -> None:
        for handle in self._shard_lock_files:  # lock files stay: only .lock's owner sweeps
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
        self._shard_lock_files = []
        if self._lock_file is None:
            return
        if self.only is None:  # shard writers never finalize nor remove the shared lock
            (self.path / LOCK).unlink(missing_ok=True)
            if len(self.committed) == self.n_shards:
                if not self.group.attrs["vse"].get("complete"):
                    self._finalize()
                if read_checksums(*_local_fs(self.path))[0] is None:
                    self._write_checksums()  # last: a store with it is whole
                replace_dir(self.path, self.target)  # still holding the lock's descriptor
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()
        self._lock_file = None

    def _acquire_lock(self, shared: bool = False) -> None:
        """``flock`` ``.lock``: exclusively for a whole-store writer, shared by shard writers.

        The lock file is unlinked when an exclusive writer closes; a lock taken on a file
        that was unlinked meanwhile protects nothing, so it is taken again on the new file.
        """
        lock_path = self.path / LOCK
        me = f"pid {os.getpid()} on {socket.gethostname()} since {_now()}"
        while True:
            handle = open(lock_path, "a+")
            try:
                fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                lines = [line for line in handle.read().splitlines() if line.strip()]
                holder = "; ".join(lines[-3:]) or "another process"  # the latest ones
                handle.close()
                raise StoreError(
                    f"store {self.path} is locked by a running writer ({holder}); wait for it "
                    "to finish, or stop it, before writing this store"
                ) from None
            if _same_file(handle, lock_path):
                break
            handle.close()
        if shared:  # shard writers list themselves; the next exclusive writer truncates
            handle.write(f"shard writer {me}\n")
        else:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{me}\n")
        handle.flush()
        self._lock_file = handle

    def _open_shards(self) -> None:
        """Open as a shard writer: shared store lock, one exclusive lock per own shard."""
        ragged = self._ragged_names()
        if ragged:
            raise StoreError(
                f"store {self.path}: ragged field(s) {ragged} put each shard's rows after the "
                "previous shard's, so this store is written in order by one writer; open it "
                "without shards= (and do not fan its shards out)"
            )
        if not (self.path / "zarr.json").is_file():
            raise StoreError(
                f"store {self.path} does not exist; create it first with one StoreWriter "
                "without shards= (the coordinator), then start the shard writers"
            )
        self._acquire_lock(shared=True)
        try:
            existing = self._existing_attrs()
            if existing is None or not self._same_store(existing):
                found = (existing or {}).get("fingerprint", "?")[:12]
                raise StoreError(
                    f"store {self.path} was made from other inputs or with another layout "
                    f"(fingerprint {found} != {self.fingerprint[:12]}); a shard writer never "
                    "starts a store over: recreate it with one StoreWriter without shards= "
                    "(the coordinator) first"
                )
            self._lock_shards()
            self.group = zarr.open_group(self.path, mode="r+")
            self.commits = self.group[COMMITS]
            markers = self.commits[:]  # read after locking: a shard done meanwhile is skipped
            self.committed = {k for k, m in enumerate(markers) if m}
            for shard in self.pending_shards():  # temp files of a killed writer of our shards
                for rel in self._shard_files(shard):
                    for partial in (self.path / rel).parent.glob(f"{Path(rel).name}.*.partial"):
                        partial.unlink(missing_ok=True)
        except BaseException:
            self.close()
            raise

    def _lock_shards(self) -> None:
        folder = self.path / SHARD_LOCKS
        folder.mkdir(exist_ok=True)
        me = f"pid {os.getpid()} on {socket.gethostname()} since {_now()}"
        for shard in self.only:
            handle = open(folder / str(shard), "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise StoreError(
                    f"store {self.path}: shard {shard} is being written by another shard "
                    f"writer ({holder}); give each writer its own shards"
                ) from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"{me}\n")
            handle.flush()
            self._shard_lock_files.append(handle)

    def _shard_files(self, shard: int) -> list[str]:
        """Files of a dense shard, relative to the store: one per field, and its marker."""
        files = [_chunk_key(n, shard, 1 + len(s.shape)) for n, s in self.fields.items()]
        return [*files, _chunk_key(COMMITS, shard, 1)]

    def _layout(self) -> dict:
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

    def _same_store(self, attrs: dict) -> bool:
        return (
            attrs.get("schema_version") == SCHEMA_VERSION
            and attrs.get("fingerprint") == self.fingerprint
            and attrs.get("layout") == self._layout()
            and attrs.get("n") == self.n
        )

    def _target_is_this_store(self) -> bool:
        """Whether ``target`` holds a complete store made from the same inputs."""
        try:
            attrs = dict(zarr.open_group(self.target, mode="r").attrs["vse"])
        except Exception:  # noqa: BLE001 - absent or not a store: it is (re)built
            return False
        if read_checksums(*_local_fs(self.target))[0] is None:
            return False  # no checksum manifest (damaged, or made by an older version)
        return bool(attrs.get("complete")) and self._same_store(attrs)

    def _clear(self) -> None:
        for child in self.path.iterdir():
            if child.name == LOCK:
                continue
            shutil.rmtree(child) if child.is_dir() else child.unlink()

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
            "layout": self._layout(),
            "n": self.n,
            "n_shards": self.n_shards,
            "complete": False,
        }
        keys = group.create_array(
            "keys", shape=(self.n,), chunks=(max(self.n, 1),), dtype=str, **_flat_keys()
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
                    chunks=(rows_chunk, *spec.shape),
                    shards=(rows_shard, *spec.shape),
                    dtype=spec.dtype,
                    fill_value=0,
                    **_codecs(cfg),
                    **_flat_keys(),
                )
                name, spec = f"{name}_offsets", FieldSpec((), "int64")
            group.create_array(
                name,
                shape=(self.n, *spec.shape),
                chunks=(chunk, *spec.shape),
                shards=(cfg.samples_per_shard, *spec.shape),
                dtype=spec.dtype,
                fill_value=0,
                **_codecs(cfg),
                **_flat_keys(),
            )
        group.create_array(COMMITS, shape=(self.n_shards,), chunks=(1,), dtype=str, **_flat_keys())

    def _ragged_names(self) -> list[str]:
        return [name for name, spec in self.fields.items() if spec.ragged]

    def _rows_committed(self, markers) -> dict[str, int]:
        """Rows of each ragged field up to the first uncommitted shard."""
        rows = {name: 0 for name in self._ragged_names()}
        for marker in markers:
            if not marker:
                break
            rows.update({k: v[1] for k, v in json.loads(marker)["rows"].items()})
        return rows

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
        for name, rows in self._rows_committed(markers).items():
            array = self.group[name]
            if array.shape[0] == rows:
                continue
            shard_rows = array.shards[0]
            start = rows - rows % shard_rows
            keep = array[start:rows]
            for index in range(start // shard_rows, -(-array.shape[0] // shard_rows)):
                (self.path / _chunk_key(name, index, array.ndim)).unlink(missing_ok=True)
            array.resize((rows, *array.shape[1:]))
            if len(keep):
                array[start:rows] = keep

    # -- writing

    def shard_range(self, shard: int) -> tuple[int, int]:
        start = shard * self.cfg.samples_per_shard
        return start, min(start + self.cfg.samples_per_shard, self.n)

    def pending_shards(self) -> list[int]:
        """Uncommitted shards (of a shard writer: its own), in order."""
        shards = range(self.n_shards) if self.only is None else self.only
        return [k for k in shards if k not in self.committed]

    def write_shard(
        self, shard: int, data: Mapping[str, Any], notes: Mapping[str, Any] | None = None
    ) -> None:
        """Write all fields of ``shard`` then its commit marker.

        ``data[name]`` is an array of shape ``(stop - start, *shape)`` for a dense field, or
        a list of ``(rows_i, *shape)`` arrays, one per sample, for a ragged field. ``notes``
        (JSON-able, e.g. the shard's bad inputs) are kept in the marker, so they survive a
        crash with the shard they describe.
        """
        with _write_every_chunk():
            self._write_shard(shard, data, dict(notes or {}))

    def _write_shard(self, shard: int, data: Mapping[str, Any], notes: dict) -> None:
        if self.only is not None and shard not in self.only:
            raise StoreError(
                f"store {self.path}: shard {shard} is not one of this shard writer's shards "
                f"{self.only}; another writer may be writing it"
            )
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
            rel = _chunk_key(name, shard, array.ndim)
            if self.cfg.compression == "none":
                files[rel] = self._write_raw_shard(rel, array)
            else:
                self.group[name][start:stop] = array
                files[rel] = ""
        for rel, checksum in files.items():
            if not checksum:
                files[rel] = file_checksum((self.path / rel).read_bytes())
        marker = {
            "shard": shard,
            "start": start,
            "stop": stop,
            "rows": rows,
            "files": files,
            "notes": notes,
        }
        self._write_marker(shard, json.dumps(marker, sort_keys=True))
        self.committed.add(shard)

    def _write_marker(self, shard: int, text: str) -> None:
        """Commit shard ``shard``: its marker, the chunk Zarr writes for ``commits[shard] =
        text`` (vlen-utf8, then zstd level 0: the same bytes, tested), by atomic rename."""
        data = numcodecs.Zstd(level=0).encode(
            numcodecs.VLenUTF8().encode(np.array([text], dtype=object))
        )
        path = self.path / _chunk_key(COMMITS, shard, 1)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        tmp.write_bytes(bytes(data))
        os.replace(tmp, path)

    def _write_raw_shard(
        self, rel: str, array: np.ndarray, chunk: int | None = None, per_shard: int | None = None
    ) -> str:
        """Write one uncompressed shard file (``per_shard`` rows in chunks of ``chunk``;
        a dense field's by default) as Zarr's sharding codec lays it out (the chunks along
        axis 0 back to back, then the index: (offset, nbytes) uint64 per chunk, absent
        ones all ones, and the index's CRC-32C), by atomic rename; returns its checksum.
        The same bytes Zarr writes (tested), without its per-chunk encoding, and
        checksummed as written rather than read back."""
        chunk = chunk or self.cfg.samples_per_chunk
        per_shard = per_shard or self.cfg.samples_per_shard
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        present = -(-len(array) // chunk)
        chunk_bytes = chunk * array[0].nbytes if len(array) else 0
        index = np.full((per_shard // chunk, 2), np.iinfo(np.uint64).max, dtype="<u8")
        index[:present, 0] = np.arange(present, dtype=np.uint64) * chunk_bytes
        index[:present, 1] = chunk_bytes
        tail = index.tobytes()
        tail += google_crc32c.value(tail).to_bytes(4, "little")
        padding = bytes(present * chunk_bytes - array.nbytes)  # the last chunk's fill
        crc = google_crc32c.value(_readonly(array))
        crc = google_crc32c.extend(google_crc32c.extend(crc, padding), tail)
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with open(tmp, "wb") as f:
            array.tofile(f)
            f.write(padding)
            f.write(tail)
        os.replace(tmp, path)
        return f"crc32c:{crc:08x}"

    def _write_ragged(self, name, spec, start, stop, samples, files) -> list[int]:
        if len(samples) != stop - start:
            raise StoreError(
                f"store {self.path}: ragged field {name!r} got {len(samples)} samples for "
                f"shard range {start}:{stop}"
            )
        raw = self.cfg.compression == "none"
        values = self.group[name]
        first = values.shape[0]
        lengths = [len(s) for s in samples]
        offsets = first + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        rel = _chunk_key(f"{name}_offsets", start // self.cfg.samples_per_shard, 1)
        if raw:
            files[rel] = self._write_raw_shard(rel, offsets)
        else:
            self.group[f"{name}_offsets"][start:stop] = offsets
            files[rel] = ""
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
                rel = _chunk_key(name, index, values.ndim)
                if not raw:
                    files[rel] = ""
                    continue
                lo, hi = index * shard_rows, min(last, (index + 1) * shard_rows)
                rows = flat[max(lo - first, 0) : hi - first]
                if lo < first:  # the file's rows so far come first: read them back
                    kept = np.fromfile(
                        self.path / rel,
                        np.dtype(spec.dtype).newbyteorder("<"),
                        count=(first - lo) * int(np.prod(spec.shape, dtype=np.int64)),
                    )
                    rows = np.concatenate([kept.reshape(first - lo, *spec.shape), rows])
                files[rel] = self._write_raw_shard(rel, rows, chunk_rows, shard_rows)
            if not raw:
                values[first:last] = flat
        return [int(first), int(last)]

    def write_extra(self, name: str, array: np.ndarray) -> None:
        """A store-level array that is not per sample (e.g. a fitted projection), one file,
        checksummed like the shards. Nothing to do when the complete store is reused."""
        if self.reused:
            return
        array = np.asarray(array)
        extra = self.group.create_array(
            name, shape=array.shape, dtype=array.dtype, chunks=array.shape or (1,), overwrite=True
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

    def _write_checksums(self) -> None:
        """The checksum manifest: every file of the finalized store. Chunks keep the
        checksums their commit markers recorded (so damage after a commit still shows);
        the rest (metadata, keys, markers, extras) are checksummed now (CRC-32C)."""
        files: dict[str, str] = {}
        for marker in self.commits[:]:
            files.update(json.loads(marker)["files"])  # later shards: final ragged files
        attrs = self.group.attrs["vse"]
        for name, digest in attrs.get("extras", {}).items():
            files[attrs["extras_files"][name]] = digest
        manifest = self.group.create_array(
            CHECKSUMS, shape=(1,), chunks=(1,), dtype=str, compressors=None, overwrite=True
        )
        for rel, path in _store_files(self.path):
            if rel not in files and rel != CHECKSUMS_CHUNK:
                files[rel] = file_checksum(path.read_bytes())
        manifest[0] = checksums_text(files)


# --------------------------------------------------------------------------- reader


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
    detail = " ".join(str(detail).split())[:200]
    return StoreError(
        f"{url}: {what} is damaged ({detail}); run `vse store verify {url}` to see which "
        "files, then rebuild the store (dvc repro) or restore it from the DVC cache"
    )


def take_rows(
    part: Callable[[int], np.ndarray],
    starts: np.ndarray,
    rows: np.ndarray,
    out: np.ndarray,
    positions: np.ndarray | None = None,
) -> None:
    """``out[positions[i]] = R[rows[i]]`` where R is the rows of several arrays laid end
    to end: ``part(k)`` holds rows ``starts[k]:`` up to the next start. One fancy-indexed
    copy per part touched, no per-row Python work. ``positions`` defaults to
    ``0..len(rows) - 1``; ``rows`` must be valid (the caller checks them)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return
    if len(starts) == 1:
        local = rows - starts[0]
        if positions is None:  # one copy straight into the output ("clip": rows are valid,
            np.take(part(0), local, axis=0, out=out, mode="clip")  # "raise" buffers)
        else:
            out[positions] = part(0)[local]
        return
    which = np.searchsorted(starts, rows, side="right") - 1  # (n,) part of each row
    if positions is None and np.all(which[1:] >= which[:-1]):
        # rows sorted by part: each part fills a contiguous slice, copied straight in
        cuts = np.flatnonzero(np.diff(which)) + 1
        for lo, hi in zip([0, *cuts], [*cuts, len(rows)], strict=True):
            k = int(which[lo])
            np.take(part(k), rows[lo:hi] - starts[k], axis=0, out=out[lo:hi], mode="clip")
        return
    order = np.argsort(which, kind="stable")
    cuts = np.flatnonzero(np.diff(which[order])) + 1
    for group in np.split(order, cuts):
        k = int(which[group[0]])
        dest = group if positions is None else positions[group]
        out[dest] = part(k)[rows[group] - starts[k]]  # a gather, then a scatter


def padded_rows(
    take: Callable, offsets: np.ndarray, indices: np.ndarray, row_shape, dtype, alloc=np.empty
) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``indices`` of a ragged array (sample i: rows ``offsets[i]:offsets[i+1]``),
    zero-padded to ``(B, L, *row_shape)`` (L the longest, at least 1) in an array from
    ``alloc``, and their ``(B,)`` lengths. ``take(rows, out, positions)`` copies value rows:
    only the samples' own rows are copied, in one vectorised call."""
    starts, lengths = offsets[indices], offsets[indices + 1] - offsets[indices]
    width = max(int(lengths.max(initial=0)), 1)
    out = alloc((len(indices), width, *row_shape), np.dtype(dtype))
    flat = out.reshape(len(indices) * width, *row_shape)
    valid = (np.arange(width)[None, :] < lengths[:, None]).reshape(-1)  # (B * L,)
    rows = (starts[:, None] + np.arange(width)[None, :]).reshape(-1)[valid]
    take(rows, flat, np.flatnonzero(valid))
    flat[~valid] = 0
    return out, lengths


def _open_group(url: str | Path, storage_options: dict | None = None):
    url = str(url)
    if url.startswith("s3://"):
        from features.config import require_extra

        require_extra("s3fs", "s3", f"reading {url}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
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
    _maps: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _memory: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    _chunks: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _arrays: dict = field(default_factory=dict, repr=False)
    _layouts: dict = field(default_factory=dict, repr=False)
    _views: OrderedDict = field(default_factory=OrderedDict, repr=False)

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
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
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

    def _check_committed(self, start: int, stop: int) -> None:
        shards = range(start // self.samples_per_shard, -(-stop // self.samples_per_shard))
        missing = [k for k in shards if not self.committed[k]]
        if missing:
            raise StoreError(
                f"{self.url}: samples {start}:{stop} lie in uncommitted shard(s) {missing}; "
                "rerun the extraction to finish the store"
            )

    def _checked(self, indices: Sequence[int]) -> np.ndarray:
        """``indices`` as int64, each in range and in a committed shard."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            bad = indices[(indices < 0) | (indices >= len(self))][0]
            raise IndexError(f"{self.url}: index {bad} out of range for {len(self)} samples")
        shards = indices // self.samples_per_shard
        if len(indices) and not self.committed[shards].all():
            missing = sorted({int(k) for k in shards[~self.committed[shards]]})
            raise StoreError(
                f"{self.url}: samples lie in uncommitted shard(s) {missing}; rerun the "
                "extraction to finish the store"
            )
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
        self._check_committed(start, stop)
        out: dict[str, Any] = {}
        for name in fields or self.fields:
            spec = self.fields[name]
            if spec.ragged:
                offsets = self.offsets(name)
                flat = self.group[name][offsets[start] : offsets[stop]]
                cuts = offsets[start : stop + 1] - offsets[start]
                out[name] = [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            elif self._mappable:
                view = self._mapped(name, spec, start, stop)
                out[name] = np.array(view) if copy else view
            else:
                out[name] = self.group[name][start:stop]
        return out

    @property
    def _mappable(self) -> bool:
        """Local and uncompressed: chunks are raw bytes at offsets in the shard files."""
        return self.attrs["layout"]["compression"] == "none" and "://" not in self.url

    def _shard_file(self, name: str, shard: int) -> tuple[np.memmap, np.ndarray]:
        """Shard file ``shard`` (along axis 0) of array ``name`` (a field, or a ragged
        field's rows) mapped into memory, and its index: (offset, nbytes) per chunk."""
        cache_key = (name, shard)
        if cache_key in self._maps:
            self._maps.move_to_end(cache_key)
            return self._maps[cache_key]
        if len(self._maps) >= MAX_MAPS:  # each mapping holds a file descriptor
            self._maps.popitem(last=False)
        array = self._array(name)
        separator = self.attrs["layout"].get("chunk_key_separator", "/")
        rel = _chunk_key(name, shard, array.ndim, separator)
        data = np.memmap(Path(self.url) / rel, np.uint8, "r")
        n_chunks = array.shards[0] // array.chunks[0]
        # sharding codec index, at the end: n_chunks x (offset, nbytes) uint64 + crc32c
        index = data[-(16 * n_chunks + 4) : -4].view("<u8").reshape(n_chunks, 2)
        self._maps[cache_key] = (data, index)
        return data, index

    def _mapped(self, name: str, spec: FieldSpec, start: int, stop: int) -> np.ndarray:
        chunk, per_shard = self.samples_per_chunk, self.samples_per_shard
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        pieces = []
        for c in range(start // chunk, (stop - 1) // chunk + 1):
            shard, inner = divmod(c * chunk, per_shard)
            data, index = self._shard_file(name, shard)
            offset, nbytes = (int(v) for v in index[inner // chunk])
            values = data[offset : offset + nbytes].view(dtype).reshape(chunk, *spec.shape)
            lo, hi = max(start - c * chunk, 0), min(stop - c * chunk, chunk)
            pieces.append(values[lo:hi])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _array(self, name: str):
        """Zarr array ``name``, kept (each lookup through the group costs ~1 ms)."""
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    def _layout(self, name: str) -> tuple[tuple[int, ...], int, int, np.dtype]:
        """Shape, rows per chunk, rows per shard file and dtype of array ``name``, kept."""
        if name not in self._layouts:
            array = self._array(name)
            self._layouts[name] = (
                tuple(array.shape),
                array.chunks[0],
                array.shards[0],
                np.dtype(array.dtype).newbyteorder("<"),
            )
        return self._layouts[name]

    def _part(self, name: str, k: int) -> np.ndarray:
        """Rows ``k * shard_rows:(k + 1) * shard_rows`` of array ``name`` as one array
        (kept): a view of its memory-mapped shard file, which holds its chunks back to back
        in order (what the writer produces; a file laid out otherwise is read through
        Zarr)."""
        key = (name, k)
        if key in self._views:
            self._views.move_to_end(key)
            return self._views[key]
        shape, chunk_rows, shard_rows, dtype = self._layout(name)
        data, index = self._shard_file(name, k)
        n = -(-(min(shape[0], (k + 1) * shard_rows) - k * shard_rows) // chunk_rows)
        chunk_bytes = chunk_rows * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        expected = np.stack([np.arange(n) * chunk_bytes, np.full(n, chunk_bytes)], 1)
        if np.array_equal(index[:n], expected):
            view = data[: n * chunk_bytes].view(np.ndarray).view(dtype)
            view = view.reshape(n * chunk_rows, *shape[1:])
        else:
            view = self._zarr_part(name, k, shard_rows)
        if len(self._views) >= MAX_MAPS:
            self._views.popitem(last=False)
        self._views[key] = view
        return view

    def _zarr_part(self, name: str, k: int, rows: int) -> np.ndarray:
        """Rows ``k * rows:(k + 1) * rows`` of array ``name`` read through Zarr; the last
        few are kept (remote and compressed stores read a chunk at a time)."""
        key = (name, k, rows)
        if key in self._chunks:
            self._chunks.move_to_end(key)
        else:
            if len(self._chunks) >= CACHED_CHUNKS:
                self._chunks.popitem(last=False)
            self._chunks[key] = self._array(name)[k * rows : (k + 1) * rows]
        return self._chunks[key]

    def _take(self, name: str, rows: np.ndarray, out: np.ndarray, positions=None) -> None:
        """``out[positions] = rows`` of array ``name`` (a dense field's samples or a ragged
        field's value rows; ``rows`` valid): from memory when the array is small (read
        once), else one fancy-indexed copy per memory-mapped shard file touched (local,
        uncompressed stores) or per chunk read through Zarr (remote or compressed)."""
        shape, chunk_rows, shard_rows, dtype = self._layout(name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if name not in self._memory and nbytes <= IN_MEMORY_BYTES:
            self._memory[name] = (
                self._mapped_rows(name) if self._mappable else np.asarray(self._array(name)[...])
            )
        if name in self._memory:
            take_rows(lambda k: self._memory[name], np.zeros(1, np.int64), rows, out, positions)
            return
        if self._mappable:
            unit = shard_rows
            part = functools.partial(self._part, name)
        else:
            unit = chunk_rows
            part = functools.partial(self._zarr_part, name, rows=unit)
        take_rows(part, np.arange(0, shape[0], unit, dtype=np.int64), rows, out, positions)

    def _mapped_rows(self, name: str) -> np.ndarray:
        """All rows of array ``name`` copied from its shard files."""
        shape, _, shard_rows, dtype = self._layout(name)
        n_files = -(-shape[0] // shard_rows)
        if not n_files:
            return np.empty(shape, dtype)
        return np.concatenate([self._part(name, k) for k in range(n_files)])[: shape[0]]

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
        state.update(_maps=OrderedDict(), _chunks=OrderedDict(), _views=OrderedDict())
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


# --------------------------------------------------------------------------- integrity


def checksums_text(files: Mapping[str, str]) -> str:
    """The checksum manifest: canonical JSON of the files' checksums (``crc32c:<hex>``, or
    SHA-256 hex in stores committed before CRC-32C) and a SHA-256 digest of that listing,
    so that the manifest checks itself (any change to it breaks one or the other, or its
    canonical form)."""
    listing = json.dumps(dict(sorted(files.items())), separators=(",", ":"))
    body = {"files": dict(sorted(files.items()))}
    body["digest"] = sha256_bytes(listing.encode())
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _vlen_utf8_single(data: bytes) -> str:
    """The one string of an uncompressed Zarr ``vlen-utf8`` chunk of one element:
    ``<u4 count = 1><u4 length><utf-8 bytes>``, nothing more."""
    if len(data) < 8 or int.from_bytes(data[:4], "little") != 1:
        raise ValueError("not one vlen-utf8 string")
    length = int.from_bytes(data[4:8], "little")
    if len(data) != 8 + length:
        raise ValueError(f"{len(data)} bytes for a string of {length}")
    return data[8:].decode("utf-8")


def parse_checksums(data: bytes) -> dict[str, str]:
    """The files' checksums in the bytes of a checksum manifest chunk; ``ValueError`` if
    they are not exactly what :func:`checksums_text` wrote."""
    try:
        text = _vlen_utf8_single(data)
        body = json.loads(text)
        files = body["files"]
        if text != json.dumps(body, sort_keys=True, separators=(",", ":")):
            raise ValueError("not in canonical form")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError("not a listing of checksums")
        if text != checksums_text(files):
            raise ValueError("its digest does not match its listing")
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"not a checksum manifest ({type(err).__name__}: {err})") from None
    return files


def read_checksums(fs, root: str) -> tuple[dict[str, str] | None, str]:
    """The checksum manifest of the store at ``root`` (an fsspec file system and path):
    ``(files, "")``, or ``(None, why)``: ``"missing"`` or what is wrong with it."""
    try:
        data = fs.cat_file(f"{root}/{CHECKSUMS_CHUNK}")
    except FileNotFoundError:
        return None, "missing"
    except OSError as err:
        return None, f"unreadable ({err})"
    try:
        return parse_checksums(data), ""
    except ValueError as err:
        return None, f"corrupt ({err})"


def _local_fs(path: Path):
    import fsspec

    return fsspec.filesystem("file"), str(Path(path).absolute())


def _store_files(path: Path) -> Iterator[tuple[str, Path]]:
    """``(relative name, path)`` of every file of a local store but writers' lock and
    temporary files."""
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(path).as_posix()
        if file.is_file() and not (
            rel == LOCK or rel.startswith(SHARD_LOCKS + "/") or rel.endswith(".partial")
        ):
            yield rel, file


def _commit_markers(url: str, storage_options, n_shards: int | None, problems: list) -> list:
    """Each shard's commit marker (a dict, or None if uncommitted); a damaged one is
    named in ``problems`` and counts as uncommitted."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            commits = zarr.open_array(
                f"{url.rstrip('/')}/{COMMITS}", mode="r", storage_options=storage_options
            )
    except Exception as err:  # noqa: BLE001 - damaged array metadata
        problems.append(f"{COMMITS}/zarr.json: corrupt or missing ({type(err).__name__})")
        return []
    markers = []
    for k in range(commits.shape[0] if n_shards is None else n_shards):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                text = str(commits[k : k + 1][0])
            marker = json.loads(text) if text else None
            if marker is not None and not isinstance(marker.get("files"), dict):
                raise ValueError("no file checksums")
        except Exception as err:  # noqa: BLE001 - damaged chunk: name it, go on
            separator = commits.metadata.chunk_key_encoding.separator
            rel = _chunk_key(COMMITS, k, 1, separator)
            problems.append(f"{rel}: corrupt ({type(err).__name__}: {err})"[:200])
            marker = None
        else:
            if marker is None:
                problems.append(f"shard {k}: not committed (store incomplete)")
        markers.append(marker)
    return markers


def verify_store(url: str | Path, storage_options: dict | None = None) -> list[str]:
    """Check every file of a store (local or fsspec URL) against its checksum; returns
    one line per problem, naming the file, empty if the store is intact.

    A finalized store is checked against its checksum manifest, file by file, without
    reading any of its metadata first, so damaged metadata is named like any other file.
    An incomplete store (or one whose manifest is damaged) is checked against what its
    commit markers record. Raises :class:`StoreError` only if nothing is there.
    """
    import fsspec

    url = str(url)
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    try:
        present = {
            p[len(root) + 1 :]
            for p in fs.find(root)
            if not p.endswith(".partial") and p[len(root) + 1 :] not in (LOCK,)
        }
    except FileNotFoundError:
        present = set()
    present = {p for p in present if not p.startswith(SHARD_LOCKS + "/")}
    if not present:
        raise StoreError(f"{url}: no such store (no files there); check the path")
    files, why = read_checksums(fs, root)
    problems: list[str] = []
    if files is not None:
        expected = files
    else:
        if why != "missing":
            problems.append(f"{CHECKSUMS_CHUNK}: {why}")
        attrs: dict = {}
        try:
            attrs = json.loads(fs.cat_file(f"{root}/zarr.json"))["attributes"]["vse"]
            if not isinstance(attrs, dict):
                raise TypeError("'vse' attributes are not a mapping")
        except FileNotFoundError:
            problems.append("zarr.json: missing")
        except Exception as err:  # noqa: BLE001 - damaged: name the file and go on
            problems.append(f"zarr.json: corrupt ({type(err).__name__}: {err})"[:200])
            attrs = {}
        if attrs.get("complete") and why == "missing":
            problems.append(
                f"{CHECKSUMS_CHUNK}: missing, though the store is marked complete; rebuild "
                "the store"
            )
        n_shards = attrs.get("n_shards") if isinstance(attrs.get("n_shards"), int) else None
        expected = {}
        for marker in _commit_markers(url, storage_options, n_shards, problems):
            if marker is not None:
                expected.update(marker["files"])  # later shards: final ragged checksums
        extras, names = attrs.get("extras", {}), attrs.get("extras_files", {})
        if isinstance(extras, dict) and isinstance(names, dict):
            expected.update({names[k]: v for k, v in extras.items() if k in names})
    for rel, digest in sorted(expected.items()):
        try:
            data = fs.cat_file(f"{root}/{rel}")
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if not _checksum_matches(data, digest):
            problems.append(f"{rel}: corrupt (checksum mismatch)")
    if files is not None:
        for rel in sorted(present - set(files) - {CHECKSUMS_CHUNK}):
            problems.append(f"{rel}: unexpected file (not in the checksum manifest)")
    return problems


# --------------------------------------------------------------------------- joining


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
