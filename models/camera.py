"""CAMERA: Context-Aware Multi-View Summarization Network for Image-Text Matching (Qu, Liu,
Cao, Nie, Tian; ACM MM 2020).

- AGSA, adaptive gating self-attention (eq. 1-7): multi-head attention whose queries and
  keys are gated by sigmoid masks of the product of their projections, plus a residual.
- Image (sec. 3.2): region FC (eq. 8); the 6-d box code (eq. 9) through an FC and a
  sigmoid (eq. 10), multiplied in; visual AGSA (eq. 11); the pyramid dilated convolutions
  of Table 1 (eq. 12); N view logits and a softmax over the regions (eq. 13); the N views
  ``S^T V`` (eq. 14), each L2-normalised: ``(B, N, D)``.
- Text (sec. 3.3): frozen BERT token features through an FC (eq. 15), textual AGSA
  (eq. 16), an MLP with a residual (eq. 17), the token mean (eq. 18), normalised: ``(B, D)``.
- Score: the best view's cosine (eq. 19). Loss: the MH triplet loss (eq. 20) plus
  ``lambda`` times the diversity term (eq. 21-22); scores and the Gram matrix in float32.

Both loss terms are summed over the batch (official code), the diversity term per image,
so that eq. 22 holds per pair and ``lambda = 0.01`` does not shrink with the batch size.
Padded regions and tokens are masked as attention keys, zeroed before the convolutions,
and excluded from the region softmax (eq. 13), the diversity term and the text mean.

Where the paper and the official code (``LgQu/CAMERA``) differ this file follows the paper,
except, as the official code, for gate maps shared by the heads, a ReLU after each dilated
convolution and the views' max as the score; every difference: ``docs/explanation/models.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt, model_validator
from torch import nn

from infra.config import Section
from models.common import (
    float32_scores,
    hinge_triplet,
    l2norm,
    lengths_mask,
    masked_mean,
    multiview_sim,
)
from models.data.info import DataInfo


class CAMERAConfig(Section):
    """``models.camera``; defaults are the paper's (sec. 4.2, Table 1)."""

    embed_size: PositiveInt = 2048  # D, "the dimension of the joint embedding space" (4.2)
    heads: PositiveInt = 64  # H of both AGSA modules (d_k = d_v = D / H)
    views: PositiveInt = 12  # N summarization views (eq. 13)
    # Table 1: kernel size w^k, dilation r^k and output channels c^k of the K parallel kernels
    kernels: list[PositiveInt] = [1, 3, 3, 3, 5, 5, 5]
    dilations: list[PositiveInt] = [1, 1, 2, 3, 1, 2, 3]
    channels: list[PositiveInt] = [256, 128, 128, 128, 128, 128, 128]
    margin: PositiveFloat = 0.2  # alpha (eq. 20)
    diversity_weight: NonNegativeFloat = 0.01  # lambda (eq. 22)

    @model_validator(mode="after")
    def _check(self) -> CAMERAConfig:
        if self.embed_size % self.heads:
            raise ValueError(
                f"heads ({self.heads}) must divide embed_size ({self.embed_size}): "
                "each AGSA head has D / H dimensions"
            )
        n = {len(self.kernels), len(self.dilations), len(self.channels)}
        if len(n) != 1 or 0 in n:
            raise ValueError(
                "kernels, dilations and channels describe the same pyramid (Table 1): they "
                f"must have the same non-zero length (got {len(self.kernels)}, "
                f"{len(self.dilations)}, {len(self.channels)})"
            )
        even = [k for k in self.kernels if k % 2 == 0]
        if even:
            raise ValueError(
                f"kernels must be odd so that a convolution keeps one output per region "
                f"(got {even})"
            )
        return self


