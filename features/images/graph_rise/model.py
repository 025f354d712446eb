"""The Graph-RISE head, its loss and its trainer.

Graph-RISE (Juan et al. 2019, eq. 1, after Bui, Ravi and Ramavajjala's Neural Graph
Machines, 2018, eq. 3) minimises over the labelled images i and the graph edges (i, j)::

    L = sum_i L_s(y_i, f(x_i)) + alpha * sum_(i,j) w_ij * d(h_i, h_j),   d = ||h_i - h_j||^2

with ``h = f(x)`` the embedding and ``L_s`` the softmax cross entropy against the image's
labels as a distribution (multi-hot / count: the multi-label softmax Graph-RISE uses,
without its sampling, since our vocabulary is small) through one linear layer on h.
``f`` reads the image as a set of item vectors: the detector's regions (feature, box,
area; the default) or the pooled trunk feature as a set of one. Each item goes through a
two-layer MLP, the set is pooled by the mean and the max over its valid items, and an MLP
maps the pooled vector to ``dim`` (64 in HUSE and Graph-RISE), L2-normalised. Where we
differ from the paper: dropout before each layer of the item MLP (ours, its rate chosen by
val P@10 on the demo); L_s is averaged over the batch's labelled images and the regulariser
divided by the number of seed images (the paper writes sums; this only rescales alpha);
the trunk stays frozen (the paper fine-tunes Inception on the pixels), so the head reads
the frozen detector's region features, which carry the colours and places the labels name.

Batches follow Graph-RISE sec. 3.3 / NGM sec. 3: ``batch_size`` seed images in a seeded
random order, each with ``packed`` of its graph neighbours drawn into the batch, and the
regulariser runs over every graph edge whose two ends are in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from infra.config import UserError
from infra.kernels import adamw
from infra.trainer import Trainer

LAST = "last.pt"


class GraphRiseTrainingError(UserError):
    """A run that cannot continue (a non-finite loss, a checkpoint of another run)."""


@dataclass(frozen=True)
class ItemSets:
    """Item sets read on demand: ``load(rows)`` -> features ``(B, R, D)`` float32 and mask
    ``(B, R)`` bool of those rows (any order), ``dim`` = D. The trainer and :func:`embed`
    read a batch at a time, so no split's regions have to fit in memory (COCO's 123k images
    x 36 regions x 2048 would be 36 GB as float32)."""

    load: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    dim: int

    @classmethod
    def of_arrays(cls, features: np.ndarray, mask: np.ndarray) -> ItemSets:
        """Item sets held in memory: ``features (N, R, D)``, ``mask (N, R)``."""
        return cls(lambda rows: (features[rows], mask[rows]), features.shape[-1])


def item_statistics(items: ItemSets, rows: np.ndarray, block: int = 1024) -> tuple:
    """Mean and unbiased std ``(D,)`` of the valid items of ``rows``, read ``block`` rows at
    a time: each block's mean and sum of squared deviations merged into the running ones
    (Chan, Golub and LeVeque's pairwise update), in float64; a std of 1 with fewer than 2
    items."""
    n, mean, m2 = 0, np.zeros(items.dim), np.zeros(items.dim)
    for i in range(0, len(rows), block):
        x, m = items.load(rows[i : i + block])
        v = np.asarray(x[m], np.float64)  # (valid items, D)
        if not len(v):
            continue
        nb, mb = len(v), v.mean(0)
        delta, total = mb - mean, n + len(v)
        mean = mean + delta * nb / total
        m2 = m2 + ((v - mb) ** 2).sum(0) + delta**2 * n * nb / total
        n = total
    std = np.sqrt(m2 / (n - 1)) if n > 1 else np.ones(items.dim)
    return mean, std


class Head(nn.Module):
    """``f``: a set of item vectors ``(B, R, D)`` with its mask ``(B, R)`` -> embedding
    ``h`` ``(B, dim)`` on the unit sphere, and the label classifier on ``h``. Items are
    standardised with the mean and std of the valid train items (buffers, kept in the
    checkpoint)."""

    def __init__(self, in_dim: int, hidden: int, dim: int, n_labels: int, dropout: float = 0.0):
        super().__init__()
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))
        self.item = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(in_dim, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.classifier = nn.Linear(dim, n_labels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask[..., None].to(x.dtype)  # (B, R, 1)
        v = self.item((x - self.mean) / self.std) * m  # (B, R, hidden)
        mean = v.sum(1) / m.sum(1).clamp_min(1)  # (B, hidden)
        top = v.masked_fill(m == 0, float("-inf")).amax(1).clamp_min(0)  # (B, hidden); v >= 0
        return F.normalize(self.mlp(torch.cat([mean, top], -1)), dim=-1)  # (B, dim)


def label_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L_s: softmax cross entropy of ``logits (B, L)`` against the multi-hot ``targets
    (B, L)`` normalised to sum to 1, averaged over the rows that have a label."""
    counts = targets.sum(1)  # (B,)
    keep = counts > 0
    if not keep.any():
        return logits.sum() * 0.0
    dist = targets[keep] / counts[keep, None]  # (B', L)
    return -(dist * F.log_softmax(logits[keep], dim=-1)).sum(1).mean()


def graph_regulariser(
    h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """NGM eq. 3 / Graph-RISE eq. 1's graph term (before alpha):
    ``sum_(i,j) w_ij ||h_i - h_j||^2`` over the edges ``src (E,) -> dst (E,)`` (rows of
    ``h (B, dim)``) with weights ``(E,)``."""
    return (weight * (h[src] - h[dst]).square().sum(-1)).sum()


class Graph:
    """The graph's out-edges by source row (CSR), over rows ``0..n-1``."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, weight: np.ndarray, n: int):
        order = np.argsort(src, kind="stable")
        self.dst = np.asarray(dst, np.int64)[order]
        self.weight = np.asarray(weight, np.float32)[order]
        self.offsets = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=n))])

    def neighbours(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])


def pack_batch(
    seeds: np.ndarray, graph: Graph, packed: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of one batch (the ``seeds``, then up to ``packed`` neighbours of each drawn
    without replacement, first occurrence kept) and the graph edges inside it, as
    positions ``src, dst`` in the batch and their weights."""
    rows = list(seeds)
    if packed:
        for i in seeds:
            nb = graph.dst[graph.neighbours(i)]
            if len(nb):
                rows += list(rng.choice(nb, size=min(packed, len(nb)), replace=False))
    rows = np.asarray(list(dict.fromkeys(int(r) for r in rows)), dtype=np.int64)  # (B,)
    pos = {r: p for p, r in enumerate(rows.tolist())}
    src, dst, w = [], [], []
    for p, r in enumerate(rows.tolist()):
        span = graph.neighbours(r)
        for j, wj in zip(graph.dst[span].tolist(), graph.weight[span].tolist(), strict=True):
            if j in pos:
                src.append(p)
                dst.append(pos[j])
                w.append(wj)
    return rows, np.asarray(src, np.int64), np.asarray(dst, np.int64), np.asarray(w, np.float32)


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Seed rows of each batch of an epoch: a permutation drawn from ``(seed, epoch)``
    alone, so a resumed run draws what an uninterrupted one would."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def train_head(
    items: ItemSets,
    rows: np.ndarray,
    targets: np.ndarray,
    graph: Graph,
    cfg,
    alpha: float,
    identity: dict,
    out_dir: Path | None = None,
    resume: bool = False,
    device: torch.device | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Head, list[dict]]:
    """Train the head on the item sets of ``rows`` (N train images of ``items``) with
    ``targets (N, L)`` (multi-hot, any dtype) and the ``graph`` over positions in ``rows``
    (eq. 1 above); deterministic for a given ``cfg.seed``.
    With ``out_dir``: ``last.pt`` after every epoch, and ``resume`` continues from it
    (bit-identical to an uninterrupted run; ``identity`` must match)."""
    device = device or torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model = Head(items.dim, cfg.hidden, cfg.dim, targets.shape[1], cfg.dropout)
    mean, std = item_statistics(items, rows)
    model.mean.copy_(torch.from_numpy(mean))
    model.std.copy_(torch.from_numpy(std).clamp_min(1e-6))
    model.to(device)
    optimizer = adamw(model.parameters(), cfg.lr, cfg.weight_decay)
    steps = cfg.epochs * -(-len(rows) // cfg.batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
    trainer = Trainer(
        "graph-rise",
        model,
        optimizer,
        scheduler,
        identity={**identity, "alpha": alpha},
        last_path=out_dir / LAST if out_dir else None,
        device=device,
        error=GraphRiseTrainingError,
        log=log,
    )
    if resume:
        trainer.resume()

    def run_epoch(epoch: int, within: dict | None) -> dict:
        model.train()
        rng = np.random.default_rng([cfg.seed, epoch, 1])
        sums = {"loss": 0.0, "labels": 0.0, "graph": 0.0}
        batches = epoch_batches(len(rows), cfg.batch_size, cfg.seed, epoch)
        for seeds in batches:
            batch, src, dst, w = pack_batch(seeds, graph, cfg.packed if alpha else 0, rng)
            x, m = (_tensor(a, device) for a in items.load(rows[batch]))  # (B, R, D), (B, R)
            h = model(x.float(), m.bool())  # (B, dim)
            l_s = label_loss(model.classifier(h), _tensor(targets[batch], device).float())
            l_g = graph_regulariser(h, *(_tensor(a, device) for a in (src, dst, w))) / len(seeds)
            loss = l_s + alpha * l_g
            if not torch.isfinite(loss):
                raise GraphRiseTrainingError(
                    f"graph-rise: loss is {loss.item()} at epoch {epoch}; lower graph_rise.lr "
                    "or graph_rise.alpha, then rerun with --resume"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            for k, v in (("loss", loss), ("labels", l_s), ("graph", l_g)):
                sums[k] += float(v.detach())
        return {"epoch": epoch, **{k: round(v / len(batches), 6) for k, v in sums.items()}}

    history = trainer.fit(cfg.epochs, run_epoch)
    if history:
        h = history[-1]
        log(
            f"graph-rise (alpha {alpha:g}): {cfg.epochs} epochs, loss {h['loss']:.4f} "
            f"(labels {h['labels']:.4f}, graph {h['graph']:.4f})"
        )
    return model.eval(), history


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


@torch.no_grad()
def embed(model: Head, items: ItemSets, rows: np.ndarray, batch: int = 4096) -> np.ndarray:
    """(len(rows), dim) float32 embeddings of the item sets of ``rows``, a batch at a time."""
    device = model.mean.device
    out = []
    for i in range(0, len(rows), batch):
        x, m = items.load(rows[i : i + batch])
        out.append(model(_tensor(x, device).float(), _tensor(m, device).bool()))
    return torch.cat(out).cpu().numpy() if out else np.zeros((0, model.mlp[-1].out_features))
