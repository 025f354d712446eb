"""Graph-RISE's head settings chosen on the val split alone; then one test figure.

Candidates: every combination of the head's choices in ``GRID``, scored by kNN label
precision@k (``graph_rise.precision_k``, 10; :func:`features.images.graph_rise.graph.
label_precision`) among the val images of heads trained on the train split:

- ``input``: ``regions`` (the detector's regions) or ``global`` (the pooled trunk feature);
- ``dropout`` before each layer of the item MLP;
- ``label_weighting``: ``none`` (each of an image's labels an equal share of its target
  distribution) or ``idf`` (shares scaled by the label's smooth IDF over the train images,
  :func:`features.images.graph_rise.labels.idf_weights`, so rare labels weigh more);
- ``alpha``, the graph regulariser's weight (0: no graph).

Two rounds bound the cost (a head takes 5-30 s on one CPU thread): every candidate is
trained with the first seed; the ``FINALISTS`` best by that val P@k are trained again with
the other seeds, and the finalist with the best mean val P@k over all the seeds is chosen.
:func:`select` is given the train and val splits only; :func:`run` reads the test split
after it has returned, and scores there only the chosen candidate's heads (one per seed)
and the global store's PCA-64 ``projected``: the one test figure.

Everything else (labels, the caption kNN graph, hidden size, epochs, lr, batches) is
params.yaml's ``graph_rise`` section, built as stage ``graph_rise`` builds it, from the
stores ``dvc repro graph_rise`` leaves (paths from dvc.yaml's ``vars``). Every candidate is
scored on the same images: those valid in both the regions and the global store. One CPU
thread, as in the stage.

    python benchmarks/graph_rise_select.py [--seeds 0 1 2] [--finalists 4] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from features.images.graph_rise import graph as G
from features.images.graph_rise.labels import (
    ImageLabels,
    WeightedLabels,
    idf_weights,
    label_vocabulary,
    multi_hot,
)
from features.images.graph_rise.model import Graph, Head, ItemSets, embed, train_head
from features.images.graph_rise.stage import GraphRiseConfig, caption_vectors, region_sets

GRID = {
    "input": ["regions", "global"],
    "dropout": [0.0, 0.3, 0.5, 0.7],
    "label_weighting": ["none", "idf"],
    "alpha": [0.0, 0.01, 0.1],
}
SEEDS = (0, 1, 2)
FINALISTS = 4  # candidates trained with every seed (the others: with the first seed only)


@dataclass(frozen=True)
class Split:
    """One split's images: ``targets (N, L)`` multi-hot labels over the train vocabulary,
    ``pca (N, 64)`` the global store's PCA-64, ``inputs`` the head's item sets per input
    (over rows ``0..N-1`` of this split) and, for the train split, the kNN ``graph`` over
    those rows."""

    targets: np.ndarray
    pca: np.ndarray
    inputs: dict[str, ItemSets]
    graph: Graph | None = None


def candidates(grid: dict[str, Sequence]) -> list[dict]:
    """Every combination of the grid's values, in grid order (the last key fastest)."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def train_candidate(
    setting: dict, seed: int, train: Split, cfg: GraphRiseConfig, log: Callable = print
) -> Head:
    """The head stage ``graph_rise`` trains, on the train split, with ``setting`` (the
    stage's params for the keys it names) and ``seed``."""
    run = cfg.model_copy(update={**setting, "seed": seed})
    GraphRiseConfig.model_validate(run.model_dump())  # a setting the stage would refuse fails
    targets = train.targets  # (N, L) multi-hot
    if run.label_weighting == "idf":  # as the stage
        targets = WeightedLabels(targets, idf_weights(targets))
    model, _ = train_head(
        train.inputs[setting["input"]],
        np.arange(len(targets)),
        targets,
        train.graph,
        run,
        run.alpha,
        {},
        None,
        log=log,
    )
    return model


def precision(model: Head, split: Split, input_: str, k: int) -> float:
    """kNN label precision@k among the split's images of the head's embedding."""
    rows = np.arange(len(split.targets))
    return G.label_precision(embed(model, split.inputs[input_], rows), split.targets, k)


