"""Writing outputs so that no reader ever sees one half-written.

Every output is written under a unique temporary name in its folder, then moved into
place with one ``os.replace`` (atomic on POSIX). A killed writer leaves only its
temporary file (named with its pid: the next write of that path sweeps those of processes
that are gone); a hardlinked DVC cache object is never opened for writing in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; moved onto ``path`` on success,
    removed on failure. With ``directory``, the temporary path is an empty folder and an
    existing ``path`` folder is replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    prefix = f".{path.name}.{os.getpid()}."  # unique: pid and a random part
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if directory:
            os.chmod(tmp, 0o755)  # mkdtemp makes folders 0700
            replace_dir(tmp, path)
        else:
            os.chmod(tmp, 0o644)  # mkstemp makes files 0600
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def _gone(pid: str) -> bool:
    """Whether process ``pid`` (a string from a file name) no longer runs."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (ValueError, PermissionError, OverflowError):
        pass
    return False


def sweep_stale(path: str | Path) -> None:
    """Remove what killed writers of ``path`` left beside it: temporary files or folders
    (``.<name>.<pid>.<random>.tmp``) and old copies a killed :func:`replace_dir` moved
    aside (``.<name>.old-<pid>``), of processes that are gone."""
    path = Path(path)
    prefix = f".{path.name}."
    try:  # one listing, no glob patterns: this runs before every atomic write
        names = [e.name for e in os.scandir(path.parent) if e.name.startswith(prefix)]
    except FileNotFoundError:
        return
    stale = [
        path.parent / name
        for name in names
        if (name.endswith(".tmp") and _gone(name[len(prefix) :].split(".", 1)[0]))
        or (name[len(prefix) :].startswith("old-") and _gone(name.rsplit("-", 1)[1]))
    ]
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def replace_dir(src: Path, dst: Path) -> None:
    """Move folder ``src`` onto ``dst``: an old ``dst`` is moved aside first and deleted
    after, so ``dst`` is at every moment either the old folder, absent, or the new one."""
    sweep_stale(dst)
    old = None
    if dst.exists() or dst.is_symlink():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


def is_url(path: str | Path) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://bucket/x``) rather than a local path
    (``Path`` would fold the URL's ``//``)."""
    return "://" in str(path)


def location(value: str | Path) -> str | Path:
    """A path argument as it is meant: an fsspec URL as given, a local path as a ``Path``."""
    return str(value) if is_url(value) else Path(value)


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def round_floats(data: Any, digits: int) -> Any:
    """``data`` (JSON-like: dicts, lists, numbers) with every float rounded to ``digits``
    decimals; ints, bools and strings unchanged."""
    if isinstance(data, float):
        return round(data, digits)
    if isinstance(data, dict):
        return {k: round_floats(v, digits) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [round_floats(v, digits) for v in data]
    return data


def write_json(path: str | Path, data: Any, indent: int | None = 2, digits: int | None = None):
    """Write ``data`` as JSON, atomically; the same data gives the same bytes. With
    ``digits``, floats are rounded to that many decimals (:func:`round_floats`): a figure
    then reads as what it means, and one that differs only beyond them (a float sum in
    another order) writes the same bytes."""
    if digits is not None:
        data = round_floats(data, digits)
    write_text(path, json.dumps(data, indent=indent) + "\n")


def save_torch(obj: Any, path: str | Path) -> None:
    """``torch.save`` atomically, with the same bytes for the same object: saved through a
    file object, since given a path torch names the archive's folder after the file (the
    temporary one here, a new name each time)."""
    import torch

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def sha256_file(path: str | Path) -> str:
    """SHA-256 hex digest of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
