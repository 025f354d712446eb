"""VSE++: Improving Visual-Semantic Embeddings with Hard Negatives (Faghri et al., BMVC
2018).

- Image: f(i) = W_f^T phi(i) (eq. 1), phi the precomputed global CNN feature, normalised.
- Caption: g(c) = W_g^T mu(c) (eq. 2), mu a GRU over word embeddings (its last state),
  normalised.
- Score: s(i, c) = f(i) . g(c) (eq. 3), in float32 under autocast.
- Loss: the hinge triplet loss, SH (eq. 5) or MH (eq. 6, default), margin 0.2.

As the official code (``fartashf/vsepp``), the loss is summed over the batch (eq. 4 writes a
mean) and W_g is folded into the GRU's output size; as the paper, phi(i) is projected as
stored. Every difference: ``docs/explanation/models.md``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import PositiveFloat, PositiveInt
from torch import nn

from infra.config import Section
from models.common import GRUText, dot_sim, hinge_triplet, l2norm
from models.data.info import DataInfo


class VSEPPConfig(Section):
    """``models.vsepp``; defaults are the paper's."""

    embed_size: PositiveInt = 1024
    word_dim: PositiveInt = 300
    margin: PositiveFloat = 0.2
    loss: Literal["mh", "sh"] = "mh"  # max of hinges (eq. 6) or sum of hinges (eq. 5)


class VSEPP(nn.Module):
    """The VSE++ model (see the module docstring)."""

    name = "vsepp"
    Config = VSEPPConfig
    inputs = frozenset({"image", "words"})

    def __init__(self, cfg: VSEPPConfig, info: DataInfo):
        super().__init__()
        self.cfg = cfg
        self.image_fc = nn.Linear(info.image_dim, cfg.embed_size)  # W_f (eq. 1)
        self.text = GRUText(info.vocab_size, cfg.word_dim, cfg.embed_size)  # mu, W_g (eq. 2)
        # Xavier init of W_f, as in the reference code
        r = (6.0 / (info.image_dim + cfg.embed_size)) ** 0.5
        nn.init.uniform_(self.image_fc.weight, -r, r)
        nn.init.zeros_(self.image_fc.bias)

    def encode_image(self, batch: dict) -> torch.Tensor:
        return l2norm(self.image_fc(batch["image"]))  # (B, D)

    def encode_text(self, batch: dict) -> torch.Tensor:
        return l2norm(self.text(batch["words"], batch["word_lengths"]))  # (B, D)

    def similarity(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        """s(i, c) = f(i) . g(c) (eq. 3): both are L2-normalised by ``encode_*``; in
        float32 under autocast (the hinge compares scores with the margin)."""
        return dot_sim(img, txt)  # (n_img, n_txt)

    def loss(self, batch: dict) -> dict:
        scores = self.similarity(self.encode_image(batch), self.encode_text(batch))
        return {"loss": hinge_triplet(scores, self.cfg.margin, self.cfg.loss == "mh")}
