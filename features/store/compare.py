"""Two stores of the same samples compared field by field: how far apart their values are.

The same code on any x86-64 CPU writes the same bytes (DVC's hashes say so); a store made
on a GPU, or with another torch version, differs in the last bits of its floats.
:func:`compare_stores` gives, for every field and store-level array, how many values differ
at all, the largest absolute difference ``|a - b|``, the largest relative one
``|a - b| / |b|`` (B is the reference; infinite where ``b = 0 != a``) and whether every
value is within ``|a - b| <= atol + rtol * |b|`` (numpy's ``isclose``). NaN equals NaN.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from features.store.reader import Store
from features.store.spec import StoreError


@dataclass(frozen=True)
class FieldDiff:
    """How one field (or store-level array) of two stores differs."""

    name: str
    dtype: str
    values: int  # values compared
    differing: int  # values whose bytes differ
    max_abs: float  # largest |a - b|
    max_rel: float  # largest |a - b| / |b|
    within: bool  # every value within atol + rtol * |b|

    @property
    def identical(self) -> bool:
        return self.differing == 0

    def as_dict(self) -> dict:
        return {**asdict(self), "identical": self.identical}


def _diff(name: str, dtype: str, blocks, atol: float, rtol: float) -> FieldDiff:
    """The statistics of a field over ``blocks`` of ``(a, b)`` values."""
    values = differing = 0
    max_abs = max_rel = 0.0
    within = True
    for a, b in blocks:
        a, b = np.asarray(a), np.asarray(b)
        values += a.size
        if not a.size:
            continue
        width = a.dtype.itemsize
        raw = (a != b) if a.dtype.kind == "b" else a.view(f"u{width}") != b.view(f"u{width}")
        differing += int(raw.sum())
        x, y = a.astype(np.float64), b.astype(np.float64)
        same = (x == y) | (np.isnan(x) & np.isnan(y))  # equal values (0.0 and -0.0 too)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            diff = np.where(same, 0.0, np.abs(x - y))
            diff = np.where(np.isnan(diff), np.inf, diff)  # NaN against a number
            rel = np.where(diff == 0, 0.0, diff / np.abs(y))  # b = 0 != a: inf
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float(np.where(np.isnan(rel), np.inf, rel).max()))
        within &= bool((diff <= atol + rtol * np.abs(y)).all())
    return FieldDiff(name, dtype, values, differing, max_abs, max_rel, within)


def _check_comparable(a: Store, b: Store, fields: Sequence[str] | None) -> list[str]:
    """The fields to compare; a one-line :class:`StoreError` where the stores do not hold
    the same samples and fields."""
    if a.kind != b.kind:
        raise StoreError(
            f"{b.url}: a {b.kind} store, and {a.url} a {a.kind} store; compare two stores "
            "of one kind"
        )
    if len(a) != len(b) or not np.array_equal(a.keys, b.keys):
        keys_a, keys_b = a.keys, b.keys
        n = min(len(keys_a), len(keys_b))
        first = next((i for i in range(n) if keys_a[i] != keys_b[i]), n)
        what = (
            f"{len(a)} against {len(b)} samples"
            if first == n
            else f"sample {first} is {keys_a[first]!r} against {keys_b[first]!r}"
        )
        raise StoreError(
            f"{b.url}: not the samples of {a.url} ({what}); compare stores built from one "
            "manifest (vse store info shows each one's manifest digest)"
        )
    if not fields and sorted(a.fields) != sorted(b.fields):
        only = sorted(set(a.fields) ^ set(b.fields))
        raise StoreError(
            f"{b.url}: fields {only} are in one store only; name the ones to compare with --fields"
        )
    names = list(fields) if fields else sorted(a.fields)
    for name in names:
        missing = [s.url for s in (a, b) if name not in s.fields]
        if missing:
            raise StoreError(
                f"{missing[0]}: no field {name!r}; `vse store info` lists its fields "
                "(--fields picks the ones to compare)"
            )
        if a.fields[name] != b.fields[name]:
            sa, sb = a.fields[name], b.fields[name]
            raise StoreError(
                f"{b.url}: field {name!r} is {sb.dtype} {sb.shape}, in {a.url} {sa.dtype} "
                f"{sa.shape}; only fields of one shape and dtype compare"
            )
    return names


def _blocks(a: Store, b: Store, name: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The values of field ``name`` of both stores, a shard of samples at a time (a ragged
    field: its rows, once its row offsets are found equal)."""
    if a.fields[name].ragged:
        if not np.array_equal(a.offsets(name), b.offsets(name)):
            raise StoreError(
                f"{b.url}: field {name!r} holds other row counts per sample than in "
                f"{a.url}; its values do not pair up"
            )
    step = a.samples_per_shard
    for start in range(0, len(a), step):
        stop = min(start + step, len(a))
        x = a.read(start, stop, [name], copy=False)[name]
        y = b.read(start, stop, [name], copy=False)[name]
        if a.fields[name].ragged:
            dtype = np.dtype(a.fields[name].dtype)
            x = np.concatenate(x) if x else np.zeros(0, dtype)
            y = np.concatenate(y) if y else np.zeros(0, dtype)
        yield x, y


def compare_stores(
    a: Store,
    b: Store,
    atol: float = 0.0,
    rtol: float = 0.0,
    fields: Sequence[str] | None = None,
) -> list[FieldDiff]:
    """Every field of ``a`` and ``b`` (or those named), then their store-level arrays
    (named ``extra:<name>``), compared value by value (see the module docstring)."""
    names = _check_comparable(a, b, fields)
    out = [_diff(name, a.fields[name].dtype, _blocks(a, b, name), atol, rtol) for name in names]
    if fields:
        return out
    extras_a, extras_b = set(a.attrs.get("extras", {})), set(b.attrs.get("extras", {}))
    if extras_a != extras_b:
        raise StoreError(
            f"{b.url}: store-level arrays {sorted(extras_a ^ extras_b)} are in one store "
            "only; name the fields to compare with --fields"
        )
    for name in sorted(extras_a):
        x, y = a.extra(name), b.extra(name)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise StoreError(
                f"{b.url}: store-level array {name!r} is {y.dtype} {y.shape}, in {a.url} "
                f"{x.dtype} {x.shape}; only arrays of one shape and dtype compare"
            )
        out.append(_diff(f"extra:{name}", str(x.dtype), [(x, y)], atol, rtol))
    return out
