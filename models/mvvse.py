"""Multi-View Visual Semantic Embedding (Li, Guo, Feng, Hwang, Xue; IJCAI 2022), applied to
GPO (Chen et al., "Learning the best pooling strategy for visual semantic embedding",
CVPR 2021; vse_infty), as in the paper's experiments ("GPO (MV-VSE)").

- Features (eq. 1): region features through FC + a 2-layer MLP residual (vse_infty's
  ``EncoderImageAggr``, precomp "basic"); words through a BiGRU with its two directions
  averaged, or the stored frozen BERT token features through an FC ("bert" option).
- Aggregators (eq. 2, 4): GPO. K visual GPOs on the same region embeddings give the K
  views v_k; one GPO gives the text embedding t. All L2-normalised.
- Scores: s(v_k, t) cosine (eq. 5), s*(V, T) = max_k s(v_k, t) (eq. 6), used for ranking.
- Losses (summed over the batch, as VSE++): L_MV-Avg-Tri (eq. 8), L_MV-Max-Tri (eq. 9),
  L_MV-Up-Tri (eq. 10) with the indicators of eq. 11-12, and the overall objective
  L_MV-VSE-Tri = lambda L_MV-Max-Tri + (1 - lambda) L_MV-Up-Tri (eq. 15, default);
  ``loss`` selects one of them (the ablation of Table 3). With K = 1 every one of them is
  the VSE++ MH loss (eq. 7).

Eq. 8, 10 and 13 lost their symbols in the text; they are read as ``1/K sum_k`` (so that
eq. 14, L_Max <= L_Up <= L_Up-Rough, holds), the hardest negatives of eq. 10-12 by s* as in
eq. 9, the indicators constants.

Where the paper and the official code (``AAA-Zheng/MV-VSE`` on GPO's ``woodfrog/vse_infty``)
differ this file follows the paper, e.g. K = 3 GPO views and eq. 15 with the indicators of
eq. 11-12; the comparison part by part: ``docs/explanation/mvvse-official-code.md``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, PositiveFloat, PositiveInt, field_validator
from torch import nn

from infra.config import Section
from models.common import (
    GRUText,
    float32_scores,
    full_precision,
    hinge_triplet,
    host_lengths,
    l2norm,
    lengths_mask,
    multiview_sim,
)
from models.data.info import DataInfo

PAD_SCORE = -10000.0  # the reference's stand-in for -inf at padded set positions


class MVVSEConfig(Section):
    """``models.mvvse``; defaults are the paper's (and GPO's where MV-VSE keeps them)."""

    embed_size: PositiveInt = 1024  # d3
    word_dim: PositiveInt = 300
    text_encoder: Literal["bigru", "bert"] = "bigru"
    views: PositiveInt = 3  # K visual aggregators
    margin: PositiveFloat = 0.2  # alpha
    # mv: eq. 15; avg: eq. 8; max: eq. 9; up: eq. 10 (Table 3)
    loss: Literal["mv", "avg", "max", "up"] = "mv"
    lambda_: float = Field(0.7, ge=0.0, le=1.0)  # eq. 15
    gpo_pe_dim: PositiveInt = 32  # d_pe of GPO's positional encoding (even)
    gpo_hidden: PositiveInt = 32  # GPO's BiGRU hidden size
    gpo_temperature: PositiveFloat = 0.1  # softmax temperature of the pooling weights

    @field_validator("gpo_pe_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError("the sinusoidal positional encoding needs an even size")
        return v


# ----------------------------------------------------------------------------- GPO


def positional_encoding(length: int, dim: int, device=None) -> torch.Tensor:
    """``(length, dim)`` sinusoidal encoding of the set index (GPO's ``positional_encoding_1d``)."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    div = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )
    pe = torch.zeros(length, dim, device=device)
    pe[:, 0::2] = torch.sin(position * div)
    pe[:, 1::2] = torch.cos(position * div)
    return pe


class GPO(nn.Module):
    """Generalized Pooling Operator (Chen et al. 2021; the f_v, f_t of eq. 2 and f_v^k of
    eq. 4): ``f({x_n}) = sum_n theta_n * maxk(x, n)``, the n-th largest value of each
    dimension weighted by theta_n. The weights come from the positional encoding of n
    through a BiGRU (directions averaged), a linear score and a softmax with temperature,
    so they are a function of the set size only, never of the feature values.
    """

    def __init__(self, pe_dim: int = 32, hidden: int = 32, temperature: float = 0.1):
        super().__init__()
        self.pe_dim = pe_dim
        self.temperature = temperature
        self.gru = nn.GRU(pe_dim, hidden, 1, batch_first=True, bidirectional=True)
        self.linear = nn.Linear(hidden, 1, bias=False)

    def weights(self, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
        """``(B,) -> (B, L, 1)`` pooling weights theta, zero past each set's length."""
        device = self.linear.weight.device
        mask = lengths_mask(lengths.to(device), max_len)  # (B, L)
        pe = positional_encoding(max_len, self.pe_dim, device)  # (L, P)
        pe = pe.expand(lengths.size(0), -1, -1).masked_fill(~mask[..., None], 0)  # (B, L, P)
        # packed, so the backward direction starts at each set's last element: the weights
        # depend on the set size, not on how much padding the batch has
        packed = nn.utils.rnn.pack_padded_sequence(
            pe, host_lengths(lengths).clamp_min(1), batch_first=True, enforce_sorted=False
        )
        out, _ = self.gru(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=max_len)
        half = out.size(-1) // 2
        out = (out[..., :half] + out[..., half:]) / 2  # (B, L, H), directions averaged
        scores = self.linear(out).masked_fill(~mask[..., None], PAD_SCORE)  # (B, L, 1)
        return torch.softmax(scores.float() / self.temperature, dim=1)  # (B, L, 1)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``(B, L, D), (B,) -> (B, D)``: each dimension sorted descending over the valid
        set elements, then the weighted sum."""
        mask = lengths_mask(lengths.to(features.device), features.size(1))[..., None]  # (B,L,1)
        ordered = features.masked_fill(~mask, PAD_SCORE).sort(dim=1, descending=True)[0]
        ordered = ordered.masked_fill(~mask, 0)  # (B, L, D)
        theta = self.weights(lengths, features.size(1)).to(ordered.dtype)  # (B, L, 1)
        return (ordered * theta).sum(1)  # (B, D)


# ----------------------------------------------------------------------------- encoders


class RegionEncoder(nn.Module):
    """Region features -> ``fc(x) + mlp(x)`` (vse_infty's precomp "basic" encoder): the
    shared visual feature set {phi_n} of eq. 1 in the embedding size."""

    def __init__(self, region_dim: int, embed_size: int):
        super().__init__()
        self.fc = nn.Linear(region_dim, embed_size)
        hidden = embed_size // 2
        self.mlp_in = nn.Linear(region_dim, hidden)
        self.mlp_bn = nn.BatchNorm1d(hidden)
        self.mlp_out = nn.Linear(hidden, embed_size)
        # Xavier init of the FC, as in the reference code
        r = math.sqrt(6.0) / math.sqrt(region_dim + embed_size)
        nn.init.uniform_(self.fc.weight, -r, r)
        nn.init.zeros_(self.fc.bias)

    def forward(self, regions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = lengths_mask(lengths.to(regions.device), regions.size(1))  # (B, R)
        h = self.mlp_in(regions)  # (B, R, D/2)
        # batch statistics over the valid regions only, so padding does not shift them
        normed = torch.zeros_like(h)
        normed[mask] = self.mlp_bn(h[mask]).to(h.dtype)
        mlp = self.mlp_out(torch.relu(normed))  # (B, R, D)
        return self.fc(regions) + mlp  # (B, R, D)


# ----------------------------------------------------------------------------- losses


def view_scores(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """Eq. 5 for every pair: ``(B, K, D) x (B, D) -> (B, B, K)`` s(v_k, t) of image i,
    caption c, view k; in float32 under autocast (they enter the hinges)."""
    with float32_scores(img.device.type):
        img, txt = full_precision(img, txt)
        return torch.einsum("ivd,td->itv", img, txt)


def _hardest_negatives(star: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``s* (B, B) -> (B,), (B,)``: s*(V, T^) for each image row and s*(V^, T) for each
    caption column, the hardest negatives by s* within the batch (eq. 9-12)."""
    eye = torch.eye(star.size(0), dtype=torch.bool, device=star.device)
    masked = star.masked_fill(eye, torch.finfo(star.dtype).min)
    return masked.amax(1), masked.amax(0)


def mv_max_triplet(scores: torch.Tensor, margin: float) -> torch.Tensor:
    """L_MV-Max-Tri (eq. 9): VSE++'s MH loss on s* = max_k s(v_k, t). ``scores (B, B, K)``,
    image i, caption c, view k; positives on the diagonal. Summed over the batch."""
    return hinge_triplet(scores.amax(-1), margin, max_violation=True)


def mv_avg_triplet(scores: torch.Tensor, margin: float) -> torch.Tensor:
    """L_MV-Avg-Tri (eq. 8): the MH loss of each view, hardest negatives in that view,
    averaged over the K views. Summed over the batch."""
    k = scores.size(-1)
    return sum(hinge_triplet(scores[..., v], margin, max_violation=True) for v in range(k)) / k


def up_indicators(scores: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 11-12: ``(B,)`` booleans per positive pair b. 1(V, T^) is true iff every view
    violates ``alpha - s(v_k, t) + s*(V, T^) > 0``; 1(V^, T) likewise with s*(V^, T)."""
    neg_caption, neg_image = _hardest_negatives(scores.amax(-1))  # (B,), (B,)
    pos = scores.diagonal(dim1=0, dim2=1).t()  # (B, K): s(v_k, t) of pair b
    ind_caption = (margin - pos + neg_caption[:, None] > 0).all(1)
    ind_image = (margin - pos + neg_image[:, None] > 0).all(1)
    return ind_caption, ind_image


def mv_up_triplet(scores: torch.Tensor, margin: float) -> torch.Tensor:
    """L_MV-Up-Tri (eq. 10): ``1/K sum_k [alpha - s(v_k, t) + s*(V, T^)]_+ 1(V, T^) +
    [alpha - s(v_k, t) + s*(V^, T)]_+ 1(V^, T)``, the hardest negatives by s* (eq. 9) and
    the indicators of eq. 11-12 (constants). Summed over the batch."""
    neg_caption, neg_image = _hardest_negatives(scores.amax(-1))  # (B,), (B,)
    pos = scores.diagonal(dim1=0, dim2=1).t()  # (B, K)
    ind_caption, ind_image = up_indicators(scores, margin)
    cost_caption = (margin - pos + neg_caption[:, None]).clamp(min=0)  # (B, K)
    cost_image = (margin - pos + neg_image[:, None]).clamp(min=0)  # (B, K)
    per_pair = cost_caption * ind_caption[:, None] + cost_image * ind_image[:, None]
    return per_pair.mean(1).sum()


# ----------------------------------------------------------------------------- model


class MVVSE(nn.Module):
    """GPO (MV-VSE): K visual GPO views, one text embedding (see the module docstring)."""

    name = "mvvse"
    Config = MVVSEConfig
    # everything this model may read; an instance's ``inputs`` (and ``inputs_for(cfg)``,
    # usable before the model can be built) name the text option its config selects
    inputs = frozenset({"regions", "words", "tokens"})

    @staticmethod
    def inputs_for(cfg: MVVSEConfig) -> frozenset[str]:
        return frozenset({"regions", "words" if cfg.text_encoder == "bigru" else "tokens"})

    def __init__(self, cfg: MVVSEConfig, info: DataInfo):
        super().__init__()
        self.cfg = cfg
        self.inputs = self.inputs_for(cfg)  # read by the data layer
        gpo = dict(pe_dim=cfg.gpo_pe_dim, hidden=cfg.gpo_hidden, temperature=cfg.gpo_temperature)
        self.regions = RegionEncoder(info.region_dim, cfg.embed_size)
        self.views = nn.ModuleList(GPO(**gpo) for _ in range(cfg.views))  # f_v^k (eq. 4)
        if cfg.text_encoder == "bigru":
            self.words = GRUText(info.vocab_size, cfg.word_dim, cfg.embed_size, bidirectional=True)
        else:
            self.token_fc = nn.Linear(info.token_dim, cfg.embed_size)
        self.text_gpo = GPO(**gpo)  # f_t (eq. 2)

    def encode_image(self, batch: dict) -> torch.Tensor:
        """``(B, K, D)``: the K normalised views v_k (eq. 4)."""
        lengths = batch["region_lengths"]
        feats = self.regions(batch["regions"], lengths)  # (B, R, D)
        return l2norm(torch.stack([gpo(feats, lengths) for gpo in self.views], 1))  # (B, K, D)

    def encode_text(self, batch: dict) -> torch.Tensor:
        """``(B, D)``: the normalised text embedding t (eq. 2)."""
        if self.cfg.text_encoder == "bigru":
            lengths = batch["word_lengths"]
            feats = self.words(batch["words"], lengths, pool=False)  # (B, L, D)
        else:
            lengths = batch["token_lengths"]
            feats = self.token_fc(batch["tokens"])  # (B, T, D)
        return l2norm(self.text_gpo(feats, lengths))  # (B, D)

    def similarity(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return multiview_sim(img, txt)  # (n_img, n_txt): s* of eq. 6

    def view_attention(self, batch: dict) -> torch.Tensor:
        """``(B, K, R)``: the cosine similarity of each region's feature with each view's
        embedding, what MV-VSE's Fig. 5 draws (0 at padded regions)."""
        lengths = batch["region_lengths"]
        feats = self.regions(batch["regions"], lengths)  # (B, R, D)
        views = l2norm(torch.stack([gpo(feats, lengths) for gpo in self.views], 1))  # (B, K, D)
        attention = views @ l2norm(feats).transpose(1, 2)  # (B, K, R)
        return attention * lengths_mask(lengths, feats.size(1))[:, None, :]

    def loss(self, batch: dict) -> dict:
        img, txt = self.encode_image(batch), self.encode_text(batch)  # (B, K, D), (B, D)
        scores = view_scores(img, txt)  # (B, B, K): s(v_k, t), eq. 5
        margin, loss = self.cfg.margin, self.cfg.loss
        single = {"avg": mv_avg_triplet, "max": mv_max_triplet, "up": mv_up_triplet}
        if loss in single:
            return {"loss": single[loss](scores, margin)}
        max_, up = mv_max_triplet(scores, margin), mv_up_triplet(scores, margin)
        lam = self.cfg.lambda_
        return {"loss": lam * max_ + (1 - lam) * up, "max": max_.detach(), "up": up.detach()}
