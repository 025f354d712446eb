"""The image-image graph of Graph-RISE (Juan et al. 2019, sec. 3.2) and the kNN metrics.

Graph-RISE builds its graph from image similarity; we build ours from what the captions
say: an image's vector is the mean of its captions' L2-normalised Sentence-BERT embeddings,
re-normalised, and each train image links to its ``k`` most cosine-similar other train
images with weight ``w_ij = max(cos, 0)`` (ties broken by the lower index). The graph is
directed (i -> its k neighbours); the regulariser sums over these edges.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BLOCK = 1024  # query rows per similarity block: memory O(BLOCK x N)
VALUES = 2**24  # label values (bytes) in a block of the label comparisons


def image_vectors(caption_embeddings: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """(N, D) L2-normalised mean of each image's (L2-normalised) caption embeddings
    ``(sum counts, D)``, grouped by image in ``counts`` (an image without captions: 0)."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    sums = np.add.reduceat(caption_embeddings.astype(np.float64), starts, axis=0)  # (N, D)
    sums[np.asarray(counts) == 0] = 0  # reduceat gives the next row for empty groups
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    return (sums / np.where(norms == 0, 1, norms)).astype(np.float32)


def top_k(queries: np.ndarray, base: np.ndarray, k: int, same: bool) -> tuple:
    """Indices (Nq, k) into ``base`` and cosine similarities (Nq, k) of each query's ``k``
    most similar rows (rows are L2-normalised), best first, ties by lower index;
    ``same``: queries are ``base`` itself, and a row is not its own neighbour."""
    k = min(k, len(base) - int(same))
    idx = np.empty((len(queries), k), dtype=np.int64)
    sim = np.empty((len(queries), k), dtype=np.float32)
    for lo in range(0, len(queries), BLOCK):
        s = queries[lo : lo + BLOCK] @ base.T  # (b, N)
        if same:
            s[np.arange(len(s)), np.arange(lo, lo + len(s))] = -np.inf
        idx[lo : lo + len(s)], sim[lo : lo + len(s)] = _largest(s, k)
    return idx, sim


def _largest(s: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns (b, k) and values (b, k) of each row's ``k`` largest values of ``s (b, N)``,
    largest first, equal values by lower column: a stable sort of ``-s``'s first ``k``,
    found by partition (linear in N, where sorting each row of a COCO-sized train split
    is ``N log N`` and an int64 copy of the block)."""
    if k == 0:
        return np.empty((len(s), 0), np.int64), np.empty((len(s), 0), s.dtype)
    kth = np.partition(s, s.shape[1] - k, axis=1)[:, s.shape[1] - k]  # (b,) k-th largest
    # the candidates: k a row, more only where values tie the k-th; row-major, so by column
    rows, cols = np.nonzero(s >= kth[:, None])
    values = s[rows, cols]
    order = np.lexsort((cols, -values, rows))  # by row, then largest value, then column
    first = np.searchsorted(rows[order], np.arange(len(s)))  # each row's first candidate
    best = order[first[:, None] + np.arange(k)]  # (b, k)
    return cols[best], values[best]


def knn_graph(vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges ``src (E,), dst (E,), weight (E,)`` of the kNN graph over ``vectors (N, D)``:
    each row to its ``k`` most similar others, ``weight = max(cos, 0)``."""
    idx, sim = top_k(vectors, vectors, k, same=True)  # (N, k)
    src = np.repeat(np.arange(len(vectors)), idx.shape[1])
    return src, idx.reshape(-1), np.maximum(sim.reshape(-1), 0).astype(np.float32)


def label_precision(vectors: np.ndarray, labels: np.ndarray, k: int = 10) -> float:
    """kNN label precision@k: for each image with labels, the mean over its ``k`` nearest
    other images (cosine of ``vectors (N, D)``, any norm) of the fraction of the
    neighbour's labels that the query has, ``|L_q & L_n| / |L_n|`` (0 for a neighbour
    without labels); averaged over the queries. ``labels (N, L)`` multi-hot."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit = (vectors / np.where(norms == 0, 1, norms)).astype(np.float32)
    idx, _ = top_k(unit, unit, k, same=True)  # (N, k)
    lab = labels.astype(bool)
    shared = np.empty(idx.shape, np.float32)  # (N, k) |L_q & L_n|
    step = max(1, VALUES // max(idx.shape[1] * lab.shape[1], 1))  # queries at a time
    for lo in range(0, len(idx), step):
        neighbours = lab[idx[lo : lo + step]]  # (b, k, L)
        shared[lo : lo + step] = (neighbours & lab[lo : lo + step, None]).sum(-1)
    sizes = lab.sum(1).astype(np.float32)  # (N,)
    per_neighbour = shared / np.maximum(sizes[idx], 1)  # (N, k)
    queries = sizes > 0
    return float(per_neighbour[queries].mean()) if queries.any() else 0.0


def graph_statistics(
    src: np.ndarray, dst: np.ndarray, weight: np.ndarray, labels: np.ndarray, n: int
) -> dict:
    """Degree, weights and how often the endpoints of an edge share labels (exactly the
    same label set; Jaccard of the sets), against random pairs of the same images."""
    lab = labels.astype(bool)
    in_degree = np.bincount(dst, minlength=n)

    def agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
        same, jaccard = np.empty(len(a), bool), np.empty(len(a), np.float64)
        step = max(1, VALUES // max(lab.shape[1], 1))  # edges at a time: (E, L) is GBs
        for lo in range(0, len(a), step):
            la, lb = lab[a[lo : lo + step]], lab[b[lo : lo + step]]
            union = (la | lb).sum(1)
            jaccard[lo : lo + step] = (la & lb).sum(1) / np.maximum(union, 1)
            same[lo : lo + step] = (la == lb).all(1)
        return float(same.mean()), float(jaccard.mean())

    same, jaccard = agreement(src, dst)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, n, len(src)), rng.integers(0, n, len(src))
    keep = a != b
    same_random, jaccard_random = agreement(a[keep], b[keep])
    return {
        "nodes": int(n),
        "edges": int(len(src)),
        "out_degree": float(len(src) / max(n, 1)),
        "in_degree": {
            "min": int(in_degree.min()),
            "median": float(np.median(in_degree)),
            "max": int(in_degree.max()),
        },
        "weight": {"mean": float(weight.mean()), "min": float(weight.min())},
        "neighbours_same_labels": same,
        "neighbours_label_jaccard": jaccard,
        "random_pairs_same_labels": same_random,
        "random_pairs_label_jaccard": jaccard_random,
    }
