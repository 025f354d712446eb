"""Where each member of a shard lies, and whether it is the member that was built.

The stdlib's :mod:`tarfile` locates the members (header checksums, long names, pax records,
base-256 sizes); a local shard's members are sliced from its memory map, a remote one's read
in sequence. Each is checked against what ``sizes.json`` recorded (name, size, CRC-32C, in
order): a damaged header or a cut tar is a missing member, damaged data fail their CRC-32C.
Every failure is one :class:`StoreError` line naming the shard, the member and what to do.
"""

from __future__ import annotations

import mmap
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from features.store.integrity import file_checksum
from features.store.reader import Kept
from features.store.spec import StoreError
from infra.files import is_url

REBUILD = "rebuild the shards with `vse shards build`"


def member_entry(name: str, data: bytes) -> list:
    """What ``sizes.json`` records of one member: ``[name, size, "crc32c:<hex>"]``."""
    return [name, len(data), file_checksum(data)]


class Expected:
    """The members recorded for the shard at ``url`` (``recorded``: its entry in
    ``sizes.json``), checked one by one in tar order; ``recorded=None`` checks nothing
    (benchmarks measure the check's cost with it)."""

    def __init__(self, url: str, recorded: Mapping | None):
        self.url, self.recorded = url, recorded
        self.members = recorded["members"] if recorded is not None else None
        self.position = 0

    def fail(self, member: str, problem: str) -> StoreError:
        return StoreError(f"{self.url}: member {member}: {problem}; {REBUILD}")

    def check(self, name: str, data) -> None:
        """``data`` of the next member ``name`` is the one that was built."""
        if self.members is None:
            return
        if self.position >= len(self.members):
            raise self.fail(name, "not among the members sizes.json records")
        want_name, want_size, want_crc = self.members[self.position]
        if name != want_name:
            raise self.fail(want_name, f"found {name!r} in its place")
        if len(data) != want_size:
            problem = "a cut tar or a damaged header"
            raise self.fail(name, f"{len(data)} bytes, built with {want_size} ({problem})")
        if (crc := file_checksum(data)) != want_crc:
            raise self.fail(name, f"damaged data ({crc}, built with {want_crc})")
        self.position += 1

    def end(self, error: str | None, size: int | None) -> None:
        """Every recorded member was read (``error``: why :mod:`tarfile` stopped, if it
        did; ``size``: the tar's bytes, when known)."""
        if self.members is None or self.position == len(self.members):
            return
        built = self.recorded["bytes"]
        if size is not None and size != built:
            why = f"the tar is cut ({size} bytes, built with {built})"
        else:
            why = "its tar header is damaged"
        if error:
            why += f"; tarfile: {error}"
        raise self.fail(self.members[self.position][0], f"missing: {why}")


def members(
    url: str, recorded: Mapping | None, storage_options: dict | None = None
) -> Iterator[tuple[str, memoryview]]:
    """``(name, data)`` of each regular member of the shard at ``url``, checked against
    ``recorded`` (see :class:`Expected`): a local file's data are views of its memory
    map, a remote one's read in sequence."""
    expected = Expected(url, recorded)
    if not is_url(url) or url.startswith("file://"):
        mapped = _mapped(url.removeprefix("file://"), url)
        view = mapped.view
        if recorded is not None and mapped.verified != recorded["members"]:
            for name, start, size in mapped.found:  # all of them, before the first group
                expected.check(name, view[start : start + size])
            expected.end(mapped.error, len(view))
            mapped.verified = recorded["members"]
        for name, start, size in mapped.found:
            yield name, view[start : start + size]
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        f = fs.open(path, "rb", block_size=16 << 20)
    except FileNotFoundError:
        raise StoreError(f"{url}: missing; {REBUILD}") from None
    error = None
    with f:
        try:
            with tarfile.open(fileobj=f, mode="r|") as tar:
                for info in tar:
                    if info.isreg():
                        data = memoryview(tar.extractfile(info).read())
                        expected.check(info.name, data)
                        yield info.name, data
        except (tarfile.TarError, EOFError) as err:
            error = str(err) or type(err).__name__
        expected.end(error, f.size)


@dataclass
class Mapped:
    """A local tar memory-mapped, its regular members' ``(name, offset, size)`` as
    :mod:`tarfile` finds them, why it stopped early (None if it did not), and the
    recorded members its bytes were checked against (None: not yet)."""

    view: memoryview
    found: list[tuple[str, int, int]]
    error: str | None
    verified: list | None = None


MAX_MAPPED = 1024


_MAPPED = Kept(MAX_MAPPED)  # local shards stay mapped (and checked) between epochs


def _mapped(path: str, url: str) -> Mapped:
    """The local tar ``path`` located and mapped (populated: every page at once), kept while
    the file is unchanged, so that its members' CRC-32C are checked once, the first time it
    is read."""
    try:
        stat = Path(path).stat()
    except FileNotFoundError:
        raise StoreError(f"{url}: missing; {REBUILD}") from None
    key = (path, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return _MAPPED(key, lambda: _map(path, stat.st_size))


def _map(path: str, size: int) -> Mapped:
    found, error = [], None
    with open(path, "rb") as f:
        try:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for info in iter(tar.next, None):
                    if info.isreg():
                        found.append((info.name, info.offset_data, info.size))
        except tarfile.TarError as err:
            error = str(err)
        view = memoryview(b"")
        if size:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            view = memoryview(mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ))
    return Mapped(view, found, error)
