"""Under bf16 autocast (CPU here, CUDA in training) the similarities that enter a hinge or
a softmax are computed in float32: each loss on bf16 embeddings equals the float32 loss
on the same values, and picks the same hardest negatives, while scores rounded to bf16
would change both."""

import pytest
import torch

from models.camera import CAMERA, CAMERAConfig
from models.common import hinge_triplet
from models.data import DataInfo
from models.mvvse import MVVSE, MVVSEConfig, view_scores
from models.univse import ranking_loss, region_alignment, relation_loss
from models.vsepp import VSEPP, VSEPPConfig

B, D, K = 128, 512, 3
INFO = DataInfo(image_dim=8, region_dim=8, token_dim=8, vocab_size=10)


def embeddings(*shape, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Trained-like normalised embeddings: a shared direction plus a per-pair one, so
    that negatives score ~0.8 and lie closer together than bf16's step there (2^-8)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(D, generator=g)
    pair = torch.randn(B, *shape[1:-1], D, generator=g) if len(shape) > 2 else None
    own = torch.randn(B, D, generator=g)
    img = common + 0.35 * own.reshape(B, *([1] * (len(shape) - 2)), D)
    if pair is not None:
        img = img + 0.1 * pair
    txt = common + 0.35 * own + 0.2 * torch.randn(B, D, generator=g)
    norm = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    # values that bf16 holds exactly: what a bf16 encoder hands to the loss
    return norm(img).bfloat16().float(), norm(txt).bfloat16().float()


def run(loss_of, tensors, bf16: bool):
    """The loss and its gradients for ``tensors``: float32 leaves, or under CPU bf16
    autocast with bf16 inputs (as bf16 encoders give)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        inputs = [leaf.bfloat16() if bf16 else leaf for leaf in leaves]
        loss = loss_of(*inputs)
    loss.backward()
    return loss.detach().float(), [leaf.grad for leaf in leaves]


def compare(loss_of, tensors, rtol=1e-5):
    ref, ref_grads = run(loss_of, tensors, bf16=False)
    got, got_grads = run(loss_of, tensors, bf16=True)
    torch.testing.assert_close(got, ref, rtol=rtol, atol=1e-4)
    assert any(r.norm() > 0 for r in ref_grads)
    for g, r in zip(got_grads, ref_grads, strict=True):
        # gradients of bf16 embeddings are bf16 (8 bits): ~0.4% per element, <1% in norm
        assert float((g - r).norm()) <= 0.01 * float(r.norm())


def patched(model, **encoders):
    for name, value in encoders.items():
        setattr(model, name, value)
    return model


@pytest.mark.parametrize("name", ["vsepp", "mvvse", "camera"])
def test_model_losses_under_bf16_autocast_equal_float32(name):
    if name == "vsepp":
        img, txt = embeddings(B, D)
        model = VSEPP(VSEPPConfig(embed_size=D), INFO)
    elif name == "mvvse":
        img, txt = embeddings(B, K, D)
        model = MVVSE(MVVSEConfig(embed_size=D, views=K), INFO)
    else:
        img, txt = embeddings(B, K, D)
        model = CAMERA(CAMERAConfig(embed_size=D, heads=8, views=K), INFO)
    logits = torch.randn(B, 4, K)
    mask = torch.ones(B, 4, dtype=torch.bool)

    def loss_of(i, t):
        m = patched(
            model,
            encode_image=lambda batch: i,
            encode_text=lambda batch: t,
            _image=lambda batch: (i, logits, mask),
        )
        return m.loss({})["loss"]

    compare(loss_of, (img, txt))
    # the scores themselves: float32, identical to the float32 computation
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = model.similarity(img.bfloat16(), txt.bfloat16())
    assert scores.dtype == torch.float32
    assert torch.equal(scores, model.similarity(img, txt))


def test_hardest_negatives_and_gradients_would_change_with_bf16_scores():
    """What the float32 scores prevent (the issue's measurement, emulated): scores
    rounded to bf16 pick other hardest negatives and move the gradient by percents."""
    img, txt = embeddings(B, D)
    exact = img @ txt.t()
    rounded = exact.bfloat16().float()
    eye = torch.eye(B, dtype=torch.bool)
    changed = exact.masked_fill(eye, -2).argmax(1) != rounded.masked_fill(eye, -2).argmax(1)
    assert int(changed.sum()) >= 3

    def loss_of(i, t, bf16_scores):
        scores = i @ t.t()
        if bf16_scores:
            scores = scores.bfloat16().float()
        return hinge_triplet(scores, 0.2, True)

    ref, ref_grads = run(lambda i, t: loss_of(i, t, False), (img, txt), bf16=False)
    bad, bad_grads = run(lambda i, t: loss_of(i, t, True), (img, txt), bf16=False)
    assert float((bad_grads[0] - ref_grads[0]).norm() / ref_grads[0].norm()) > 0.01


def test_mvvse_view_scores_are_float32():
    img, txt = embeddings(B, K, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = view_scores(img.bfloat16(), txt.bfloat16())
    assert scores.dtype == torch.float32
    assert torch.equal(scores, torch.einsum("ivd,td->itv", img, txt))


def test_univse_losses_under_bf16_autocast_equal_float32():
    img, txt = embeddings(B, D)
    compare(lambda i, t: ranking_loss(i, t, 0.2), (img, txt))
    regions, pos = embeddings(B, 4, D, seed=1)  # (B, G, d) regions, (B, d) components
    neg = torch.roll(pos, 1, 0)
    compare(
        lambda r, p, n: region_alignment(r, p.unsqueeze(1), n.unsqueeze(1), 0.2).sum(),
        (regions, pos, neg),
    )
    rel_mask = torch.ones(B, 1, dtype=torch.bool)
    compare(
        lambda i, p, n: relation_loss(i, p.unsqueeze(1), n.unsqueeze(1), rel_mask, rel_mask, 0.2),
        (img, txt, torch.roll(txt, 3, 0)),
    )
