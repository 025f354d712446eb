"""Evaluation under one protocol for every model (no per-model branches).

- Retrieval on the whole split and, when it holds two folds or more, the COCO 1K protocol
  (folds of ``fold_size`` = 1000 images, metrics averaged); another fold size is warned,
  and the images left out and the fold's chance level are reported.
- Robustness to adversarial captions (UniVSE 4.2): per attack (object, attribute,
  relation) the fakes join the real captions as image-to-text candidates, never as truth.
- Models with ``classify(embedding, side)`` (HUSE) also get classification accuracy
  (image, text, fused with the weight of :func:`fusion_weight` and with equal weights) and
  class-level R@K in four directions.

A NaN or infinite embedding or score is an error naming the image or caption.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Literal

import numpy as np
import torch
from pydantic import Field, PositiveInt, model_validator

from infra.config import Section
from infra.device import Device, autocast
from infra.finite import NonFiniteError, finite_rows
from models.data.info import DataError
from models.metrics import KS, fold_metrics, i2t_metrics, retrieval_metrics, similarity_matrix

COCO_1K = 1000  # images per fold of the COCO 1K protocol (the 5K test split in 5 folds)


class EvaluateConfig(Section):
    """``evaluate`` section of params.yaml."""

    split: Literal["val", "test"] = "test"
    # COCO 1K: folds of this many images (when >= 2 fit); null: the whole split only
    fold_size: int | None = Field(COCO_1K, ge=1)
    batch_size: PositiveInt = 256
    device: Device = "auto"
    num_workers: int = Field(0, ge=0, le=64)  # batch-building processes (0: a thread)
    prefetch: int = Field(2, ge=0, le=64)  # batches built ahead (per worker)

    @model_validator(mode="after")
    def _workers_prefetch(self) -> EvaluateConfig:
        if self.num_workers and not self.prefetch:
            raise ValueError("workers build at least one batch ahead: prefetch >= 1")
        return self


@torch.no_grad()
def _encode(model, data, kind: str, n: int, batch_size: int, device, batches) -> torch.Tensor:
    """``model.encode_<kind>`` of items ``0..n-1`` of ``data``, read through the data path of
    training (``batches``, a :class:`models.data.batches.Batches` of ``data``, or a new one
    on a thread); a non-finite embedding is refused."""
    from models.data.batches import Batches

    idx = np.arange(n)
    tasks = [(kind, idx[i : i + batch_size]) for i in range(0, n, batch_size)]
    out = []
    with nullcontext(batches) if batches is not None else Batches(data, device) as b:
        for batch in b.run(tasks):
            with autocast(b.device):
                out.append(getattr(model, f"encode_{kind}")(batch).float())
    emb = torch.cat(out)
    what = "image" if kind == "image" else "caption"
    refuse_non_finite_embeddings(emb, getattr(data, f"{what}_keys", None), what)
    return emb


def refuse_non_finite_embeddings(embeddings: torch.Tensor, keys, what: str) -> None:
    """One line naming the first ``what`` (image or caption) whose embedding holds NaN or
    infinite values, by key when ``keys`` are known, else by position."""
    finite = finite_rows(embeddings)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    name = repr(keys[bad[0]]) if keys is not None else str(bad[0])
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise NonFiniteError(
        f"the embedding of {what} {name} holds NaN or infinite values{more}; check that "
        f"{what}'s features in its store (vse store verify) and the checkpoint's weights"
    )


def encode_images(model, data, batch_size: int, device, batches=None) -> torch.Tensor:
    """``(n_images, ...)`` image embeddings of ``data`` (a ``Batches`` of it, or a thread)."""
    return _encode(model, data, "image", data.n_images, batch_size, device, batches)


def encode_texts(model, data, batch_size: int, device, n: int | None = None, batches=None):
    """``(n_captions, D)`` caption embeddings of ``data`` (the first ``n`` if given)."""
    n = len(data) if n is None else n
    return _encode(model, data, "text", n, batch_size, device, batches)


def evaluate_split(model, data, batch_size: int, device, batches=None) -> dict[str, float]:
    """Retrieval metrics of ``model`` on all images and captions of ``data`` (read through
    ``batches``, a :class:`models.data.batches.Batches` of ``data``, or a new one)."""
    model.eval()
    img = encode_images(model, data, batch_size, device, batches)
    txt = encode_texts(model, data, batch_size, device, batches=batches)
    sims = similarity_matrix(model.similarity, img, txt)
    return retrieval_metrics(sims, torch.from_numpy(data.caption_image).to(sims.device))


def _class_retrieval(query, gallery, q_labels, g_labels, same_set: bool) -> dict[str, float]:
    """R@K where a hit is any of the top K sharing the query's class (self excluded)."""
    sims = query @ gallery.t()
    if same_set:
        sims.fill_diagonal_(-torch.inf)
    # at most the gallery less the query itself: never the self-match, even in a small set
    top = sims.topk(min(max(KS), sims.shape[1] - int(same_set)), dim=1).indices  # (Q, <= 10)
    hits = g_labels[top] == q_labels[:, None]
    return {f"r{k}": float(100.0 * hits[:, :k].any(1).double().mean()) for k in KS}


