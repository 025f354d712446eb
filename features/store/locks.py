"""Writers' locks on a local store: one ``flock`` helper for the store's ``.lock`` (a
whole-store writer holds it exclusively, shard writers share it) and each shard's lock
(held exclusively by the shard writer writing it). Each lock file names its holders, so
that a refused writer is told who holds it."""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path


def same_file(handle, path: Path) -> bool:
    """Whether an open file is still the one at ``path`` (not unlinked or replaced)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def take_lock(
    path: Path, refused: Callable[[str], Exception], shared: bool = False, label: str = ""
):
    """``flock`` ``path`` without waiting (shared or exclusive) and return its open file.

    Held elsewhere: ``refused(holder)`` is raised, ``holder`` being what the lock file says
    of its latest holders. An exclusive holder replaces the file's text with its own line;
    a shared one adds ``label`` and its line. A lock taken on a file that was unlinked
    meanwhile (an exclusive writer removes ``.lock`` when it closes) protects nothing, so
    it is taken again on the file now at ``path``."""
    since = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    me = f"{label}pid {os.getpid()} on {socket.gethostname()} since {since}"
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            lines = [line for line in handle.read().splitlines() if line.strip()]
            handle.close()
            raise refused("; ".join(lines[-3:]) or "another process") from None
        if same_file(handle, path):
            break
        handle.close()
    if not shared:
        handle.seek(0)
        handle.truncate()
    handle.write(f"{me}\n")
    handle.flush()
    return handle


def release(handle) -> None:
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()