def box_code(
    boxes: torch.Tensor, aspect: torch.Tensor | None = None, eps: float = 1e-3
) -> torch.Tensor:
    """Eq. 9: ``(B, R, 4)`` normalised x1, y1, x2, y2 -> ``(B, R, 6)``
    ``(x/w, y/h, w_i/w, h_i/h, w_i/h_i, w_i h_i / (w h))``. ``w_i/h_i`` is the box's ratio
    in pixels (the normalised ratio times the image's ``aspect (B,)``, width / height); the
    height is clamped at ``eps`` so that a degenerate box gives a finite ratio."""
    x1, y1, x2, y2 = boxes.unbind(-1)  # (B, R) each
    w = (x2 - x1).clamp_min(0)
    h = (y2 - y1).clamp_min(0)
    ratio = w / h.clamp_min(eps)
    if aspect is not None:
        ratio = ratio * aspect.to(ratio)[:, None]
    return torch.stack([x1, y1, w, h, ratio, w * h], dim=-1)  # (B, R, 6)


class AGSA(nn.Module):
    """Adaptive gating self-attention (eq. 1-7) over ``(B, n, D)`` with a key mask.

    Eq. 3: ``Q_i, K_i, V_i = X W_i`` (split into H heads); eq. 4: ``G_i = (Q_i W_G^Q + b) *
    (K_i W_G^K + b)``; eq. 5: ``M_i^{Q,K} = sigmoid(G_i W_M^{Q,K} + b)``; eq. 6: attention
    of the gated queries and keys; eq. 7: ``Concat(h_1..h_H) + X``. The gate maps are
    shared by the heads (the paper writes them without a head index)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.d_k = heads, dim // heads
        self.query = nn.Linear(dim, dim, bias=False)  # W^Q_1..H (eq. 3)
        self.key = nn.Linear(dim, dim, bias=False)  # W^K_1..H
        self.value = nn.Linear(dim, dim, bias=False)  # W^V_1..H
        self.fuse_q = nn.Linear(self.d_k, self.d_k)  # W_G^Q, b_G^Q (eq. 4)
        self.fuse_k = nn.Linear(self.d_k, self.d_k)  # W_G^K, b_G^K
        self.gate_q = nn.Linear(self.d_k, self.d_k)  # W_M^Q, b_M^Q (eq. 5)
        self.gate_k = nn.Linear(self.d_k, self.d_k)  # W_M^K, b_M^K

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x (B, n, D)``, ``mask (B, n)`` True at valid positions -> ``(B, n, D)``."""
        b, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, n, D) -> (B, H, n, d_k)
            return t.view(b, n, self.heads, self.d_k).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        g = self.fuse_q(q) * self.fuse_k(k)  # (B, H, n, d_k), eq. 4
        q = torch.sigmoid(self.gate_q(g)) * q  # M^Q * Q (eq. 5-6)
        k = torch.sigmoid(self.gate_k(g)) * k  # M^K * K
        # eq. 1 with 1/sqrt(d_k); padded keys get no attention
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return h.transpose(1, 2).reshape(b, n, d) + x  # (B, n, D), eq. 7


class Summarization(nn.Module):
    """Multi-view summarization logits (eq. 12-13 before the softmax): the pyramid dilated
    convolutions of Table 1, each with a ReLU (official code; without it eq. 12-13 would be
    one linear map), concatenated, then ``W_s s_i + b_s``."""

    def __init__(self, dim: int, views: int, kernels, dilations, channels):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv1d(dim, c, k, dilation=r, padding=r * (k - 1) // 2)  # same length
            for k, r, c in zip(kernels, dilations, channels, strict=True)
        )
        self.fc = nn.Linear(sum(channels), views)  # W_s, b_s (eq. 13)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """``v (B, R, D)`` with zero padded rows -> ``S~ (B, R, N)``."""
        x = v.transpose(1, 2)  # (B, D, R)
        s = torch.cat([F.relu(conv(x)) for conv in self.convs], dim=1)  # (B, D_s, R), eq. 12
        return self.fc(s.transpose(1, 2))  # (B, R, N)