FUSION_GRID = tuple(i / 20 for i in range(21))  # image weights tried: 0, 0.05, .., 1


def _softmaxes(model, img, txt) -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities of the images ``(n_images, C)`` and captions ``(n_captions, C)``."""
    with torch.no_grad():
        p_img = model.classify(img, "image").float().softmax(-1)
        p_txt = model.classify(txt, "text").float().softmax(-1)
    return p_img, p_txt


def _fused_accuracy(p_img, p_txt, data, w: float) -> float:
    """Accuracy of ``w p_img + (1 - w) p_txt`` over the captions, each with its image."""
    device = p_txt.device
    p = w * p_img[torch.from_numpy(data.caption_image).to(device)] + (1 - w) * p_txt
    truth = torch.from_numpy(data.labels[data.caption_image]).to(device)
    return float(100.0 * (p.argmax(1) == truth).double().mean())


def fusion_weight(model, img, txt, data) -> float:
    """HUSE sec. 4.5's fusion weight of the image softmax, which the paper does not state:
    the one of :data:`FUSION_GRID` with the best fused accuracy on ``data`` (the val
    split's, with its embeddings ``img``, ``txt``); ties go to the weight nearest 0.5
    (equal weights), then the smaller."""
    p_img, p_txt = _softmaxes(model, img, txt)
    accuracy = {w: _fused_accuracy(p_img, p_txt, data, w) for w in FUSION_GRID}
    best = max(accuracy.values())
    return min((w for w, a in accuracy.items() if a == best), key=lambda w: (abs(w - 0.5), w))


def val_fusion_weight(model, data, embeddings, cfg, device) -> float:
    """:func:`fusion_weight` on the val split (the paper gives none), to apply to ``data``
    (embedded as ``embeddings``); equal weights, warned, when the manifest has no val split."""
    if data.split == "val":
        return fusion_weight(model, *embeddings, data)
    try:
        val = data.other_split("val")
    except DataError as err:
        warnings.warn(f"{err}: the fused accuracy weighs image and text equally", stacklevel=2)
        return 0.5
    return fusion_weight(model, *embed(model, val, cfg, device), val)


def classification_metrics(model, img, txt, data, w: float = 0.5) -> dict:
    """HUSE's evaluation: accuracy per modality, fused with the image weight ``w`` (see
    :func:`fusion_weight`) and with equal weights, class-level retrieval."""
    device = img.device
    labels = torch.from_numpy(data.labels).to(device)
    text_labels = torch.from_numpy(data.labels[data.caption_image]).to(device)
    p_img, p_txt = _softmaxes(model, img, txt)  # (n_images, C), (n_captions, C)
    out = {
        "accuracy_image": float(100.0 * (p_img.argmax(1) == labels).double().mean()),
        "accuracy_text": float(100.0 * (p_txt.argmax(1) == text_labels).double().mean()),
        "accuracy_fused": _fused_accuracy(p_img, p_txt, data, w),
        "accuracy_fused_equal": _fused_accuracy(p_img, p_txt, data, 0.5),
        "fusion_weight_image": w,
    }
    pairs = {
        "image_to_text": (img, txt, labels, text_labels, False),
        "text_to_image": (txt, img, text_labels, labels, False),
        "image_to_image": (img, img, labels, labels, True),
        "text_to_text": (txt, txt, text_labels, text_labels, True),
    }
    for name, args in pairs.items():
        for k, v in _class_retrieval(*args).items():
            out[f"class_{name}_{k}"] = v
    return out


def adversarial_metrics(
    model, img, txt, data, adversarial, batch_size, device, batches=None
) -> dict:
    """Image-to-text retrieval with each attack's fake captions added as candidates,
    ranked a block of images at a time (:func:`models.metrics.i2t_metrics`)."""
    fake = encode_texts(model, adversarial, batch_size, device, batches=batches)
    real = torch.from_numpy(data.caption_image).to(device)
    out = {}
    for attack in sorted(set(adversarial.attacks)):
        cols = torch.from_numpy(np.flatnonzero(adversarial.attacks == attack)).to(device)
        candidates = torch.cat([txt, fake[cols]])
        c2i = torch.cat([real, torch.full((len(cols),), -1, dtype=torch.long, device=device)])
        out[attack] = i2t_metrics(model.similarity, img, candidates, c2i)
        out[attack]["fake_captions"] = len(cols)
    return out


def embed(model, data, cfg: EvaluateConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image and caption embedding of ``data`` (read by ``cfg.num_workers``)."""
    from models.data.batches import Batches

    model.eval()
    options = {"num_workers": cfg.num_workers, "prefetch": cfg.prefetch}
    with Batches(data, device, **options) as batches:
        img = encode_images(model, data, cfg.batch_size, device, batches)
        txt = encode_texts(model, data, cfg.batch_size, device, batches=batches)
    return img, txt


