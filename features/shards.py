"""WebDataset shards: per-split training samples packed from the manifest and the stores.

The only code that knows the shard layout. Each sample (one image) holds::

    __key__                    image key, with '.' replaced (WebDataset splits names at dots)
    meta.json                  {"key", "captions", "label", "gt_names"}: the manifest row,
                               and per caption "word_ids", "wordpiece_ids" (text store) and
                               "scene_graphs" when those are packed
    gt_boxes.npy               ground-truth boxes (datasets with boxes)
    <store>.<field>.npy        each field of each packed store, e.g. regions.features.npy

Few members per sample (tar parsing is per member) and standard ``.npy`` members, so any
WebDataset reader can use the shards; :func:`stream` reads only the members it is asked for.

Shards are ``{split}-{index:06d}.tar`` with fixed tar mtimes (identical inputs give identical
bytes, so DVC caches them), and ``sizes.json`` maps each shard name to its sample count.
The folder is built aside and moved into place whole (``sizes.json`` written last), so it
is at every moment the old folder, absent, or the new one: never a ``sizes.json`` that
lists deleted or half-written tars.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import Field

from features.config import Section
from features.ingest import SPLITS, Manifest
from features.store import Store, StoreError, join_by_key

if TYPE_CHECKING:
    import webdataset as wds

# torch and webdataset are imported where they are used: the `vse` CLI imports this
# module for its config and should start fast.

SIZES = "sizes.json"


class ShardsConfig(Section):
    """``shards`` section of params.yaml."""

    samples_per_shard: int = Field(1000, ge=1)


BLOCK = 256  # manifest rows read from the stores at a time


def shard_names(sizes: Mapping[str, int], split: str) -> list[str]:
    return sorted(name for name in sizes if name.startswith(f"{split}-"))


def _safe_key(key: str) -> str:
    return re.sub(r"[.\s]", "_", key)


def build_shards(
    manifest: Manifest,
    stores: Mapping[str, Store],
    out_dir: Path,
    samples_per_shard: int = 1000,
    progress: Callable[[Iterable], Iterable] | None = None,
    text: Store | None = None,
    scene_graphs: Mapping[str, dict] | None = None,
) -> dict[str, int]:
    """Write every split's shards and ``sizes.json`` into ``out_dir``; returns the sizes.

    ``stores`` are image-level (one row per manifest image). ``text`` is the caption-level
    text store, whose token ids (``word_ids``, ``wordpiece_ids``) go into each image's
    ``meta.json`` per caption, as do ``scene_graphs`` (caption key -> graph)."""
    from features.files import atomic_path

    for name, store in {**stores, **({"text": text} if text else {})}.items():
        if store.manifest_digest != manifest.digest:
            raise StoreError(
                f"store {name!r} ({store.url}) was built from manifest "
                f"{store.manifest_digest[:12]}, not from this one ({manifest.digest[:12]}); "
                "rebuild it (dvc repro)"
            )
    out_dir = Path(out_dir)
    if out_dir.exists() and not _is_shards_folder(out_dir):
        raise StoreError(
            f"{out_dir} exists and is not a shards folder (no {SIZES}, or files other than "
            "shards); remove it or choose another --out"
        )
    with atomic_path(out_dir, directory=True) as tmp:
        sizes = _write_shards(
            manifest, stores, tmp, samples_per_shard, progress, text, scene_graphs
        )
        (tmp / SIZES).write_text(json.dumps(sizes, indent=1, sort_keys=True) + "\n")  # last
    return sizes


def _is_shards_folder(folder: Path) -> bool:
    """A folder ``build_shards`` made (and may replace): only tars and ``sizes.json``."""
    if not folder.is_dir():
        return False
    names = {p.name for p in folder.iterdir()}
    return not names or (SIZES in names and all(n == SIZES or n.endswith(".tar") for n in names))


def _write_shards(manifest, stores, out_dir, samples_per_shard, progress, text, scene_graphs):
    import webdataset as wds

    rows = manifest.table.to_pylist()
    sizes: dict[str, int] = {}
    for split in SPLITS:
        split_rows = [r for r in rows if r["split"] == split]
        if not split_rows:
            continue
        pattern = str(out_dir / f"{split}-%06d.tar")
        with wds.ShardWriter(pattern, maxcount=samples_per_shard, mtime=0, verbose=0) as sink:
            blocks = range(0, len(split_rows), BLOCK)
            for start in progress(blocks) if progress else blocks:
                block = split_rows[start : start + BLOCK]
                features = _read_stores(stores, [r["key"] for r in block])
                tokens = _caption_tokens(text, block)
                for i, row in enumerate(block):
                    extra = {k: v[i] for k, v in tokens.items()}
                    if scene_graphs is not None:
                        extra["scene_graphs"] = [
                            scene_graphs.get(f"{row['key']}#{j}")
                            for j in range(len(row["captions"]))
                        ]
                    sink.write(_sample(row, {k: v[i] for k, v in features.items()}, extra))
        n = len(split_rows)  # ShardWriter fills each shard to maxcount before the next
        for k in range(-(-n // samples_per_shard)):
            sizes[f"{split}-{k:06d}.tar"] = min(samples_per_shard, n - k * samples_per_shard)
    return sizes


def read_scene_graphs(folder: Path) -> dict[str, dict]:
    """Scene graphs of a scene-graph folder by caption key (without the caption text)."""
    from features.scenegraph_files import read_graph_rows

    rows = read_graph_rows(folder)
    return {r.pop("key"): {k: v for k, v in r.items() if k != "caption"} for r in rows}


def _read_stores(stores: Mapping[str, Store], keys: list[str]) -> dict[str, list]:
    """``{"<store>.<field>": per-sample values}`` for the given image keys."""
    out = {}
    rows = join_by_key(stores, keys) if stores else {}
    for name, store in stores.items():
        data = store.read_indices(rows[name])
        for field, values in data.items():
            out[f"{name}.{field}"] = list(values)
    return out


def _caption_tokens(text: Store | None, block: list[dict]) -> dict[str, list]:
    """Per image of ``block``, per caption, the token ids of the text store."""
    if text is None:
        return {}
    keys = [f"{r['key']}#{j}" for r in block for j in range(len(r["captions"]))]
    data = text.read_indices([text.index(k) for k in keys], ["word_ids", "wordpiece_ids"])
    out: dict[str, list] = {"word_ids": [], "wordpiece_ids": []}
    start = 0
    for row in block:
        n = len(row["captions"])
        for name in out:
            out[name].append([v.tolist() for v in data[name][start : start + n]])
        start += n
    return out


def _sample(row: dict, features: dict, extra: dict | None = None) -> dict:
    meta = {
        "key": row["key"],
        "captions": row["captions"],
        "label": row["label"],
        "gt_names": row["box_names"],
        **(extra or {}),
    }
    sample = {"__key__": _safe_key(row["key"]), "meta.json": json.dumps(meta)}
    if row["boxes"] is not None:
        sample["gt_boxes.npy"] = np.asarray(row["boxes"], dtype=np.float32)
    for name, value in features.items():
        sample[f"{name}.npy"] = np.asarray(value)
    return sample


def read_sizes(shard_dir: str | Path) -> dict[str, int]:
    path = Path(shard_dir) / SIZES
    try:
        sizes = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; build the shards with `vse shards build`") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise StoreError(f"{path}: damaged ({err}); rebuild with `vse shards build`") from None
    if not isinstance(sizes, dict) or not all(isinstance(v, int) for v in sizes.values()):
        raise StoreError(f"{path}: not shard sizes; rebuild with `vse shards build`")
    return sizes


# --------------------------------------------------------------------------- streaming


_NPY_HEADER = re.compile(
    rb"\{'descr': '([<>|][a-z]\d+)', 'fortran_order': False, 'shape': \(([\d, ]*)\), \}"
)


def decode_npy(data: bytes) -> np.ndarray:
    """``.npy`` bytes -> array without copying the data (numpy's own reader parses the
    header with ``ast`` and copies; this is the hot path of streaming)."""
    if data[:6] == b"\x93NUMPY" and data[6] == 1:
        header_len = int.from_bytes(data[8:10], "little")
        match = _NPY_HEADER.match(data[10 : 10 + header_len])
        if match:
            shape = tuple(int(d) for d in match.group(2).split(b",") if d.strip())
            return np.frombuffer(
                data, np.dtype(match.group(1).decode()), offset=10 + header_len
            ).reshape(shape)
    import io

    return np.load(io.BytesIO(data))


class ToDict:
    """Raw WebDataset sample -> dict of the manifest row and the decoded arrays (picklable)."""

    def __call__(self, sample: dict) -> dict:
        out = json.loads(sample["meta.json"])
        if out["label"] is None:
            del out["label"]
        for name, value in sample.items():
            if name.endswith(".npy"):
                out[name[: -len(".npy")]] = decode_npy(value)
        return out


class SelectFiles:
    """Which tar members to read: the metadata and the requested fields (picklable)."""

    def __init__(self, fields: list[str] | None):
        self.keep = None if fields is None else {"meta.json", *(f"{f}.npy" for f in fields)}

    def __call__(self, name: str) -> bool:
        return self.keep is None or name.split(".", 1)[-1] in self.keep


class Collate:
    """List of sample dicts -> batch dict: arrays stacked as tensors (padded, with
    ``<name>_lengths``, where lengths differ, e.g. ground-truth boxes), text kept as lists."""

    def __call__(self, samples: list[dict]) -> dict:
        import torch

        from features.loader import pad_stack

        batch: dict = {}
        for name in samples[0]:
            values = [s[name] for s in samples]
            if isinstance(values[0], np.ndarray):
                if len({v.shape for v in values}) == 1:
                    batch[name] = torch.from_numpy(np.stack(values))
                else:
                    batch[name], batch[f"{name}_lengths"] = pad_stack(values)
            elif name == "label":
                batch[name] = torch.tensor(values)
            else:
                batch[name] = values
        return batch


def stream(
    shard_dir: str | Path,
    split: str,
    batch_size: int,
    *,
    fields: list[str] | None = None,
    shuffle_buffer: int = 1000,
    seed: int = 0,
    resampled: bool = False,
    batches_per_epoch: int | None = None,
) -> wds.DataPipeline:
    """A streaming loader over one split's shards (use in ``DataLoader(batch_size=None)``).

    Without ``resampled``, shards are shuffled per epoch and split across nodes (DDP
    ranks) and DataLoader workers, so each sample is read once per epoch. With
    ``resampled`` (multi-node training), each worker draws shards with replacement and
    ``batches_per_epoch`` (per worker) keeps batch counts equal on every rank.
    """
    import webdataset as wds

    sizes = read_sizes(shard_dir)
    urls = [str(Path(shard_dir) / name) for name in shard_names(sizes, split)]
    if not urls:
        raise StoreError(f"{shard_dir}: no shards for split {split!r}")
    if resampled:
        stages = [wds.ResampledShards(urls, seed=seed, deterministic=True)]
    else:
        stages = [
            wds.SimpleShardList(urls),
            wds.detshuffle(bufsize=len(urls), initial=len(urls), seed=seed),  # shard order
            wds.split_by_node,  # this rank's shards ...
            wds.split_by_worker,  # ... and this worker's
        ]
    stages += [
        # at this point we have shard URLs; read only the members asked for
        wds.tarfile_to_samples(select_files=SelectFiles(fields)),
        # at this point we have raw samples: {"__key__": ..., "meta.json": b"...", ...}
        wds.shuffle(shuffle_buffer, initial=min(shuffle_buffer, 100)),
        wds.map(ToDict()),  # -> {"key", "captions", "label", "<store>.<field>": ndarray}
        wds.batched(batch_size, collation_fn=Collate(), partial=not resampled),
    ]
    pipeline = wds.DataPipeline(*stages)
    if batches_per_epoch is not None:
        pipeline = pipeline.with_epoch(batches_per_epoch)
    return pipeline
