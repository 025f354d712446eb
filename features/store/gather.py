"""Vectorised gathers: rows of several arrays laid end to end copied into one batch, and
ragged samples zero-padded, with one copy per array touched (used by the store reader and
by the shards reader)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


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