def evaluate_model(
    model, data, cfg: EvaluateConfig, device, adversarial=None, embeddings=None
) -> dict:
    """Everything ``vse evaluate`` reports for one model on one split (``embeddings``: the
    split's ``(img, txt)`` if already computed, see :func:`embed`)."""
    from models.data.batches import Batches

    options = {"num_workers": cfg.num_workers, "prefetch": cfg.prefetch}
    img, txt = embeddings if embeddings is not None else embed(model, data, cfg, device)
    sims = similarity_matrix(model.similarity, img, txt)
    c2i = torch.from_numpy(data.caption_image).to(device)
    report: dict = {
        "split": data.split,
        "images": data.n_images,
        "captions": len(data),
        "full": retrieval_metrics(sims, c2i),
    }
    n_folds = data.n_images // cfg.fold_size if cfg.fold_size else 0
    if n_folds >= 2:
        size = cfg.fold_size
        if size != COCO_1K:
            warnings.warn(
                f"evaluate.fold_size: folds of {size} images are not the COCO 1K protocol "
                f"({COCO_1K}); their figures compare with no paper (null: no folds)",
                stacklevel=2,
            )
        report["folds"] = {
            "fold_size": size,
            "n_folds": n_folds,
            "captions": int((c2i < n_folds * size).sum()),  # the folds' captions
            "left_out": data.n_images - n_folds * size,  # images after the last whole fold
        }
        report["folds"].update(fold_metrics(sims, c2i, size))
    if hasattr(model, "classify"):
        w = val_fusion_weight(model, data, (img, txt), cfg, device)
        report["classification"] = classification_metrics(model, img, txt, data, w)
    if adversarial is not None:
        with Batches(adversarial, device, **options) as batches:
            report["adversarial"] = adversarial_metrics(
                model, img, txt, data, adversarial, cfg.batch_size, device, batches
            )
    return report
