"""A dense store written straight to object storage (``s3://``, any fsspec URL) by several
writers at once, on several hosts, with no lock (S3 has neither ``flock`` nor ``rename``)::

    <url>/                              the store: created as an empty skeleton (metadata,
                                        keys, no commit markers), filled at finalization
    <url>.incomplete/<writer>/<file>    a writer's staged shard files (``writer``: host,
                                        pid and a random part, new for every writer)
    <url>.incomplete/_claims/<k>        shard k's claim: its writer and its commit marker

1. One coordinator creates the skeleton, or resumes it (same fingerprint, layout and
   samples), or keeps a complete store made from the same inputs.
2. A writer stages a shard's files under its own name, then claims the shard with one
   conditional PUT (``If-None-Match: *``): the first claim wins, a refused writer deletes
   its staged files, so a zombie writer that finishes late can only lose.
3. Once every shard is claimed, the coordinator copies each winner's files into place,
   writes the commit markers, marks the store complete, writes the checksum manifest last,
   then deletes the staging prefix.

A killed writer leaves only staged files under its own name, which the rerun's coordinator
deletes. The finished store is byte for byte the store a local writer makes from the same
inputs. A store rebuilt at the same URL is deleted first (readers are refused meanwhile).
Ragged fields need the shards in order from one writer: write those stores locally, then push.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from features.store.integrity import local_fs, read_checksums, store_files
from features.store.layout import COMMITS, INCOMPLETE
from features.store.spec import FieldSpec, Provenance, StoreConfig, StoreError
from features.store.writer import (
    BaseWriter,
    StoreWriter,
    check_own_shard,
    own_shards,
    write_checksums,
)

CLAIMS = "_claims"


class _Scratch(StoreWriter):
    """The local copy a remote writer computes its shards in: the store's skeleton in a
    temporary folder; a shard's commit is handed to ``publish`` instead of written."""

    publish: Any = None

    def _write_marker(self, shard: int, text: str) -> None:
        self.publish(shard, text)

    def close(self) -> None:  # never finalized here: the remote store is
        self._release_lock()


