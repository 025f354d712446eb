"""Bottom-up-attention region selection (Anderson et al. 2018, ``generate_tsv.py``): per-class
NMS, each proposal's best surviving class score, a confidence threshold and the min/max
number of regions, computed exactly without running one NMS per class."""

from __future__ import annotations

import torch
from torchvision.ops import box_iou

from features.images.config import RegionsConfig


def butd_select(
    boxes: torch.Tensor, scores: torch.Tensor, cfg: RegionsConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bottom-up-attention region selection; returns kept indices, their class, confidence.

    The result is exactly that of the per-class loop of bottom-up-attention's
    ``generate_tsv.py`` with torchvision's ``nms``: for each class c >= 1 (column 0 of the
    softmax ``scores`` (P, C) is background), greedy NMS over all proposals ordered by
    ``scores[:, c]`` (descending; ties by proposal index, as torchvision's stable sort) at
    IoU ``> nms_iou``; ``max_conf[i]`` = the best score of proposal i among the classes in
    which it survives (0 if none); keep the proposals with ``max_conf >= conf_threshold``,
    at least ``min_boxes`` and at most ``max_boxes``, ranked by ``max_conf`` (descending,
    ties by index; the paper's tool keeps the in-range case in index order). A proposal's
    class is the lowest class reaching its ``max_conf``; one that survives in no class
    with a positive score (kept only to reach ``min_boxes``) gets its top-scoring class.

    The loop costs C NMS runs; this does the same selection from one IoU matrix and only
    the (proposal, class) pairs that can matter. Survival of pair (i, c) depends only on
    the pairs of class c that precede it, so NMS restricted to the pairs scoring
    ``>= tau`` is exact for them, and gives ``max_conf`` exactly for every proposal whose
    ``max_conf >= tau`` (the others are known to be below ``tau``). With ``tau =
    conf_threshold`` that decides everything unless fewer than ``min_boxes`` proposals
    pass; then ``tau`` drops to a value that at least ``min_boxes`` proposals are known to
    reach (each class's top proposal always survives), or to 0 (all pairs) in degenerate
    cases. NMS itself runs for all classes at once, one rank at a time, on bitsets.
    """
    n = len(boxes)
    fg = scores[:, 1:]  # (P, C-1)
    if n == 0 or fg.shape[1] == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, torch.zeros(0, dtype=scores.dtype)
    # torchvision's nms compares the float IoU with the threshold as a double
    over = box_iou(boxes, boxes).double() > cfg.nms_iou  # (P, P) suppression relation
    target = min(cfg.min_boxes, n)
    tau = cfg.conf_threshold
    max_conf, best = _max_conf_from(fg, over, tau)
    if int((max_conf >= tau).sum()) < target and tau > 0:
        # each class's top proposal survives its NMS: a lower bound on max_conf
        top_score, top_box = fg.max(dim=0)
        bound = torch.zeros(n, dtype=fg.dtype).scatter_reduce(0, top_box, top_score, "amax")
        ranked_bound = bound.sort(descending=True).values
        tau = min(tau, float(ranked_bound[target - 1]))
        max_conf, best = _max_conf_from(fg, over, tau)
    confidence = torch.where(max_conf >= tau, max_conf, torch.zeros_like(max_conf))
    ranked = torch.argsort(confidence, descending=True, stable=True)
    n_keep = int((confidence >= cfg.conf_threshold).sum())
    n_keep = min(max(n_keep, cfg.min_boxes), cfg.max_boxes, n)
    keep = ranked[:n_keep]
    classes = torch.where(best[keep] >= 0, best[keep], fg[keep].argmax(dim=1))
    return keep, classes + 1, confidence[keep]


def _max_conf_from(
    fg: torch.Tensor, over: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class greedy NMS on the pairs scoring ``>= tau``; returns ``max_conf`` (P,)
    (exact where ``>= tau``) and the lowest class reaching it with a positive score (-1
    where there is none)."""
    n = len(fg)
    box, cls = torch.nonzero(fg >= tau, as_tuple=True)  # box-major: box ascending per class
    score = fg[box, cls]
    order = torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(cls[order], stable=True)]  # class, score desc, box asc
    box, cls, score = box[order], cls[order], score[order]
    max_conf = torch.zeros(n, dtype=fg.dtype)
    best = torch.full((n,), -1, dtype=torch.long)
    if len(box) == 0:
        return max_conf, best
    survives = _grouped_nms(box, cls, over)
    alive = survives & (score > 0)
    max_conf.scatter_reduce_(0, box[alive], score[alive], "amax")
    winner = alive & (score == max_conf[box])
    big = fg.shape[1]
    lowest = torch.full((n,), big, dtype=torch.long)
    lowest.scatter_reduce_(0, box[winner], cls[winner], "amin")
    best = torch.where(lowest < big, lowest, best)
    return max_conf, best


def _grouped_nms(box: torch.Tensor, cls: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    """Greedy NMS of every class at once: pairs sorted by class, then rank; ``over[a, b]``
    says a kept ``a`` suppresses ``b``. Step r decides the r-th pair of every class, whose
    suppression by earlier kept pairs is read from per-class bitsets (32 boxes a word)."""
    n = len(over)
    words = -(-n // 32)
    padded = torch.zeros(n, words * 32, dtype=torch.int64)
    padded[:, :n] = over.to(torch.int64)
    bits = (padded.view(n, words, 32) << torch.arange(32)).sum(dim=2)  # (P, W)
    classes, counts = torch.unique_consecutive(cls, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(box)) - torch.repeat_interleave(starts, counts)
    group = torch.repeat_interleave(torch.arange(len(classes)), counts)
    table = torch.full((len(classes), int(counts.max())), -1, dtype=torch.long)
    table[group, rank] = box  # (G, R) proposals of each class in NMS order
    kept = torch.zeros_like(table, dtype=torch.bool)
    suppressed = torch.zeros(len(classes), words, dtype=torch.int64)  # (G, W) bitsets
    for r in range(table.shape[1]):
        b = table[:, r]
        valid = b >= 0
        b = b.clamp(min=0)
        word = suppressed.gather(1, (b // 32)[:, None])[:, 0]
        keep = valid & (((word >> (b % 32)) & 1) == 0)
        kept[:, r] = keep
        suppressed |= bits[b] * keep[:, None]
    return kept[group, rank]
