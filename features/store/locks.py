"""Writers' locks: who holds a store, and whether a lock file is still the one at its path."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def same_file(handle, path: Path) -> bool:
    """Whether an open file is still the one at ``path`` (not unlinked or replaced)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False
