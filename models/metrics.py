"""One definition of cross-modal retrieval metrics, shared by every model.

``retrieval_metrics(sims, caption_to_image)``: a query's rank is the number of candidates
scoring strictly higher than its best ground truth (ties count in its favour). R@K in
percent; medr and meanr 1-based. Captions of image ``-1`` are distractors: candidates for
image-to-text queries, never ground truth nor queries. A NaN or infinite score is refused
(:class:`NonFiniteError`): a NaN never compares greater, so it would rank first. The work is
a few chunked passes over the matrix on its device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from infra.finite import NonFiniteError

KS = (1, 5, 10)


def _refuse_non_finite(scores: torch.Tensor, where: Callable[[tuple], tuple[int, int]]) -> None:
    """One line naming the first (image, caption) pair whose score is NaN or infinite;
    ``where`` maps a position in ``scores`` to its image and caption in the matrix."""
    # a non-finite score makes the sum non-finite: one fast reduction in the usual case (a
    # sum that overflows falls through to the exact test)
    if bool(torch.isfinite(scores.sum())) or bool(torch.isfinite(scores).all()):
        return
    position = tuple(int(v) for v in torch.nonzero(~torch.isfinite(scores))[0])
    i, c = where(position)
    raise NonFiniteError(
        f"the similarity of image {i} and caption {c} is {float(scores[position])}: NaN "
        "or infinite scores cannot be ranked; check the checkpoint and the features of that "
        "image and caption (vse store verify)"
    )


def _summary(ranks: torch.Tensor, prefix: str) -> dict[str, float]:
    ranks = ranks.cpu().numpy()
    out = {f"{prefix}_r{k}": float(100.0 * np.mean(ranks < k)) for k in KS}
    out[f"{prefix}_medr"] = float(np.floor(np.median(ranks)) + 1)  # as VSE++'s reference code
    out[f"{prefix}_meanr"] = float(ranks.mean() + 1)
    return out


def retrieval_ranks(
    sims: torch.Tensor, caption_to_image: torch.Tensor, chunk: int = 128, first_image: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based ranks of each image query (i2t) and each real caption query (t2i).

    One pass over blocks of ``chunk`` image rows, small enough to stay in cache while
    both directions count the scores above their thresholds. ``first_image``: the number
    of the first row in errors (``sims`` a block of a larger matrix's rows)."""
    sims = torch.as_tensor(sims)
    c2i = torch.as_tensor(caption_to_image, device=sims.device).long()
    n_img, n_cap = sims.shape
    if c2i.shape != (n_cap,):
        raise ValueError(f"caption_to_image has shape {tuple(c2i.shape)}, expected ({n_cap},)")
    real = torch.nonzero(c2i >= 0).squeeze(1)
    if real.numel() == 0:
        raise ValueError("no caption has an image: nothing to evaluate")
    if int(c2i.max()) >= n_img:
        raise ValueError(f"caption_to_image refers to image {int(c2i.max())} of {n_img}")
    gt = sims[c2i[real], real]  # (n_real,) each caption's score with its own image
    _refuse_non_finite(gt, lambda p: (first_image + int(c2i[real[p[0]]]), int(real[p[0]])))
    best = torch.full((n_img,), -torch.inf, dtype=sims.dtype, device=sims.device)
    best = best.scatter_reduce(0, c2i[real], gt, reduce="amax")  # best ground truth per image
    if torch.isinf(best).any():
        missing = first_image + int(torch.nonzero(torch.isinf(best))[0])
        raise ValueError(f"image {missing} has no caption: every image needs one to be a query")
    i2t = torch.empty(n_img, dtype=torch.long, device=sims.device)
    t2i = torch.zeros(real.numel(), dtype=torch.long, device=sims.device)
    all_real = real.numel() == n_cap  # then no column gather (no copy)
    for lo in range(0, n_img, chunk):
        block = sims[lo : lo + chunk]
        _refuse_non_finite(block, lambda p, lo=lo: (first_image + lo + p[0], p[1]))
        i2t[lo : lo + chunk] = torch.count_nonzero(block > best[lo : lo + chunk, None], dim=1)
        t2i += torch.count_nonzero((block if all_real else block[:, real]) > gt[None, :], dim=0)
    return i2t, t2i