def diversity(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 21 per image: ``||S^^T S^ - I||_F^2`` with ``S^`` the intermediate importance
    matrix ``S~ (B, R, N)`` L2-normalised over the regions (each view's column); padded
    regions (``mask (B, R)`` False) are zero rows. Returns ``(B,)``; in float32 (the
    view similarities near 1 on the diagonal would round by 2^-8 in bf16)."""
    with float32_scores(logits.device.type):
        s = logits.float().masked_fill(~mask[..., None], 0)  # (B, R, N)
        s = l2norm(s, dim=1)
        gram = s.transpose(1, 2) @ s  # (B, N, N)
        eye = torch.eye(gram.size(-1), device=gram.device, dtype=gram.dtype)
        return (gram - eye).pow(2).sum(dim=(1, 2))  # (B,)


class CAMERA(nn.Module):
    """The CAMERA model (see the module docstring)."""

    name = "camera"
    Config = CAMERAConfig
    inputs = frozenset({"regions", "boxes", "tokens"})

    def __init__(self, cfg: CAMERAConfig, info: DataInfo):
        super().__init__()
        self.cfg = cfg
        d = cfg.embed_size
        # image branch
        self.region_fc = nn.Linear(info.region_dim, d)  # W_v, b_v (eq. 8)
        self.position_fc = nn.Linear(6, d)  # W_p, b_p (eq. 10)
        self.image_agsa = AGSA(d, cfg.heads)  # eq. 11
        self.summarize = Summarization(d, cfg.views, cfg.kernels, cfg.dilations, cfg.channels)
        # text branch (its AGSA is not shared with the image one, sec. 3.3)
        self.token_fc = nn.Linear(info.token_dim, d)  # W_t, b_t (eq. 15)
        self.text_agsa = AGSA(d, cfg.heads)  # eq. 16
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))  # eq. 17

    def _image(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eq. 8-14: ``(views (B, N, D) normalised, logits S~ (B, R, N), mask (B, R))``."""
        regions = batch["regions"]  # (B, R, Dr)
        mask = lengths_mask(batch["region_lengths"].clamp_min(1), regions.size(1))  # (B, R)
        v = self.region_fc(regions)  # (B, R, D), eq. 8
        p = torch.sigmoid(
            self.position_fc(box_code(batch["boxes"], batch.get("image_aspect")).to(v.dtype))
        )  # eq. 9-10
        v = self.image_agsa(v * p, mask)  # (B, R, D), eq. 11
        v = v.masked_fill(~mask[..., None], 0)
        logits = self.summarize(v)  # (B, R, N), S~ of eq. 13
        weights = logits.masked_fill(~mask[..., None], float("-inf")).softmax(dim=1)  # S-bar
        views = weights.transpose(1, 2).to(v.dtype) @ v  # (B, N, D), eq. 14
        return l2norm(views), logits, mask

    def encode_image(self, batch: dict) -> torch.Tensor:
        return self._image(batch)[0]  # (B, N, D)

    def encode_text(self, batch: dict) -> torch.Tensor:
        """Eq. 15-18."""
        tokens = batch["tokens"]  # (B, T, Dt)
        mask = lengths_mask(batch["token_lengths"].clamp_min(1), tokens.size(1))  # (B, T)
        t = self.text_agsa(self.token_fc(tokens), mask)  # (B, T, D), eq. 15-16
        t = self.mlp(t) + t  # eq. 17
        return l2norm(masked_mean(t, mask))  # (B, D), eq. 18

    def similarity(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return multiview_sim(img, txt)  # (n_img, n_txt), eq. 19

    def view_attention(self, batch: dict) -> torch.Tensor:
        """``(B, N, R)``: each view's weights over the regions (S-bar of eq. 13, the softmax
        that eq. 14 sums the regions with; 0 at padded regions)."""
        _, logits, mask = self._image(batch)  # (B, R, N), (B, R)
        weights = logits.masked_fill(~mask[..., None], float("-inf")).softmax(dim=1)
        return weights.transpose(1, 2).nan_to_num(0.0)  # (B, N, R)

    def loss(self, batch: dict) -> dict:
        """Eq. 20-22, each term summed over the batch."""
        img, logits, mask = self._image(batch)
        scores = self.similarity(img, self.encode_text(batch))  # (B, B)
        triplet = hinge_triplet(scores, self.cfg.margin, max_violation=True)  # eq. 20
        div = diversity(logits, mask).sum()  # eq. 21
        loss = triplet + self.cfg.diversity_weight * div  # eq. 22
        return {"loss": loss, "triplet": triplet, "diversity": div}
