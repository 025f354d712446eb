"""Global image features (stage ``global``): one vector per image, and its PCA projection.

The vector is the mean of a store's spatial features: of the grid store's conv5 map (its
``pooled`` field: VSE++'s fixed-CNN feature) or of the valid regions of a regions store
(for features imported from precomp folders or bottom-up-attention TSVs, so VSE++ and
HUSE train from them too). ``projected`` is a PCA of it fitted on the train split only
(HUSE's 64-d stand-in for its Graph-RISE embedding); the PCA mean and axes are kept in
the store (``extra("pca_mean")``, ``extra("pca_axes")``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import Field

from features.ingest.manifest import Manifest
from features.store.reader import Store
from features.store.spec import FieldSpec, Provenance, StoreConfig
from features.store.writer import StoreWriter
from infra.config import ConfigError, Section

VERSION = "1"


class GlobalConfig(Section):
    """``global`` section of params.yaml."""

    projection_dim: int = Field(64, ge=0)  # 0: no projection


def fit_pca(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and top-``dim`` principal axes (dim, D) of the rows of ``x``, with signs
    fixed (largest-magnitude loading positive) so that refits give the same projection."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=0)
    cov = np.cov(x - mean, rowvar=False) if len(x) > 1 else np.zeros((x.shape[1],) * 2)
    values, vectors = np.linalg.eigh(cov)
    axes = vectors[:, np.argsort(values)[::-1][:dim]].T
    signs = np.sign(axes[np.arange(len(axes)), np.abs(axes).argmax(axis=1)])
    return mean, axes * signs[:, None]  # a unit vector's largest loading is never 0


def project(x: np.ndarray, mean: np.ndarray, axes: np.ndarray) -> np.ndarray:
    return ((np.asarray(x, dtype=np.float64) - mean) @ axes.T).astype(np.float32)


def pooled_features(source: Store) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) float32 global vectors of a grid or regions store, and (N,) validity: a
    grid's pooled conv5 feature, or the mean of an image's valid regions."""
    if source.kind == "grid":
        data = source.read(0, len(source), ["pooled", "valid"])
        return data["pooled"].astype(np.float32), data["valid"].astype(bool)
    if source.kind != "regions":
        raise ConfigError(
            f"{source.url}: a {source.kind} store; global features come from "
            "a grid or a regions store"
        )
    names = ["features", "n_regions", *(["valid"] if "valid" in source.fields else [])]
    out, valid = [], []
    step = source.samples_per_shard
    for start in range(0, len(source), step):  # a shard at a time: regions stores are large
        data = source.read(start, min(start + step, len(source)), names, copy=False)
        counts = data["n_regions"].astype(np.int64)
        keep = np.arange(data["features"].shape[1])[None, :] < counts[:, None]  # (B, R)
        sums = np.einsum("br,brd->bd", keep.astype(np.float32), data["features"], dtype=np.float32)
        # numpy makes float32 sums over int64 counts float64: the vectors stay float32
        out.append((sums / np.maximum(counts, 1)[:, None]).astype(np.float32))
        ok = counts > 0
        if "valid" in data:
            ok &= data["valid"].astype(bool)
        valid.append(ok)
    return np.concatenate(out), np.concatenate(valid)


def extract_global(
    source_path: Path,
    manifest: Manifest,
    store_path: Path,
    projection_dim: int,
    store_cfg: StoreConfig,
    log: Callable[[str], None] = print,
) -> Store:
    """Stage ``global``: ``features`` (N, D) from the grid or regions store at
    ``source_path`` and, if ``projection_dim``, ``projected`` (N, dim) by a PCA fitted on
    the valid train images. Invalid images (unreadable, no regions) get zeros."""
    source = Store.open(source_path, manifest_digest=manifest.digest)
    features, valid = pooled_features(source)
    train = np.asarray(manifest.table["split"].to_pylist()) == "train"
    fields = {
        "features": FieldSpec((features.shape[1],), "float32"),
        "valid": FieldSpec((), "uint8"),
    }
    if projection_dim:
        if projection_dim > features.shape[1] or (train & valid).sum() < 2:
            raise ConfigError(
                f"global.projection_dim {projection_dim}: needs at least 2 valid "
                f"train images and at most {features.shape[1]} dimensions"
            )
        mean, axes = fit_pca(features[train & valid], projection_dim)
        projected = project(features, mean, axes)
        projected[~valid] = 0
        fields["projected"] = FieldSpec((projection_dim,), "float32")
    provenance = Provenance(
        f"global-{source.kind}-pca",
        VERSION,
        {"projection_dim": projection_dim},
        source.fingerprint,
        manifest.digest,
    )
    keys = manifest.table["key"].to_pylist()
    with StoreWriter(store_path, "global", fields, keys, provenance, store_cfg, log=log) as w:
        if projection_dim:
            w.write_extra("pca_mean", mean.astype(np.float32))
            w.write_extra("pca_axes", axes.astype(np.float32))
        for shard in w.pending_shards():
            lo, hi = w.shard_range(shard)
            data = {"features": features[lo:hi], "valid": valid[lo:hi].astype(np.uint8)}
            if projection_dim:
                data["projected"] = projected[lo:hi]
            w.write_shard(shard, data)
    return Store.open(store_path)
