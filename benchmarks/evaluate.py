"""Evaluation cost: 5000 images x 25000 captions at D=1024 (the COCO 5K protocol).

Measured in one run, on the same embeddings:
- bare: the float32 matrix product ``img @ txt.T`` alone (the floor);
- ours: ``similarity_matrix`` (chunked) + ``retrieval_metrics`` (ranks both ways);
- naive: one query at a time, as VSE++'s reference ``i2t``/``t2i`` loops do, timed on a
  sample of queries and scaled to all of them.

Target: ours within 1.3x of bare. Run: ``python benchmarks/evaluate.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from models.metrics import retrieval_metrics, similarity_matrix


def inner_product(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """VSE++'s ``similarity`` on embeddings that ``encode_*`` already normalised."""
    return img @ txt.t()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def naive_seconds(img, txt, c2i, queries: int) -> float:
    """Per-query loops over numpy arrays, scaled from ``queries`` samples per direction."""
    img, txt = img.cpu().numpy(), txt.cpu().numpy()
    n_img, n_txt = len(img), len(txt)
    t0 = time.perf_counter()
    for i in range(queries):
        scores = img[i] @ txt.T
        order = np.argsort(scores)[::-1]
        int(np.where(np.isin(order, np.flatnonzero(c2i == i)))[0].min())
    per_image = (time.perf_counter() - t0) / queries
    t0 = time.perf_counter()
    for c in range(queries):
        scores = txt[c] @ img.T
        order = np.argsort(scores)[::-1]
        int(np.where(order == c2i[c])[0][0])
    per_caption = (time.perf_counter() - t0) / queries
    return per_image * n_img + per_caption * n_txt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--per-image", type=int, default=5)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--naive-queries", type=int, default=200, help="sampled per direction")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    n_txt = args.images * args.per_image
    img = torch.nn.functional.normalize(torch.randn(args.images, args.dim), dim=1).to(device)
    txt = torch.nn.functional.normalize(torch.randn(n_txt, args.dim), dim=1).to(device)
    # captions near their image, so ranks are realistic rather than uniform
    c2i = torch.arange(args.images).repeat_interleave(args.per_image).to(device)
    txt = torch.nn.functional.normalize(txt + 0.1 * img[c2i], dim=1)

    bare, _ = timed(lambda: img @ txt.t(), device, args.repeat)

    def ours():
        sims = similarity_matrix(inner_product, img, txt)
        return retrieval_metrics(sims, c2i)

    ours_s, metrics = timed(ours, device, args.repeat)
    naive = naive_seconds(img, txt, c2i.cpu().numpy(), args.naive_queries)
    print(
        f"{args.images} x {n_txt} at D={args.dim} on {device} "
        f"({torch.get_num_threads()} threads), best of {args.repeat}:"
    )
    print(f"  bare float32 product       {bare:8.2f} s   1.00x")
    print(f"  similarity + metrics (ours){ours_s:8.2f} s   {ours_s / bare:.2f}x of bare")
    print(
        f"  naive per-query loops      {naive:8.2f} s   {naive / bare:.2f}x of bare "
        f"(scaled from {args.naive_queries} queries per direction)"
    )
    print(f"  ours is {naive / ours_s:.0f}x faster than naive; rsum {metrics['rsum']:.1f}")
    print(f"  target: ours within 1.3x of bare -> {'met' if ours_s <= 1.3 * bare else 'MISSED'}")


if __name__ == "__main__":
    main()
