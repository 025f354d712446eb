"""Fine-grained image labels mined from the scene graphs of an image's captions.

Graph-RISE (Juan et al. 2019, sec. 3.1) trains on "ultra-fine-grained" labels: tens of
millions of entity-level annotations, each image carrying several. Ours come from the
pipeline's own scene graphs (stage ``scenegraph``), one label per distinct tuple:

- object:           ``circle``                  (the object's lemma)
- attribute-object: ``red circle``              (attribute lemma, object lemma)
- relation triple:  ``circle above square``     (subject, relation, object lemmas)

An image's labels are the union over its captions. The vocabulary keeps the labels of at
least ``min_images`` train images (the frequency floor), most frequent first (ties by
text), so it is fixed by the train captions alone. With ``label_weighting: idf`` the loss
weighs each label by its smooth IDF over the train images (:func:`idf_weights`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

KINDS = ("object", "attribute", "relation")
BLOCK = 4096  # images whose captions' graphs are Python objects at a time


def image_labels(graphs: Iterable[dict]) -> set[tuple[str, str]]:
    """The ``(kind, text)`` labels of an image: the union over its captions' scene graphs
    (rows of ``graphs.parquet``: ``objects``, ``attributes``, ``relations``)."""
    out = set()
    for graph in graphs:
        objects = [o["lemma"] for o in graph["objects"]]
        out.update(("object", o) for o in objects)
        for a in graph["attributes"]:
            out.add(("attribute", f"{a['lemma']} {objects[a['object']]}"))
        for r in graph["relations"]:
            out.add(("relation", f"{objects[r['subject']]} {r['lemma']} {objects[r['object']]}"))
    return out


@dataclass
class ImageLabels:
    """Each image's labels (:func:`image_labels`) as sorted ``int32`` ids into ``labels``,
    the distinct ``(kind, text)`` labels seen: a few hundred bytes an image, where a Python
    set of label tuples is kilobytes and the captions' graphs as dicts tens of kilobytes."""

    labels: list[tuple[str, str]]
    ids: list[np.ndarray]

    @classmethod
    def of_sets(cls, per_image: Iterable[set[tuple[str, str]]]) -> ImageLabels:
        index: dict[tuple[str, str], int] = {}
        ids = [
            np.array(sorted(index.setdefault(label, len(index)) for label in labels), np.int32)
            for labels in per_image
        ]
        return cls(list(index), ids)

    @classmethod
    def of_graphs(cls, graphs: pa.Table, counts: Sequence[int]) -> ImageLabels:
        """From the graphs table (``read_graph_table``: a row per caption, each image's
        ``counts`` captions in a row), made Python objects ``BLOCK`` images at a time."""
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

        def per_image():
            for lo in range(0, len(counts), BLOCK):
                hi = min(lo + BLOCK, len(counts))
                rows = graphs.slice(starts[lo], starts[hi] - starts[lo]).to_pylist()
                for a, b in zip(starts[lo:hi], starts[lo + 1 : hi + 1], strict=True):
                    yield image_labels(rows[a - starts[lo] : b - starts[lo]])

        return cls.of_sets(per_image())

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, rows: Iterable[int]) -> ImageLabels:
        """The images ``rows`` (the same label ids)."""
        return ImageLabels(self.labels, [self.ids[i] for i in rows])


def label_vocabulary(images: ImageLabels, min_images: int) -> list[dict]:
    """Labels of at least ``min_images`` of the (train) ``images``, as
    ``{"kind", "label", "images"}`` records, most frequent first, then by kind and text."""
    counts = np.bincount(
        np.concatenate([np.zeros(0, np.int32), *images.ids]), minlength=len(images.labels)
    )
    kept = [(images.labels[i], int(counts[i])) for i in np.flatnonzero(counts >= min_images)]
    kept.sort(key=lambda item: (-item[1], KINDS.index(item[0][0]), item[0][1]))
    return [{"kind": k, "label": t, "images": n} for (k, t), n in kept]


def multi_hot(images: ImageLabels, vocabulary: Sequence[dict]) -> np.ndarray:
    """(N, L) uint8 indicator of each image's labels in ``vocabulary`` (others dropped;
    uint8, not float32: COCO's train images x a label vocabulary in the tens of thousands
    is gigabytes; the trainer makes floats a batch at a time)."""
    index = {(v["kind"], v["label"]): i for i, v in enumerate(vocabulary)}
    column = np.array([index.get(label, -1) for label in images.labels], np.int64)
    out = np.zeros((len(images), len(vocabulary)), dtype=np.uint8)
    for row, ids in enumerate(images.ids):
        cols = column[ids]
        out[row, cols[cols >= 0]] = 1
    return out


def idf_weights(labels: np.ndarray) -> np.ndarray:
    """(L,) float32 smooth IDF of each label over the (train) images ``labels (N, L)``:
    ``log((1 + N) / (1 + n_l)) + 1``, ``n_l`` the images carrying label l; rare labels
    weigh more, none weighs 0."""
    n_l = labels.astype(bool).sum(0)  # (L,)
    return (np.log((1 + len(labels)) / (1 + n_l)) + 1).astype(np.float32)


class WeightedLabels:
    """The multi-hot ``labels (N, L)`` times per-label ``weights (L,)`` as training targets,
    made a batch of rows at a time (``[rows]`` -> float32 ``(B, L)``), so the uint8 labels
    are never copied whole as floats. The loss normalises each row into a distribution."""

    def __init__(self, labels: np.ndarray, weights: np.ndarray):
        self.labels, self.weights = labels, np.asarray(weights, np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.labels.shape

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, rows) -> np.ndarray:
        return self.labels[rows] * self.weights  # (B, L) float32
