"""HUSE: Hierarchical Universal Semantic Embeddings (Narayana, Pednekar, Krishnamoorthy,
Sone, Basu; arXiv 2019).

- Towers (sec. 3.2): ``image_layers`` FC layers of ``hidden`` units (paper: 5 x 512) on the
  global image feature; ``text_layers`` (paper: 2 x 512) on the HUSE document feature, ++
  the dense TF-IDF vector with ``use_tfidf`` (sec. 4.1.1). ReLU and dropout 0.15 between
  layers (sec. 4.1.3); the last layer is linear and L2-normalised: the embedding u.
- Shared classification layer (eqs. 6-7), ``hidden -> n_classes`` on both modalities
  (``shared_classifier=False``: one per modality, an ablation).
- Semantic graph (eq. 4): A[c, c'] = cosine distance of class-name embeddings
  (Sentence-BERT here, the Universal Sentence Encoder in the paper), ``DataInfo.class_distances``.
- Loss (eq. 5): L = a1 L_class + a2 L_graph + a3 L_gap with L_class (eq. 8) the mean
  cross entropy over the 2B items; L_graph (eqs. 9-11) = 1/N^2 sum_ij s_ij (d(u_i, u_j) -
  A[y_i, y_j])^2, s_ij = 1 if A[y_i, y_j] < m or d(u_i, u_j) < m, d = 1 - cos;
  L_gap (eq. 12) = 1/B sum_b d(u_img_b, u_txt_b).
- Retrieval score: the cosine (sec. 3.1).

No official code was found (``AnkushMalaker/HUSE`` is not the authors'). Choices where the
paper is silent or not followed:

- a1 = a2 = a3 = 1.0; margin m = 0.5, about the smallest cosine distance between
  Sentence-BERT embeddings of distinct class names (demo shapes 0.44..0.83; ten Food-101
  names 0.46..0.86), so the graph is matched within a class and for the closest pairs.
- Image input: the paper's 64-d Graph-RISE embeddings were never released; the DAG gives
  stage ``graph_rise``'s small-scale reproduction (:mod:`features.images.graph_rise`), or
  the global store's PCA-64 with ``graph_rise.output: pca`` (the ablation).
- Training: the shared ``train`` section (paper sec. 4.1.3: RMSProp, lr 1.6192e-5,
  momentum 0.9, batch 1024, 250,000 steps).
- Fused classification (sec. 4.5, weights not given): the image weight with the best fused
  accuracy on val (``models.evaluate.fusion_weight``), equal weights reported beside it.
- "5 hidden layers of 512" is read as 5 FC layers, the last the embedding (D = 512).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt
from torch import nn

from infra.config import Section
from models.common import cosine_sim, l2norm
from models.data.info import DataInfo


class HUSEConfig(Section):
    """``models.huse``; defaults are the paper's (Sec. 4.1.3) where it states them."""

    image_layers: PositiveInt = 5
    text_layers: PositiveInt = 2
    hidden: PositiveInt = 512  # units of every tower layer; the universal embedding size D
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.15
    class_weight: NonNegativeFloat = 1.0  # a1 (eq. 5); not stated in the paper
    graph_weight: NonNegativeFloat = 1.0  # a2 (eq. 5); not stated in the paper
    gap_weight: NonNegativeFloat = 1.0  # a3 (eq. 5); not stated in the paper
    margin: PositiveFloat = 0.5  # m (eq. 10); not stated in the paper, see the docstring
    shared_classifier: bool = True  # one classification layer for both modalities (Sec. 3.2)
    use_tfidf: bool = True  # text tower input: document feature ++ TF-IDF (Sec. 4.1.1)


def tower(in_dim: int, layers: int, hidden: int, dropout: float) -> nn.Sequential:
    """``layers`` FC layers of ``hidden`` units, ReLU + dropout between them (Sec. 3.2);
    the last layer is linear (its output is L2-normalised by the caller)."""
    mods: list[nn.Module] = []
    for k in range(layers):
        mods.append(nn.Linear(in_dim if k == 0 else hidden, hidden))
        if k < layers - 1:
            mods += [nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*mods)


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``d(u, v) = 1 - cos(u, v)`` for all pairs: ``(n, D) x (m, D) -> (n, m)``, in float32
    even under autocast (bf16 would blur distances that are compared with the margin)."""
    with torch.autocast(a.device.type, enabled=False):
        return 1.0 - cosine_sim(a.float(), b.float())


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Eq. 8: mean softmax cross entropy of ``logits (N, C)`` against ``labels (N,)``."""
    return F.cross_entropy(logits.float(), labels)


def graph_loss(
    emb: torch.Tensor, labels: torch.Tensor, graph: torch.Tensor, margin: float
) -> torch.Tensor:
    """Eqs. 9-11: ``1/N^2 sum_ij s_ij (d(u_i, u_j) - A[y_i, y_j])^2`` over all ordered
    pairs (i = j included; it adds 0 up to rounding), where ``s_ij = 1`` when
    ``A[y_i, y_j] < m`` (semantically close classes: match the graph) or
    ``d(u_i, u_j) < m`` (embeddings too close: push them out to the graph distance).

    ``emb (N, D)`` normalised embeddings, ``labels (N,)``, ``graph (C, C)`` = A.
    """
    dist = cosine_distance(emb, emb)  # (N, N)
    target = graph.float()[labels[:, None], labels[None, :]]  # (N, N) A[y_i, y_j]
    mask = (target < margin) | (dist < margin)  # (N, N) s_ij, an indicator: no gradient
    n = emb.size(0)
    return ((dist - target).square() * mask).sum() / (n * n)


