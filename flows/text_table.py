"""Plain-text tables for the commands that print one (``vse store ls``, ``vse store
compare``, ``vse exp``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def text_table(header: Sequence, rows: Iterable[Sequence]) -> str:
    """``header`` and ``rows`` (sequences of cells, turned to text) as lines of columns
    padded to their widest cell, two spaces apart, trailing spaces dropped."""
    table = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(c) for c in col) for col in zip(*table, strict=True)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )
