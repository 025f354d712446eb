"""The training loop's data path under load, in one run: overlap and epoch-time scaling.

1. Overlap. A small model whose optimizer step costs about as much as building a batch
   (calibrated in the run: its width is picked so), trained on batches of a synthetic
   regions + word-ids store (N images x 36 x 2048 float16, 5 captions each), through
   ``models.batches.Batches`` (built by a thread, by 1 worker process, or in the loop),
   against the same loop on pre-built batches held in memory. Target (issue 16): >= 0.9x
   the pre-built throughput.
2. Epoch time against dataset size. MV-VSE with the demo's params (``params.yaml``)
   trained by ``models.train.train`` (the stage's loop: standardised features, thread
   prefetch) on demo-shaped stores (10 regions x 512, 5 captions) of 1x, 2x and 4x the
   demo's 600 train images; the second epoch's training time (validation excluded) is
   fitted as ``t ~ size^k``. Target: linear (k ~ 1).

Synthetic data under a temp folder, removed at the end.

    python benchmarks/train_loop.py [--images 2048] [--batch 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn
from train_input import generate, load

from features.ingest.manifest import Dataset as Records
from features.ingest.manifest import Record, read_manifest, write_manifest
from features.store.spec import FieldSpec, Provenance, StoreConfig, regions_fields
from features.store.writer import StoreWriter
from models.common import TrainConfig, hinge_triplet, l2norm
from models.data.batches import Batches
from models.data.info import FeaturePaths
from models.data.pairs import PairData
from models.mvvse import MVVSEConfig
from models.train import epoch_batches, train

REPO = Path(__file__).resolve().parent.parent


class Small(nn.Module):
    """Mean region -> MLP of ``width``; masked mean word embedding -> linear; the VSE++
    MH hinge over the batch. Its step reads the whole batch, like a real model's."""

    def __init__(self, width: int, vocab: int = 10000):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(2048, width), nn.ReLU(), nn.Linear(width, 256))
        self.embed = nn.Embedding(vocab, 256, padding_idx=0)
        self.text = nn.Linear(256, 256)

    def loss(self, batch: dict) -> torch.Tensor:
        img = l2norm(self.image(batch["regions"].mean(1)))  # (B, 256)
        words = batch["words"]  # (B, L)
        mask = (torch.arange(words.shape[1])[None, :] < batch["word_lengths"][:, None]).float()
        mean = (self.embed(words) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        txt = l2norm(self.text(mean))  # (B, 256)
        return hinge_triplet(img @ txt.t(), 0.2, True)


def steps_per_second(model, optimizer, batches) -> float:
    start, n = time.perf_counter(), 0
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        model.loss(batch).backward()
        optimizer.step()
        n += 1
    return n / (time.perf_counter() - start)


def overlap(root: Path, args) -> None:
    paths = FeaturePaths(
        manifest=root / "manifest.parquet",
        regions=root / "regions.zarr",
        text=root / "text.zarr",
        vocab=root / "vocab.json",
    )
    data = PairData(paths, "train", frozenset({"regions", "words"}))
    k = args.batches
    tasks = [("pair", c) for c in epoch_batches(len(data), args.batch, 0, 0, 0, 1)[:k]]
    with Batches(data, "cpu", prefetch=0) as here:
        for _ in here.run(tasks):  # warm: every shard file mapped once
            pass
        start = time.perf_counter()
        for _ in here.run(tasks):
            pass
        build = (time.perf_counter() - start) / k
        prebuilt = [{key: v.clone() for key, v in b.items()} for b in here.run(tasks)]
    # the width whose step costs about one batch build
    torch.manual_seed(0)
    chosen, step = None, 0.0
    for width in (16, 64, 256, 512, 1024, 2048, 4096, 8192):
        model = Small(width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps_per_second(model, optimizer, prebuilt[:3])
        step = 1 / steps_per_second(model, optimizer, prebuilt[:10])
        chosen = width
        if step >= build:
            break
    print(
        f"\noverlap: batch {args.batch}, building a batch {build * 1e3:.1f} ms, a step of the "
        f"small model (width {chosen}) {step * 1e3:.1f} ms, {k} steps per pass, {load()}"
    )
    model = Small(chosen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loops = {
        "pre-built batches in memory (reference)": lambda: prebuilt,
        "ours, built by a thread (prefetch 2)": Batches(data, "cpu", prefetch=2),
        "ours, 1 worker process (prefetch 2)": Batches(data, "cpu", num_workers=1, prefetch=2),
        "ours, built in the loop (no overlap)": Batches(data, "cpu", prefetch=0),
    }
    best = dict.fromkeys(loops, 0.0)
    for _ in range(args.rounds + 1):  # the first round warms up (worker start)
        for name, source in loops.items():
            batches = source() if callable(source) else source.run(tasks)
            best[name] = max(best[name], steps_per_second(model, optimizer, batches))
    for source in loops.values():
        if isinstance(source, Batches):
            source.close()
    ref = best["pre-built batches in memory (reference)"]
    print(f"{'loop':<44}{'steps/s':>9}{'x pre-built':>13}")
    for name, rate in best.items():
        print(f"{name:<44}{rate:>9.1f}{rate / ref:>13.2f}")
    print(f"target: overlap >= 0.9x the pre-built throughput; {load()}")


def demo_stores(root: Path, n_train: int, n_val: int = 100) -> FeaturePaths:
    """Stores shaped like the demo's (10 regions x 512 float16, 5 captions of ~10 words)."""
    rng = np.random.default_rng(n_train)
    keys = [f"img{i:06d}" for i in range(n_train + n_val)]
    records = [
        Record(k, f"{k}.jpg", "train" if i < n_train else "val", [f"c{j}" for j in range(5)])
        for i, k in enumerate(keys)
    ]
    write_manifest(records, Records("scale", records), 5, root / "manifest.parquet")
    manifest = read_manifest(root / "manifest.parquet")
    provenance = Provenance("scale", "1", {}, None, manifest.digest)
    with StoreWriter(
        root / "regions.zarr",
        "regions",
        regions_fields(10, 512),
        keys,
        provenance,
        StoreConfig(),
        log=lambda m: None,
    ) as writer:
        for shard in writer.pending_shards():
            a, b = writer.shard_range(shard)
            corners = np.sort(rng.uniform(0, 128, (b - a, 10, 2, 2)), axis=2)
            writer.write_shard(
                shard,
                {
                    "features": rng.standard_normal((b - a, 10, 512)).astype(np.float16),
                    "boxes": corners.reshape(b - a, 10, 4),
                    "n_regions": rng.integers(2, 11, b - a),
                    "image_hw": np.full((b - a, 2), 128),
                },
            )
    caption_keys = [f"{k}#{j}" for k in keys for j in range(5)]
    with StoreWriter(
        root / "text.zarr",
        "text",
        {"word_ids": FieldSpec((), "int32", ragged=True)},
        caption_keys,
        provenance,
        StoreConfig(),
        log=lambda m: None,
    ) as writer:
        for shard in writer.pending_shards():
            a, b = writer.shard_range(shard)
            words = [rng.integers(4, 300, int(rng.integers(8, 14))) for _ in range(a, b)]
            writer.write_shard(shard, {"word_ids": words})
    vocab = {"words": ["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(296)]}
    (root / "vocab.json").write_text(json.dumps({**vocab, "tfidf_terms": []}))
    return FeaturePaths(
        manifest=root / "manifest.parquet",
        regions=root / "regions.zarr",
        text=root / "text.zarr",
        vocab=root / "vocab.json",
    )


def scaling(root: Path, args) -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    model_cfg = MVVSEConfig.model_validate(params["models"]["mvvse"])
    demo = params["demo"]["n_train"]
    train_params = {k: v for k, v in params["train"].items() if k in TrainConfig.model_fields}
    cfg = TrainConfig.model_validate({**train_params, "epochs": 2, "device": "cpu"})
    print(f"\nepoch time: MV-VSE (demo params), batch {cfg.batch_size}, {load()}")
    sizes, seconds = [], []
    for factor in (1, 2, 4):
        folder = root / f"scale{factor}"
        folder.mkdir()
        paths = demo_stores(folder, demo * factor)
        inputs = frozenset({"regions", "words"})
        times: list[float] = []

        def log(line: str, times=times) -> None:
            found = re.search(r"epoch \d+: .*, ([\d.]+) s \(", line)
            if found:
                times.append(float(found.group(1)))

        torch.manual_seed(0)
        train(
            "mvvse",
            model_cfg,
            cfg,
            PairData(paths, "train", inputs),
            PairData(paths, "val", inputs),
            folder / "model",
            log=log,
        )
        sizes.append(demo * factor * 5)
        seconds.append(min(times[1:]))  # the second epoch: warm
        print(
            f"{factor}x the demo: {demo * factor} images, {sizes[-1]} captions: "
            f"{seconds[-1]:.2f} s per epoch ({sizes[-1] / seconds[-1]:.0f} pairs/s)"
        )
    exponent = np.polyfit(np.log(sizes), np.log(seconds), 1)[0]
    print(f"epoch time ~ size^{exponent:.2f} from 1x to 4x (target: linear, 1.0); {load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=30, help="steps per timed pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["overlap", "scaling"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="vse-train-loop-"))
    print(f"{load()} at start, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    try:
        if args.only != "scaling":
            generate(root, args.images, log=lambda m: None)
            overlap(root, args)
        if args.only != "overlap":
            scaling(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