def gap_loss(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """Eq. 12: ``1/B sum_b d(u_img_b, u_txt_b)`` over the paired rows of ``(B, D)`` each."""
    return (1.0 - (l2norm(img.float()) * l2norm(txt.float())).sum(-1)).mean()


class HUSE(nn.Module):
    """The HUSE model (see the module docstring). ``inputs`` depends on the config
    (``tfidf`` only with ``use_tfidf``): set per instance, and by :meth:`inputs_for` before
    the model is built."""

    name = "huse"
    Config = HUSEConfig
    inputs = frozenset({"image", "document", "tfidf", "labels"})  # everything it may read

    @classmethod
    def inputs_for(cls, cfg: HUSEConfig) -> frozenset:
        return cls.inputs - ({"tfidf"} if not cfg.use_tfidf else set())

    def __init__(self, cfg: HUSEConfig, info: DataInfo):
        super().__init__()
        self.cfg = cfg
        self.inputs = self.inputs_for(cfg)
        if info.class_distances is None:
            raise ValueError(
                "HUSE's graph loss (eqs. 9-11) needs the semantic graph A from class-name "
                "embeddings: DataInfo.class_distances is None (open the data with a "
                "class_embedder, e.g. Sentence-BERT on the manifest's class names)"
            )
        graph = torch.tensor(info.class_distances, dtype=torch.float32)  # (C, C)
        if info.n_classes <= 0 or graph.shape != (info.n_classes, info.n_classes):
            raise ValueError(
                f"HUSE needs class labels and an n_classes x n_classes class_distances; got "
                f"n_classes={info.n_classes}, class_distances of shape {tuple(graph.shape)}"
            )
        if cfg.use_tfidf and info.tfidf_dim <= 0:
            raise ValueError("use_tfidf is on but DataInfo.tfidf_dim is 0 (no TF-IDF terms)")
        if info.image_dim <= 0 or info.document_dim <= 0:
            raise ValueError(
                f"HUSE needs image_dim and document_dim > 0; got {info.image_dim}, "
                f"{info.document_dim}"
            )
        self.register_buffer("class_distances", graph, persistent=True)  # A (eq. 4)
        text_dim = info.document_dim + (info.tfidf_dim if cfg.use_tfidf else 0)
        self.image_tower = tower(info.image_dim, cfg.image_layers, cfg.hidden, cfg.dropout)
        self.text_tower = tower(text_dim, cfg.text_layers, cfg.hidden, cfg.dropout)
        self.classifier = nn.Linear(cfg.hidden, info.n_classes)  # eq. 6, shared
        self.text_classifier = (
            None if cfg.shared_classifier else nn.Linear(cfg.hidden, info.n_classes)
        )

    def encode_image(self, batch: dict) -> torch.Tensor:
        return l2norm(self.image_tower(batch["image"]))  # (B, D) u_img

    def encode_text(self, batch: dict) -> torch.Tensor:
        x = batch["document"]  # (B, Dd)
        if self.cfg.use_tfidf:
            x = torch.cat([x, batch["tfidf"].to(x.dtype)], dim=-1)  # (B, Dd + V)
        return l2norm(self.text_tower(x))  # (B, D) u_txt

    def similarity(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return cosine_sim(img, txt)  # (n_img, n_txt)

    def classify(
        self, emb: torch.Tensor, side: Literal["image", "text"] | None = None
    ) -> torch.Tensor:
        """Eq. 6: class logits ``(n, C)`` of universal embeddings ``(n, D)``. With the
        paper's shared layer ``side`` is irrelevant; without it, it picks the layer."""
        if self.text_classifier is None:
            return self.classifier(emb)
        if side is None:
            raise ValueError("shared_classifier is off: classify needs side='image' or 'text'")
        return (self.classifier if side == "image" else self.text_classifier)(emb)

    def loss(self, batch: dict) -> dict:
        """Eq. 5. The graph loss runs over the union of the batch's image and text
        embeddings (N = 2B, labels ``[labels, text_labels]``): every universal embedding,
        whatever its modality, should respect the class graph."""
        img = self.encode_image(batch)  # (B, D)
        txt = self.encode_text(batch)  # (B, D)
        labels = torch.cat([batch["labels"], batch["text_labels"]])  # (2B,)
        logits = torch.cat([self.classify(img, "image"), self.classify(txt, "text")])  # (2B, C)
        l_class = class_loss(logits, labels)
        l_graph = graph_loss(torch.cat([img, txt]), labels, self.class_distances, self.cfg.margin)
        l_gap = gap_loss(img, txt)
        total = (
            self.cfg.class_weight * l_class
            + self.cfg.graph_weight * l_graph
            + self.cfg.gap_weight * l_gap
        )
        return {"loss": total, "class": l_class, "graph": l_graph, "gap": l_gap}