def select(
    train: Split,
    val: Split,
    grid: dict[str, Sequence],
    seeds: Sequence[int],
    cfg: GraphRiseConfig,
    finalists: int = FINALISTS,
    log: Callable = print,
) -> tuple[dict, list[Head]]:
    """Every candidate of ``grid`` trained on ``train`` with the first of ``seeds`` and
    scored by val P@k; the ``finalists`` best of them trained again with the other seeds;
    the finalist with the best mean val P@k over all the seeds is chosen (the first in
    grid order on a tie). Returns the figures and the chosen candidate's heads, one per
    seed. Sees no test split."""
    k = cfg.precision_k
    rows: list[dict] = []
    heads: list[list[Head]] = []

    def score(i: int, setting: dict, seeds: Sequence[int]) -> None:
        start = time.perf_counter()
        new = [train_candidate(setting, seed, train, cfg, log=lambda s: None) for seed in seeds]
        heads[i] += new
        row = rows[i]
        row["val_per_seed"] += [round(precision(h, val, setting["input"], k), 4) for h in new]
        row["val"] = round(float(np.mean(row["val_per_seed"])), 4)
        row["seconds"] = round(row["seconds"] + time.perf_counter() - start, 1)
        log(f"{setting}: val P@{k} {row['val']:.4f} {row['val_per_seed']}")

    settings = candidates(grid)
    for i, setting in enumerate(settings):  # round 1: every candidate, the first seed
        rows.append({**setting, "val": None, "val_per_seed": [], "finalist": False, "seconds": 0.0})
        heads.append([])
        score(i, setting, seeds[:1])
    # round 2: the best by the first seed, every seed (a stable sort keeps grid order on ties)
    final = sorted(range(len(rows)), key=lambda i: -rows[i]["val"])[:finalists]
    for i in sorted(final):
        rows[i]["finalist"] = True
        score(i, settings[i], seeds[1:])
    best = max(sorted(final), key=lambda i: rows[i]["val"])  # max keeps the first of a tie
    val_pca = G.label_precision(val.pca, val.targets, k)
    return {
        "candidates": rows,
        "chosen": settings[best],
        "chosen_val": rows[best]["val"],
        "val_pca": round(val_pca, 4),
        "chosen_val_over_pca": round(rows[best]["val"] / val_pca, 3),
    }, heads[best]


def run(
    load: Callable[[str], Split],
    grid: dict[str, Sequence],
    seeds: Sequence[int],
    cfg: GraphRiseConfig,
    finalists: int = FINALISTS,
    log: Callable = print,
) -> dict:
    """Selection on val (:func:`select`), then the test split read, once, for the chosen
    candidate's heads and PCA-64. ``load(name)`` reads one split (train first)."""
    train = load("train")
    val = load("val")
    selection, heads = select(train, val, grid, seeds, cfg, finalists, log)
    test = load("test")  # only now: the choice is made
    k = cfg.precision_k
    per_seed = [precision(h, test, selection["chosen"]["input"], k) for h in heads]
    trained, pca = float(np.mean(per_seed)), G.label_precision(test.pca, test.targets, k)
    return {
        **selection,
        "test": {
            "trained": round(trained, 4),
            "trained_per_seed": [round(p, 4) for p in per_seed],
            "pca": round(pca, 4),
            "trained_over_pca": round(trained / pca, 3),
        },
    }


