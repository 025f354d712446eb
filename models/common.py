"""The few helpers every model file shares: the loop settings, normalisation, masking,
pooling, float32 scores and VSE++'s hardest-negative hinge. A few lines repeated in a model
file are preferred to growing this module into a base class."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)
from torch import nn

from infra.config import Section, Seed
from infra.device import Device


class TrainConfig(Section):
    """``train``: the loop settings shared by every model (``models.<name>`` holds each
    model's own). Batches are built ahead by ``num_workers`` processes (0: a thread),
    ``prefetch`` ahead each (0 with no workers: in the loop); ``shards`` (from ``vse shards
    build``) streams the same samples instead of reading the stores."""

    epochs: PositiveInt = 30
    batch_size: PositiveInt = 128
    lr: PositiveFloat = 2e-4
    lr_decay_epochs: list[PositiveInt] = [15]  # multiply the LR by lr_decay at these epochs
    lr_decay: float = Field(0.1, gt=0.0, le=1.0)
    warmup_steps: NonNegativeInt = 0  # linear warm-up from 0 over this many optimizer steps
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: PositiveFloat = 2.0  # max global L2 norm of the gradients
    num_workers: int = Field(0, ge=0, le=64)  # batch-building worker processes
    prefetch: int = Field(2, ge=0, le=64)  # batches built ahead (per worker)
    shards: str | None = None  # null: the stores; else a shards folder or s3:// URL
    shuffle_buffer: int = Field(8192, ge=1, le=10_000_000)  # captions (shards only)
    seed: Seed = 0
    device: Device = "auto"  # auto | cpu | cuda | cuda:N
    eval_batch_size: PositiveInt = 256
    # image inputs as (x - mean) / std with train statistics (kept in the checkpoint);
    # for features dominated by one shared mean, such as random-init CNN features
    standardize: bool = False
    # last.pt also within an epoch (resumable at the next batch): every this many steps,
    # every this many minutes (0: never); SIGTERM/SIGINT always write it (exit status 75)
    checkpoint_every_steps: NonNegativeInt = 0
    checkpoint_every_minutes: NonNegativeFloat = 0.0
    # a model's own loop settings over the ones above, e.g. {camera: {lr: 1.0e-4}}: the
    # papers train with different schedules (vse init writes them)
    per_model: dict[str, dict[str, Any]] = {}

    @model_validator(mode="after")
    def _workers_prefetch(self) -> TrainConfig:
        if self.num_workers and not self.prefetch:
            raise ValueError("workers build at least one batch ahead: prefetch >= 1")
        fields = set(type(self).model_fields) - {"per_model"}
        for name, override in self.per_model.items():
            unknown = sorted(set(override) - fields)
            if unknown:
                raise ValueError(f"per_model.{name}: {', '.join(unknown)}: not a train setting")
            try:
                self.for_model(name)
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(map(str, first["loc"]))
                raise ValueError(f"per_model.{name}.{where}: {first['msg']}") from None
        return self

    def for_model(self, name: str) -> TrainConfig:
        """These settings with ``per_model[name]`` over them (validated)."""
        base = self.model_dump(exclude={"per_model"})
        return type(self).model_validate(base | self.per_model.get(name, {}))


def full_precision(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in float32, for scores computed under :func:`float32_scores`."""
    return tuple(t.float() for t in tensors)


def float32_scores(device_type: str):
    """Autocast off: similarities that enter a hinge or a softmax are computed in float32
    from the (possibly bf16) embeddings, whose 8 bits of mantissa would resolve margins of
    0.2 between scores near 1 only to ~0.004."""
    return torch.autocast(device_type, enabled=False)


def host_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Lengths on the host, for packing sequences: the copy that
    :func:`models.data.to_device` keeps (no device sync), else ``lengths.cpu()``."""
    if lengths.device.type == "cpu":
        return lengths
    host = getattr(lengths, "host", None)
    return host if host is not None else lengths.cpu()


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """``x / ||x||_2`` along ``dim``."""
    return x / x.norm(dim=dim, keepdim=True).clamp_min(eps)


def dot_sim(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """``(n_img, D) x (n_txt, D) -> (n_img, n_txt)`` inner products, in float32 (see
    :func:`float32_scores`)."""
    with float32_scores(img.device.type):
        img, txt = full_precision(img, txt)
        return img @ txt.t()


def cosine_sim(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """``(n_img, D) x (n_txt, D) -> (n_img, n_txt)`` inner products of normalised
    vectors, in float32."""
    with float32_scores(img.device.type):
        img, txt = full_precision(img, txt)
        return l2norm(img) @ l2norm(txt).t()


def multiview_sim(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """``(n_img, V, D) x (n_txt, D) -> (n_img, n_txt)``: the best view per pair (the
    max-over-views score of MV-VSE eq. 6 and CAMERA eq. 19); inputs already normalised.
    In float32; one view at a time, so memory stays one (n_img, n_txt) matrix plus one
    temporary."""
    with float32_scores(img.device.type):
        img, txt = full_precision(img, txt)
        txt_t = txt.t()
        scores = img[:, 0] @ txt_t
        for v in range(1, img.shape[1]):
            scores = torch.maximum(scores, img[:, v] @ txt_t)
        return scores


def lengths_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``(B,) -> (B, L)`` True at valid positions."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``(B, L, D)`` over the valid positions of ``mask (B, L)``."""
    mask = mask.to(x.dtype).unsqueeze(-1)
    return (x * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def hinge_triplet(scores: torch.Tensor, margin: float, max_violation: bool) -> torch.Tensor:
    """VSE++ ranking loss: MH (eq. 6) with ``max_violation``, else SH (eq. 5), on ``scores
    (B, B)`` s(i, c) with positives on the diagonal: ``[margin - s(i,c) + s(i,c')]_+`` over
    negative captions c' plus ``[margin - s(i,c) + s(i',c)]_+`` over negative images i' (or
    the hardest of each); summed over the batch as the official ``ContrastiveLoss``."""
    diagonal = scores.diag().view(-1, 1)
    cost_caption = (margin + scores - diagonal).clamp(min=0)  # (B, B): row i, caption c'
    cost_image = (margin + scores - diagonal.t()).clamp(min=0)  # (B, B): image i', column c
    eye = torch.eye(scores.size(0), dtype=torch.bool, device=scores.device)
    cost_caption = cost_caption.masked_fill(eye, 0)
    cost_image = cost_image.masked_fill(eye, 0)
    if max_violation:
        return cost_caption.max(1)[0].sum() + cost_image.max(0)[0].sum()
    return cost_caption.sum() + cost_image.sum()


class GRUText(nn.Module):
    """Word ids -> embedding -> (Bi)GRU -> the hidden state at each caption's last word
    (VSE++'s mu(c) of eq. 2), or every word's with ``pool=False`` (MV-VSE). The BiGRU
    averages its two directions as SCAN's ``EncoderText``; word embeddings start
    U(-0.1, 0.1) as in VSE++'s and SCAN's."""

    def __init__(
        self, vocab_size: int, word_dim: int, embed_size: int, bidirectional: bool = False
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        self.rnn = nn.GRU(word_dim, embed_size, batch_first=True, bidirectional=bidirectional)
        self.bidirectional = bidirectional
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, words: torch.Tensor, lengths: torch.Tensor, pool: bool = True):
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(words),
            host_lengths(lengths).clamp_min(1),
            batch_first=True,
            enforce_sorted=False,
        )
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=words.size(1))
        if self.bidirectional:  # (B, L, 2D) -> (B, L, D)
            half = out.size(-1) // 2
            out = (out[..., :half] + out[..., half:]) / 2
        if not pool:
            return out  # (B, L, D)
        last = (lengths.clamp_min(1) - 1).to(out.device)
        return out[torch.arange(out.size(0), device=out.device), last]  # (B, D)
