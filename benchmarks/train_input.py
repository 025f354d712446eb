"""Ready training batches per second at COCO-like scale, against baselines, in one run.

Generates a synthetic split under a temp folder (removed at the end): N images x 36 x 2048
float16 region features with 5 captions each (word ids, and 768-d float16 BERT-like
token features of 10..19 tokens), as feature stores, as the precomp layout of the
reference implementations (``train_ims.npy`` + per-caption arrays), and as WebDataset
shards built from the stores (``vse shards build``'s code). Then, for MV-VSE's inputs
(regions + word ids) and CAMERA's (regions + boxes + token features), at batch 128,
times batches that are ready for the model (float32 tensors, captions padded):

- numpy memmap gather + float32 + padding (the baseline): ``ims[sorted batch]``,
  ``astype(float32)``, captions padded in numpy;
- the reference design (vse_infty's ``PrecompRegionDataset``): a map-style Dataset, one
  ``torch.Tensor(ims[i])`` per item, a collate_fn that stacks and pads; DataLoader with
  0 and 2 workers;
- this project's path (``models.data.batches.Batches`` over ``models.data.PairData``):
  built in the loop, by a thread, by its pool of 2 worker processes, and the same builder
  in torch's DataLoader with 2 workers (issue 22: the pool stays only if >= 1.2x faster);
- streaming the WebDataset shards (``models.data.ShardData``), in the loop and 2 workers.

Readers alternate over ``--rounds`` timed passes after a warm-up pass each (warm page
cache); the best pass counts. Targets (issue 16): ours in one process >= 0.8x the
baseline and >= 2x the reference; with 2 workers >= 1.5x its own one-process figure;
WebDataset streaming >= 0.5x the memmap gather alone.

    python benchmarks/train_input.py [--images 8192] [--batch 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from store_read import measure  # benchmarks/ is on the path when run as a script
from torch.utils.data import DataLoader, Dataset

from features.ingest.manifest import Dataset as Records
from features.ingest.manifest import Record, read_manifest, write_manifest
from features.shards.writer import ShardsConfig, build_shards
from features.store.reader import Store
from features.store.spec import FieldSpec, Provenance, StoreConfig, regions_fields
from features.store.writer import StoreWriter
from models.common import TrainConfig
from models.data.arrays import finish
from models.data.batches import WORKER_CONTEXT, Batches, Stream, build
from models.data.info import FeaturePaths
from models.data.pairs import PairData
from models.data.shards import ShardData
from models.train import epoch_batches

R, D, TOKEN_DIM, CAPTIONS, VOCAB = 36, 2048, 768, 5, 10000


# --------------------------------------------------------------------------- data


def generate(root: Path, n: int, log=print, baselines: bool = True) -> FeaturePaths:
    """The synthetic split in every layout (see the module docstring); ``baselines``
    False: the feature stores alone (no precomp files, no WebDataset shards)."""
    rng = np.random.default_rng(0)
    keys = [f"img{i:06d}" for i in range(n)]
    records = [
        Record(k, f"{k}.jpg", "train", [f"a caption {j}" for j in range(CAPTIONS)]) for k in keys
    ]
    write_manifest(records, Records("bench", records), CAPTIONS, root / "manifest.parquet")
    manifest = read_manifest(root / "manifest.parquet")
    provenance = Provenance("bench", "1", {}, None, manifest.digest)
    layout = StoreConfig()
    ims = tokens = None  # the precomp layout's arrays (with the baselines)
    if baselines:
        ims = np.lib.format.open_memmap(root / "train_ims.npy", "w+", np.float16, (n, R, D))
    start = time.perf_counter()
    with StoreWriter(
        root / "regions.zarr",
        "regions",
        regions_fields(R, D),
        keys,
        provenance,
        layout,
        log=lambda m: None,
    ) as writer:
        for shard in writer.pending_shards():
            a, b = writer.shard_range(shard)
            block = rng.standard_normal((b - a, R, D), dtype=np.float32).astype(np.float16)
            if ims is not None:
                ims[a:b] = block
            corners = np.sort(rng.uniform(0, 600, (b - a, R, 2, 2)), axis=2)
            writer.write_shard(
                shard,
                {
                    "features": block,
                    "boxes": corners.reshape(b - a, R, 4),
                    "n_regions": np.full(b - a, R),
                    "image_hw": np.tile([480, 640], (b - a, 1)),
                },
            )
    if ims is not None:
        ims.flush()
    del ims
    m = n * CAPTIONS
    lengths = rng.integers(10, 20, m)  # words; + <start>, <end>
    words = [rng.integers(4, VOCAB, k + 2).astype(np.int32) for k in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if baselines:
        tokens = np.lib.format.open_memmap(
            root / "train_tokens.npy", "w+", np.float16, (int(offsets[-1]), TOKEN_DIM)
        )
    caption_keys = [f"{k}#{j}" for k in keys for j in range(CAPTIONS)]
    fields = {
        "word_ids": FieldSpec((), "int32", ragged=True),
        "features": FieldSpec((TOKEN_DIM,), "float16", ragged=True),
    }
    with StoreWriter(
        root / "text.zarr", "text", fields, caption_keys, provenance, layout, log=lambda m: None
    ) as writer:
        for shard in writer.pending_shards():
            a, b = writer.shard_range(shard)
            flat = rng.standard_normal((offsets[b] - offsets[a], TOKEN_DIM), dtype=np.float32)
            flat = flat.astype(np.float16)
            if tokens is not None:
                tokens[offsets[a] : offsets[b]] = flat
            cuts = offsets[a : b + 1] - offsets[a]
            writer.write_shard(
                shard,
                {
                    "word_ids": words[a:b],
                    "features": [flat[x:y] for x, y in zip(cuts[:-1], cuts[1:], strict=True)],
                },
            )
    if tokens is not None:
        tokens.flush()
    del tokens
    vocab = {"words": ["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]}
    log(f"generated {n} images, {m} captions in {time.perf_counter() - start:.0f} s")
    if baselines:
        np.save(root / "train_token_offsets.npy", offsets)
        np.save(root / "train_word_offsets.npy", np.concatenate([[0], np.cumsum(lengths + 2)]))
        np.save(root / "train_words.npy", np.concatenate(words))
        start = time.perf_counter()
        stores = {"regions": Store.open(root / "regions.zarr")}
        text = Store.open(root / "text.zarr")
        build_shards(manifest, stores, root / "shards", ShardsConfig(), text=text)
        log(f"built the WebDataset shards in {time.perf_counter() - start:.0f} s")
    (root / "vocab.json").write_text(json.dumps({**vocab, "tfidf_terms": []}))  # last: done
    return FeaturePaths(
        manifest=root / "manifest.parquet",
        regions=root / "regions.zarr",
        text=root / "text.zarr",
        vocab=root / "vocab.json",
    )


# --------------------------------------------------------------------------- baselines


class Precomp:
    """The precomp layout, memory-mapped (opened lazily: once per DataLoader worker)."""

    def __init__(self, root: Path, text: str):
        self.root, self.text = root, text
        self.n_captions = len(np.load(root / "train_token_offsets.npy")) - 1

    def open(self):
        if not hasattr(self, "ims"):
            self.ims = np.load(self.root / "train_ims.npy", mmap_mode="r")
            if self.text == "words":
                self.flat = np.load(self.root / "train_words.npy")
                self.offsets = np.load(self.root / "train_word_offsets.npy")
            else:
                self.flat = np.load(self.root / "train_tokens.npy", mmap_mode="r")
                self.offsets = np.load(self.root / "train_token_offsets.npy")
        return self


def memmap_batch(data: Precomp, captions: np.ndarray) -> dict:
    """The baseline: one sorted fancy-indexed gather, float32, captions padded in numpy."""
    data.open()
    captions = np.sort(captions)
    images = torch.from_numpy(data.ims[captions // CAPTIONS].astype(np.float32))
    pieces = [data.flat[data.offsets[c] : data.offsets[c + 1]] for c in captions]
    lengths = np.array([len(p) for p in pieces])
    padded = np.zeros((len(pieces), lengths.max(), *pieces[0].shape[1:]), np.float32)
    for b, piece in enumerate(pieces):
        padded[b, : len(piece)] = piece
    return {"regions": images, "text": torch.from_numpy(padded), "lengths": lengths}


class PrecompRegionDataset(Dataset):
    """vse_infty's design: one item per caption, its image read and converted per item."""

    def __init__(self, data: Precomp):
        self.data = data

    def __len__(self) -> int:
        return self.data.n_captions

    def __getitem__(self, index: int):
        data = self.data.open()
        image = torch.Tensor(data.ims[index // CAPTIONS])  # (R, D) float32
        piece = data.flat[data.offsets[index] : data.offsets[index + 1]]
        target = torch.Tensor(piece) if data.text == "tokens" else torch.from_numpy(piece).long()
        return image, target, index


def collate_fn(items):
    """vse_infty's collate: sort by caption length, stack images, pad captions."""
    items.sort(key=lambda x: len(x[1]), reverse=True)
    images, captions, ids = zip(*items, strict=True)
    images = torch.stack(images, 0)
    lengths = [len(c) for c in captions]
    targets = torch.zeros(len(captions), max(lengths), *captions[0].shape[1:])
    if captions[0].dtype == torch.long:
        targets = targets.long()
    for i, cap in enumerate(captions):
        targets[i, : lengths[i]] = cap
    return images, torch.tensor([R] * len(images)), targets, torch.tensor(lengths), ids


# --------------------------------------------------------------------------- DataLoader


class SharedAlloc:
    """The ``alloc`` of a build in a DataLoader worker: every array a view of a fresh
    shared-memory tensor, so the batch crosses to the training process without a copy."""

    def __init__(self):
        self.made: dict[int, torch.Tensor] = {}

    def __call__(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        like = torch.from_numpy(np.empty(0, dtype)).dtype
        storage = torch.UntypedStorage._new_shared(nbytes)
        tensor = torch.empty(0, dtype=like).set_(storage, 0, shape)
        self.made[tensor.data_ptr()] = tensor
        return tensor.numpy()

    def adopt(self, batch: dict) -> dict:
        return batch

    def tensors(self, batch: dict) -> dict:
        out = {}
        for key, value in batch.items():
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(np.ascontiguousarray(value))
            made = self.made.get(value.data_ptr()) if torch.is_tensor(value) else None
            same = made is not None and made.shape == value.shape and made.dtype == value.dtype
            out[key] = made if same else value
        return out


class Builds(Dataset):
    """Item ``(kind, index)`` (from the sampler) -> the batch the project's builder makes
    of it, finished (float32, standardised) in the worker, as shared-memory tensors."""

    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return 0

    def __getitem__(self, item):
        alloc = SharedAlloc()
        raw = alloc.tensors(build(self.source, item[0], item[1], alloc))
        return alloc.tensors(finish(raw, self.source.stats, alloc=alloc))


class Items:
    """The sampler: the (kind, index) tasks of the pass."""

    def __init__(self, tasks):
        self.tasks = tasks

    def __iter__(self):
        return iter(self.tasks)


def as_is(item):
    return item


def one_thread(_worker: int) -> None:
    torch.set_num_threads(1)


def builder_loader(data, tasks, workers: int, prefetch: int):
    """torch's DataLoader around the project's vectorised batch builder (the issue-22
    alternative to :class:`Batches`' worker pool): ``batch_size=None``, one task per
    item, ``prefetch_factor``, ``persistent_workers``, spawned workers as the pool's."""
    loader = DataLoader(
        Builds(data),
        batch_size=None,
        sampler=Items(tasks),
        num_workers=workers,
        collate_fn=as_is,
        pin_memory=torch.cuda.is_available(),
        prefetch_factor=prefetch,
        persistent_workers=True,
        multiprocessing_context=WORKER_CONTEXT,
        worker_init_fn=one_thread,
    )

    def read() -> int:
        return sum(len(b["regions"]) for b in loader)

    return read


# --------------------------------------------------------------------------- timing


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=40, help="batches per timed pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="keep the data in this folder (reused)")
    parser.add_argument("--models", default="mvvse,camera")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="vse-train-input-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"{load()} at start, {os.cpu_count()} CPUs")
    try:
        if not (root / "vocab.json").exists():
            paths = generate(root, args.images)
        else:
            paths = FeaturePaths(
                manifest=root / "manifest.parquet",
                regions=root / "regions.zarr",
                text=root / "text.zarr",
                vocab=root / "vocab.json",
            )
        for model in args.models.split(","):
            run_model(model, paths, root, args)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def run_model(model: str, paths: FeaturePaths, root: Path, args) -> None:
    text = "words" if model == "mvvse" else "tokens"
    inputs = frozenset({"regions", text})
    data = PairData(paths, "train", inputs)
    precomp = Precomp(root, text)
    batch, k = args.batch, args.batches
    order = epoch_batches(len(data), batch, 0, 0, 0, 1)[:k]
    tasks = [("pair", c) for c in order]
    samples = k * batch

    def baseline() -> int:
        for captions in order:
            memmap_batch(precomp, captions)
        return samples

    def gather_only() -> int:  # the memmap gather alone (float16), for WebDataset's target
        ims = precomp.open().ims
        for captions in order:
            np.ascontiguousarray(ims[np.sort(captions) // CAPTIONS])
        return samples

    def reference(workers: int):
        loader = DataLoader(
            PrecompRegionDataset(precomp),
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            collate_fn=collate_fn,
            persistent_workers=bool(workers),
            generator=torch.Generator().manual_seed(0),
        )

        def read() -> int:
            n = 0
            for i, b in enumerate(loader):
                n += len(b[0])
                if i + 1 == k:
                    break
            return n

        return read

    streams = {}

    def ours(workers: int, prefetch: int):
        streams[(workers, prefetch)] = Batches(data, "cpu", num_workers=workers, prefetch=prefetch)

        def read() -> int:
            return sum(len(b["regions"]) for b in streams[(workers, prefetch)].run(tasks))

        return read

    def shards(workers: int):
        cfg = TrainConfig(batch_size=batch, num_workers=workers, shuffle_buffer=8192)
        source = ShardData(str(root / "shards"), data, cfg)
        streams[("shards", workers)] = Batches(
            source, "cpu", num_workers=workers, prefetch=2 if workers else 0
        )
        passes = [0]

        def read() -> int:
            passes[0] += 1  # another epoch: another shard order
            stream = Stream((passes[0], 0, 1), k)
            return sum(len(b["regions"]) for b in streams[("shards", workers)].run(stream))

        return read

    readers = {
        "memmap gather + float32 + padding (baseline)": baseline,
        "memmap gather only, float16": gather_only,
        "reference: map-style Dataset, DataLoader 0 workers": reference(0),
        "reference: map-style Dataset, DataLoader 2 workers": reference(2),
        "ours, built in the loop (one process)": ours(0, 0),
        "ours, built by a thread (one process)": ours(0, 2),
        "ours, 2 workers (process pool)": ours(2, 2),
        "ours, 2 workers (DataLoader)": builder_loader(data, tasks, 2, 2),
        "ours from WebDataset shards, in the loop (one process)": shards(0),
        "ours from WebDataset shards, 2 workers": shards(2),
    }
    print(f"\n{model}: regions + {text}, batch {batch}, {k} batches per pass, {load()}")
    results = measure(readers, args.rounds, log=print)
    for stream in streams.values():
        stream.close()
    base = results["memmap gather + float32 + padding (baseline)"]
    ref0 = results["reference: map-style Dataset, DataLoader 0 workers"]
    print(f"{'reader':<56}{'samples/s':>10}{'x baseline':>12}{'x ref (0 w)':>12}")
    for name, rate in results.items():
        print(f"{name:<56}{rate:>10.0f}{rate / base:>12.2f}{rate / ref0:>12.2f}")
    one = results["ours, built in the loop (one process)"]
    two = results["ours, 2 workers (process pool)"]
    loader = results["ours, 2 workers (DataLoader)"]
    ref2 = results["reference: map-style Dataset, DataLoader 2 workers"]
    wds = results["ours from WebDataset shards, in the loop (one process)"]
    gather = results["memmap gather only, float16"]
    print(
        f"targets: one process / baseline {one / base:.2f} (>= 0.8), / reference "
        f"{one / ref0:.2f} (>= 2); 2 workers / reference 2 workers {two / ref2:.2f} (>= 2); "
        f"2 workers / one process {two / one:.2f} (>= 1.5); process pool / DataLoader "
        f"(2 workers) {two / loader:.2f} (pool kept if >= 1.2); WebDataset / stores (one "
        f"process) {wds / one:.2f}, / baseline {wds / base:.2f}, / memmap gather alone "
        f"{wds / gather:.2f} (>= 0.5 on equal terms: benchmarks/store_read.py); {load()}"
    )


if __name__ == "__main__":
    main()