class DemoSplits:
    """``load(name)`` for :func:`run` over the stores of ``dvc repro graph_rise``: each call
    reads that split's images only (their captions' scene graphs, PCA-64, pooled feature,
    regions). The label vocabulary and the caption kNN graph come from the train split, so
    it is read first."""

    def __init__(self, paths: dict, cfg: GraphRiseConfig):
        from features.ingest.manifest import read_manifest
        from features.store.reader import Store

        if cfg.caption_embedding != "text":
            raise SystemExit("graph_rise.caption_embedding: only `text` is supported here")
        self.cfg = cfg
        self.scenegraphs = Path(paths["scenegraphs"])
        self.manifest = read_manifest(Path(paths["manifest"]))
        table = self.manifest.table
        self.split = np.asarray(table["split"].to_pylist())
        self.counts = np.array([len(c) for c in table["captions"].to_pylist()])
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(int)
        self.caption_keys = self.manifest.caption_rows()[0]
        digest = self.manifest.digest
        features = Path(paths["features"])
        self.global_ = Store.open(features / "global.zarr", manifest_digest=digest)
        self.text = Store.open(Path(paths["text"]), manifest_digest=digest)
        regions = Store.open(features / "regions.zarr", manifest_digest=digest)
        self.regions, valid = region_sets(regions)
        self.valid = valid & self.global_.read(0, len(self.global_), ["valid"])["valid"].astype(
            bool
        )
        self.vocabulary: list[dict] | None = None

    def _captions(self, rows: np.ndarray) -> list[str]:
        return [k for i in rows for k in self.caption_keys[self.starts[i] : self.starts[i + 1]]]

    def __call__(self, name: str) -> Split:
        from features.scenegraph.files import read_graph_table

        rows = np.flatnonzero(self.split == name)  # (n,) manifest rows of the split
        graphs = read_graph_table(self.scenegraphs, self._captions(rows))
        images = ImageLabels.of_graphs(graphs, self.counts[rows])
        graph = None
        if name == "train":  # as the stage: vocabulary and graph over every train image
            self.vocabulary = label_vocabulary(images, self.cfg.min_images)
            hidden = self.text.fields["document"].shape[-1] // 4
            cap = caption_vectors(self.text, self._captions(rows), hidden)
            src, dst, weight = G.knn_graph(
                G.image_vectors(cap, self.counts[rows].tolist()), self.cfg.neighbours
            )
            remap = np.full(len(rows), -1)  # graph rows onto the valid train images
            remap[self.valid[rows]] = np.arange(int(self.valid[rows].sum()))
            keep = (remap[src] >= 0) & (remap[dst] >= 0)
            graph = Graph(remap[src[keep]], remap[dst[keep]], weight[keep], int(remap.max()) + 1)
        elif self.vocabulary is None:
            raise RuntimeError("load the train split first: it fixes the label vocabulary")
        ok = self.valid[rows]
        keep = rows[ok]  # (N,) the split's valid images
        targets = multi_hot(images[np.flatnonzero(ok)], self.vocabulary)
        pooled = self.global_.gather("features", keep).astype(np.float32)  # (N, D)
        regions = self.regions
        return Split(
            targets,
            self.global_.gather("projected", keep).astype(np.float32),
            {
                "regions": ItemSets(lambda r: regions.load(keep[r]), regions.dim),
                "global": ItemSets.of_arrays(pooled[:, None, :], np.ones((len(keep), 1), bool)),
            },
            graph,
        )


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc", default="dvc.yaml", help="the paths: its `vars`")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--finalists", type=int, default=FINALISTS, help="trained with every seed")
    ap.add_argument("--out", help="JSON of every candidate's val figures and the test figure")
    args = ap.parse_args()
    cfg = GraphRiseConfig(**yaml.safe_load(Path(args.params).read_text())["graph_rise"])
    paths = {
        k: v
        for block in yaml.safe_load(Path(args.dvc).read_text())["vars"]
        for k, v in block.get("paths", {}).items()
    }
    torch.set_num_threads(1)  # as the stage: the head is tiny, shared cores make threads slow
    start = time.perf_counter()
    result = run(DemoSplits(paths, cfg), GRID, args.seeds, cfg, args.finalists)
    seconds = round(time.perf_counter() - start, 1)
    fixed = cfg.model_dump(mode="json", exclude={"device", "output", "seed", *GRID})
    result = {
        "script": "benchmarks/graph_rise_select.py",
        "grid": GRID,
        "seeds": args.seeds,
        "finalists": args.finalists,
        "fixed": fixed,
        **result,
        "seconds": seconds,
    }
    print(f"chosen on val: {result['chosen']} (val P@{cfg.precision_k} {result['chosen_val']})")
    print(f"test: {json.dumps(result['test'])}; {seconds} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
