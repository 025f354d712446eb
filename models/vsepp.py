"""VSE++: Improving Visual-Semantic Embeddings with Hard Negatives (Faghri et al., BMVC
2018).

- Image: f(i) = W_f^T phi(i) (eq. 1), phi the precomputed global CNN feature (the
  paper's fixed-feature setting), then L2 normalisation.
- Caption: g(c) = W_g^T mu(c) (eq. 2), mu a GRU over word embeddings, the final hidden
  state (W_g is folded into the GRU's output size as in the reference code), normalised.
- Score: s(i, c) = f(i) . g(c) (eq. 3), in float32 under autocast.
- Loss: the hinge triplet loss summed over the batch, SH (eq. 5) or MH (eq. 6, default),
  margin alpha = 0.2.

Paper vs official code (``fartashf/vsepp``: ``model.py``, ``train.py``). The paper text here is
an excerpt (sec. 1-2 and the conclusion), so training settings are the official code's.

- Loss reduction. Paper eq. 4: the empirical loss is the mean over the N training pairs.
  Official ``ContrastiveLoss.forward`` returns ``cost_s.sum() + cost_im.sum()``: summed over
  the batch. Ours sums (``common.hinge_triplet``), so that ``train.grad_clip = 2.0`` (the
  official ``--grad_clip``) acts on a loss of the official scale.
- W_g. Paper eq. 2 projects the GRU state mu(c) with W_g. Official ``EncoderText`` has no
  layer after the GRU: its hidden size is the embedding size. Ours does the same.
- Image feature. Paper eq. 1 projects phi(i) as it is. Official ``EncoderImageFull.forward``
  L2-normalises phi(i) before the FC, and ``EncoderImagePrecomp.forward`` assumes precomputed
  features that are "already l2-normalized". Ours projects the stored global feature as it
  is (or standardised, ``train.standardize``): the paper's eq. 1.
- Initialisation (the paper is silent): Xavier-uniform W_f with zero bias
  (``EncoderImagePrecomp.init_weights``) and word embeddings U(-0.1, 0.1)
  (``EncoderText.init_weights``), as in the official code.
- MH or SH. Official ``train.py`` trains SH unless ``--max_violation`` is given; VSE++ is the
  MH loss, our default (``loss: mh``).
- Training (official ``train.py``): Adam, lr 2e-4, x0.1 after 15 epochs (``--lr_update``),
  30 epochs, batch 128, gradient norm clipped at 2, the best validation rsum (R@1+5+10 both
  ways) kept. These are the defaults of our ``train`` section (AdamW with weight_decay 0 is
  Adam).
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