def retrieval_metrics(sims, caption_to_image, chunk: int = 128) -> dict[str, float]:
    """R@1/5/10 (percent), medr and meanr both ways, and rsum (sum of the six R@K)."""
    i2t, t2i = retrieval_ranks(torch.as_tensor(sims), torch.as_tensor(caption_to_image), chunk)
    out = {**_summary(i2t, "i2t"), **_summary(t2i, "t2i")}
    out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in KS)
    return out


def i2t_metrics(
    similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    img: torch.Tensor,
    txt: torch.Tensor,
    caption_to_image,
    max_elements: int = 2**24,
) -> dict[str, float]:
    """The image-to-text figures of :func:`retrieval_metrics` on ``similarity(img, txt)``,
    made a block of image rows at a time (at most ``max_elements`` scores: 64 MiB), so
    that the matrix (3 GB for COCO 5K with an attack's fakes) never exists whole. Within
    the limit, one block: the scores of one call, as :func:`similarity_matrix` makes them."""
    c2i = torch.as_tensor(caption_to_image, device=img.device).long()
    ranks = []
    for lo, block in similarity_blocks(similarity, img, txt, max_elements):
        mine = (c2i >= lo) & (c2i < lo + block.shape[0])  # ground truth in the block
        local = torch.where(mine, c2i - lo, torch.full_like(c2i, -1))
        ranks.append(retrieval_ranks(block, local, first_image=lo)[0])
    return _summary(torch.cat(ranks), "i2t")


def fold_metrics(sims, caption_to_image, fold_size: int) -> dict[str, float]:
    """The COCO 1K protocol: consecutive folds of ``fold_size`` images with their captions,
    each evaluated alone; every metric (rsum too) is the mean over folds."""
    sims = torch.as_tensor(sims)
    c2i = torch.as_tensor(caption_to_image, device=sims.device).long()
    n_folds = sims.shape[0] // fold_size
    if n_folds < 1:
        raise ValueError(f"{sims.shape[0]} images: fewer than one fold of {fold_size}")
    # named by their place in the whole matrix, not in a fold
    _refuse_non_finite(sims, lambda p: p)
    folds = []
    for f in range(n_folds):
        lo, hi = f * fold_size, (f + 1) * fold_size
        cols = torch.nonzero((c2i >= lo) & (c2i < hi)).squeeze(1)
        folds.append(retrieval_metrics(sims[lo:hi][:, cols], c2i[cols] - lo))
    return {k: float(np.mean([m[k] for m in folds])) for k in folds[0]}


@torch.no_grad()
def similarity_blocks(
    similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    img: torch.Tensor,
    txt: torch.Tensor,
    max_elements: int,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, similarity(img[rows], txt))`` in float32 for blocks of image rows of
    at most ``max_elements`` scores: all rows in one call when they fit (also no rows or
    no captions: one empty block)."""
    rows = max(1, max_elements // max(1, txt.shape[0]))
    for lo in range(0, max(1, img.shape[0]), rows):
        yield lo, similarity(img[lo : lo + rows], txt).float()


def similarity_matrix(
    similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    img: torch.Tensor,
    txt: torch.Tensor,
    max_elements: int = 2**28,
) -> torch.Tensor:
    """``similarity(img, txt)``: (n_img, n_txt) float32. In one call when the result has
    at most ``max_elements`` entries (1 GiB; COCO 5K x 25K is 125M), else in row chunks
    of that size, copied into one matrix."""
    blocks = similarity_blocks(similarity, img, txt, max_elements)
    if img.shape[0] * txt.shape[0] <= max_elements:
        return next(blocks)[1]
    out = torch.empty(img.shape[0], txt.shape[0], dtype=torch.float32, device=img.device)
    for lo, block in blocks:
        out[lo : lo + block.shape[0]] = block
    return out