class RemoteStoreWriter(BaseWriter):
    """The writer of a store at an fsspec URL: the coordinator (``shards=None``: creates,
    resumes or keeps the store, may write any shard, finalizes it when every shard is
    committed) or one of several shard writers (``shards=[...]``: writes only those,
    never creates or finalizes). The same interface as :class:`StoreWriter` for
    :func:`features.images.extract.extract_images`."""

    def __init__(
        self,
        url: str,
        kind: str,
        fields: Mapping[str, FieldSpec],
        keys: Sequence[str],
        provenance: Provenance,
        cfg: StoreConfig | None = None,
        log=print,
        shards: Sequence[int] | None = None,
        storage_options: dict | None = None,
    ):
        import fsspec

        self.url = str(url).rstrip("/")
        self.storage_options = storage_options
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.staging = self.root + INCOMPLETE
        self.writer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.log = log
        self._folder = tempfile.TemporaryDirectory(prefix="vse-store-")
        self.scratch = _Scratch(
            Path(self._folder.name) / "store.zarr", kind, fields, keys, provenance, cfg, log
        )
        self.scratch.publish = self._claim
        self.fields, self.n_shards = self.scratch.fields, self.scratch.n_shards
        self.shard_range = self.scratch.shard_range
        self.coordinator = shards is None
        self.only = own_shards(
            self.url, range(self.n_shards) if shards is None else shards, self.n_shards
        )
        self.reused = False
        self.committed: set[int] = set()

    # -- lifecycle

    def open(self) -> None:
        ragged = self.scratch._ragged_names()
        if ragged:
            raise StoreError(
                f"store {self.url}: ragged field(s) {ragged} are written in order by one "
                "writer; write this store to a local path, then push it (dvc push)"
            )
        existing = self._remote_attrs()
        same = existing is not None and self.scratch._difference(existing) is None
        if self.coordinator and same and existing.get("complete"):
            if read_checksums(self.fs, self.root)[0] is not None:
                self.reused, self.committed = True, set(self.only)
                self.log(f"store {self.url}: complete, made from the same inputs; kept")
                self._remove(self.staging)  # a late zombie's leftovers
                return
        if existing is None and not self.coordinator:
            raise StoreError(
                f"store {self.url} does not exist; create it first with one coordinator "
                "(shards=None), then start the shard writers"
            )
        if not same and not self.coordinator:
            raise StoreError(
                f"store {self.url} was made from other inputs or with another layout "
                f"({self.scratch._difference(existing)}); a shard writer never starts a "
                "store over: recreate it with one coordinator first"
            )
        self.scratch.open()  # the skeleton, locally
        if not same:
            self._create(existing)
        self.committed = self._claimed()
        if self.committed:
            self.log(
                f"store {self.url}: resuming, {len(self.committed)}/{self.n_shards} shards done"
            )

    def close(self) -> None:
        self.scratch.close()
        try:
            if self.coordinator and not self.reused and self._claimed() == set(self.only):
                self._finalize()
        finally:
            self._folder.cleanup()

    def write_shard(
        self, shard: int, data: Mapping[str, Any], notes: Mapping[str, Any] | None = None
    ) -> None:
        """Compute the shard's files locally, stage them and claim the shard
        (:meth:`StoreWriter.write_shard`'s arguments)."""
        check_own_shard(self.url, shard, self.only)
        self.scratch.write_shard(shard, data, notes)
        self.committed.add(shard)

    def write_extra(self, name: str, array: np.ndarray) -> None:
        raise StoreError(
            f"store {self.url}: store-level arrays ({name!r}) are written to local stores "
            "only; write this store to a local path, then push it"
        )

    # -- the protocol

    def _claim_path(self, shard: int) -> str:
        return f"{self.staging}/{CLAIMS}/{shard}"

    def _claim(self, shard: int, marker: str) -> None:
        """Stage the shard's files under this writer's name, then claim the shard; a
        refused claim (another writer committed it first) discards the staged files."""
        files = json.loads(marker)["files"]
        staged = [f"{self.staging}/{self.writer}/{rel}" for rel in files]
        for rel, remote in zip(files, staged, strict=True):
            local = self.scratch.path / rel
            self.fs.put_file(str(local), remote)
            local.unlink()  # the scratch keeps no data
        claim = json.dumps({"writer": self.writer, "marker": marker}).encode()
        try:
            self.fs.pipe_file(self._claim_path(shard), claim, mode="create")
        except FileExistsError:
            self.fs.rm(staged)
            winner = json.loads(self.fs.cat_file(self._claim_path(shard)))["writer"]
            self.log(
                f"store {self.url}: shard {shard} was committed first by writer {winner}; "
                f"this writer's copy ({self.writer}) is discarded"
            )

    def _claimed(self) -> set[int]:
        folder = f"{self.staging}/{CLAIMS}"
        self.fs.invalidate_cache(folder)
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False)]
        except FileNotFoundError:
            return set()
        return {int(n) for n in names if n.isdigit() and int(n) < self.n_shards}

    def _remote_attrs(self) -> dict | None:
        """The remote store's attributes; None if there is none or they are damaged."""
        self.fs.invalidate_cache(self.root)
        try:
            attrs = json.loads(self.fs.cat_file(f"{self.root}/zarr.json"))["attributes"]["vse"]
            self.fs.cat_file(f"{self.root}/{COMMITS}/zarr.json")  # uploaded last
        except (FileNotFoundError, KeyError, TypeError, ValueError):
            return None
        return attrs if isinstance(attrs, dict) else None

    def _remove(self, path: str) -> None:
        self.fs.invalidate_cache(path)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def _create(self, existing: dict | None) -> None:
        """The store's skeleton, uploaded over whatever was at the URL (its commit
        markers' array last: a store cut short while being created has none)."""
        if existing is not None:
            self.log(
                f"store {self.url}: made from other inputs or with another layout; starting it over"
            )
        self._remove(self.root)
        self._remove(self.staging)
        local = self.scratch.path
        files = store_files(*local_fs(local))
        for rel in sorted(files, key=lambda rel: rel == f"{COMMITS}/zarr.json"):
            self.fs.put_file(str(local / rel), f"{self.root}/{rel}")

    def _finalize(self) -> None:
        """Every shard claimed: the winners' files into place, the commit markers, the
        attributes marked complete, the checksum manifest last; then no staging."""
        claims = [json.loads(self.fs.cat_file(self._claim_path(k))) for k in self.only]
        markers = []
        for claim in claims:
            markers.append(claim["marker"])
            for rel in json.loads(claim["marker"])["files"]:
                self.fs.copy(f"{self.staging}/{claim['writer']}/{rel}", f"{self.root}/{rel}")
        group = zarr.open_group(self.url, mode="r+", storage_options=self.storage_options)
        group[COMMITS][:] = np.asarray(markers, dtype=object)
        attrs = dict(group.attrs["vse"])
        attrs.update(complete=True, counts={"samples": attrs["n"], "shards": self.n_shards})
        group.attrs["vse"] = attrs
        write_checksums(group, markers, self.fs, self.root)
        self._remove(self.staging)
        self.log(f"store {self.url}: complete, {self.n_shards} shards")
