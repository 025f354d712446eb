"""Sentence-BERT caption statistics: how alike are the captions of one image?

MV-VSE (Li et al., IJCAI 2022, Fig. 2) motivates multiple views with the spread of
Sentence-BERT cosine similarities between captions of the same image. For every image,
every pair of its captions gets the cosine similarity of their (L2-normalised) embeddings;
per split we summarise the distribution and list the most and least consistent images
(mean similarity of their pairs).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from pydantic import Field

from features.ingest.manifest import SPLITS, Manifest
from infra.config import Section
from infra.device import Device

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
DIGITS = 4  # decimals of the metrics written (a cosine's mean over thousands of pairs)


class SbertConfig(Section):
    """``sbert`` section of params.yaml."""

    model: str = "all-MiniLM-L6-v2"  # a name or a local folder; nothing is downloaded
    batch_size: int = Field(128, ge=1)
    device: Device = "auto"
    bins: int = Field(40, ge=2)
    examples: int = Field(10, ge=1)  # most/least consistent images listed


def pairwise_similarities(embeddings: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """Per image, the cosine similarities of all pairs of its captions (upper triangle);
    ``embeddings`` (sum counts, D) are L2-normalised, grouped by image in ``counts``."""
    groups = np.split(embeddings, np.cumsum(counts)[:-1]) if counts else []
    return [(e @ e.T)[np.triu_indices(len(e), k=1)].astype(np.float64) for e in groups]


def summarise(pairs: list[np.ndarray]) -> dict:
    values = np.concatenate(pairs) if pairs else np.zeros(0)
    if not len(values):
        return {"images": len(pairs), "pairs": 0}
    summary = {
        "images": len(pairs),
        "pairs": int(len(values)),
        "mean": float(values.mean()),
        "std": float(values.std()),
        "fraction_below_0": float((values < 0).mean()),
    }
    for q, v in zip(QUANTILES, np.quantile(values, QUANTILES), strict=True):
        summary["median" if q == 0.5 else f"q{int(q * 100):02d}"] = float(v)
    return summary


def caption_statistics(
    manifest: Manifest,
    embed: Callable[[list[str]], np.ndarray],
    cfg: SbertConfig,
) -> dict:
    """Metrics per split, a histogram per split, and the extreme images."""
    rows = manifest.table.select(["key", "split", "captions"]).to_pylist()
    embeddings = embed([c for r in rows for c in r["captions"]])
    pairs = pairwise_similarities(embeddings, [len(r["captions"]) for r in rows])
    edges = np.linspace(-1.0, 1.0, cfg.bins + 1)
    metrics, histogram, extremes = {}, [], {}

    def listing(scored):  # (mean similarity, row) -> the image's entry
        return [
            {"key": rows[i]["key"], "mean_similarity": round(s, 4), "captions": rows[i]["captions"]}
            for s, i in scored
        ]

    for split in SPLITS:
        idx = [i for i, r in enumerate(rows) if r["split"] == split]
        if not idx:
            continue
        split_pairs = [pairs[i] for i in idx]
        metrics[split] = summarise(split_pairs)
        counts, _ = np.histogram(np.concatenate(split_pairs), bins=edges)
        histogram += [
            {"split": split, "similarity": round(float((a + b) / 2), 4), "pairs": int(c)}
            for a, b, c in zip(edges[:-1], edges[1:], counts, strict=True)
        ]
        scored = sorted((float(pairs[i].mean()), i) for i in idx if len(pairs[i]))
        extremes[split] = {
            "most_consistent": listing(scored[::-1][: cfg.examples]),
            "least_consistent": listing(scored[: cfg.examples]),
        }
    return {"metrics": metrics, "histogram": histogram, "extremes": extremes}


def plot_histogram(histogram: list[dict], path) -> None:
    """PNG of the per-split similarity distributions (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for split in SPLITS:
        points = [h for h in histogram if h["split"] == split]
        if not points:
            continue
        total = sum(h["pairs"] for h in points) or 1
        ax.plot(
            [h["similarity"] for h in points],
            [h["pairs"] / total for h in points],
            label=split,
            drawstyle="steps-mid",
        )
    ax.set_xlabel("cosine similarity of two captions of the same image (Sentence-BERT)")
    ax.set_ylabel("fraction of caption pairs")
    ax.set_xlim(-1, 1)
    ax.legend()
    ax.set_title("Intra-image caption similarity (MV-VSE Fig. 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def sbert_encoder(cfg: SbertConfig, progress: Callable | None = None):
    """The ``sbert`` model (offline) as ``embed(captions) -> (N, D)`` L2-normalised."""
    from sentence_transformers import SentenceTransformer

    from features.text.models import resolve_model
    from infra.device import resolve_device

    folder = resolve_model(cfg.model)
    model = SentenceTransformer(
        str(folder), device=str(resolve_device(cfg.device)), local_files_only=True
    )

    def embed(captions: list[str]) -> np.ndarray:
        bar = progress(total=len(captions)) if progress else None
        parts = []
        for i in range(0, len(captions), cfg.batch_size):
            batch = captions[i : i + cfg.batch_size]
            parts.append(model.encode(batch, normalize_embeddings=True, convert_to_numpy=True))
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        return np.concatenate(parts)

    return embed


def write_statistics(result: dict, metrics, histogram, png, examples) -> None:
    """Stage ``sbert_stats``' outputs: metrics, histogram (a DVC plot), PNG, extremes."""
    from infra.files import atomic_path, write_json

    write_json(metrics, result["metrics"], digits=DIGITS)
    write_json(histogram, result["histogram"], indent=1)
    write_json(examples, result["extremes"])
    with atomic_path(png) as tmp:
        plot_histogram(result["histogram"], tmp)
