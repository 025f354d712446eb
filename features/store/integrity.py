"""Every file of a store covered by a checksum: CRC-32C per file (commit markers hold their
shard's), the self-checking checksum manifest written last, and ``verify_store``, which
checks a store file by file without trusting its metadata."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import google_crc32c
import numpy as np
import zarr

from features.store.layout import CHECKSUMS_CHUNK, COMMITS, LOCK, SHARD_LOCKS, chunk_key, is_temp
from features.store.spec import StoreError


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_checksum(data) -> str:
    """Checksum of a store file's bytes, as commit markers record it: ``crc32c:<hex>``
    (it finds corrupt and truncated files at a fraction of a SHA-256's cost). Markers of
    older stores hold SHA-256 hex digests; :func:`verify_store` checks both."""
    return f"crc32c:{google_crc32c.value(readonly_view(data)):08x}"


def readonly_view(data):
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


def local_fs(path: Path):
    import fsspec

    return fsspec.filesystem("file"), str(Path(path).absolute())


def _is_writers_file(rel: str) -> bool:
    """Whether a store's file (relative name) is a writer's lock or temporary file."""
    return rel == LOCK or rel.startswith(SHARD_LOCKS + "/") or is_temp(rel.rsplit("/", 1)[-1])


def store_files(fs, root: str) -> Iterator[str]:
    """The relative name of every file of the store at ``root`` (an fsspec file system and
    path) but writers' lock and temporary files."""
    fs.invalidate_cache(root)
    for path in fs.find(root):
        rel = path[len(root) + 1 :]
        if not _is_writers_file(rel):
            yield rel


def recorded_files(markers, attrs: dict) -> dict[str, str]:
    """The checksums that commit markers (dicts; None: uncommitted) and the store's
    attributes (store-level arrays) record, by file; later shards' final ragged files win."""
    files: dict[str, str] = {}
    for marker in markers:
        if marker is not None:
            files.update(marker["files"])
    extras, names = attrs.get("extras", {}), attrs.get("extras_files", {})
    if isinstance(extras, dict) and isinstance(names, dict):
        files.update({names[k]: v for k, v in extras.items() if k in names})
    return files


def _commit_markers(url: str, storage_options, n_shards: int | None, problems: list) -> list:
    """Each shard's commit marker (a dict, or None if uncommitted); a damaged one is
    named in ``problems`` and counts as uncommitted."""
    try:
        with warnings.catch_warnings(action="ignore"):
            commits = zarr.open_array(
                f"{url.rstrip('/')}/{COMMITS}", mode="r", storage_options=storage_options
            )
    except Exception as err:  # noqa: BLE001 - damaged array metadata
        problems.append(f"{COMMITS}/zarr.json: corrupt or missing ({type(err).__name__})")
        return []
    markers = []
    for k in range(commits.shape[0] if n_shards is None else n_shards):
        try:
            with warnings.catch_warnings(action="ignore"):
                text = str(commits[k : k + 1][0])
            marker = json.loads(text) if text else None
            if marker is not None and not isinstance(marker.get("files"), dict):
                raise ValueError("no file checksums")
        except Exception as err:  # noqa: BLE001 - damaged chunk: name it, go on
            separator = commits.metadata.chunk_key_encoding.separator
            rel = chunk_key(COMMITS, k, 1, separator)
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
        found = [p[len(root) + 1 :] for p in fs.find(root)]
    except FileNotFoundError:
        found = []
    present = {rel for rel in found if not _is_writers_file(rel)}
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
        expected = recorded_files(_commit_markers(url, storage_options, n_shards, problems), attrs)
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
