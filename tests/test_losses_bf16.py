"""Under bf16 autocast (CPU here, CUDA in training) the similarities that enter a hinge or
a softmax, and CAMERA's diversity Gram matrix, are computed in float32: each of the five
models' losses on bf16 embeddings equals the float32 loss on the same values, term by term,
with the same gradients (to bf16's precision), while the same computations done in bf16
would move every one of these terms far outside the tolerance (checked here by switching
the float32 protection off)."""

import pytest
import torch

import models.camera
import models.common
import models.mvvse
import models.univse
from models.camera import CAMERA, CAMERAConfig
from models.common import hinge_triplet
from models.data.info import DataInfo
from models.huse import HUSE, HUSEConfig
from models.mvvse import MVVSE, MVVSEConfig, view_scores
from models.univse import UniVSE, UniVSEConfig
from models.vsepp import VSEPP, VSEPPConfig

B, D, K = 128, 512, 3  # batch, embedding size, views
C = 8  # HUSE's classes
G, N = 4, 2  # UniVSE's regions, and components of each kind per caption
RTOL = 1e-6  # float32 loss terms: the same values in the same order, up to summation order
INFO = DataInfo(image_dim=8, region_dim=8, token_dim=8, grid_dim=8, vocab_size=10)


class Trained:
    """Trained-like normalised embeddings: a shared direction, one per batch row (its
    image and caption) and some noise, so that every score is ~0.8-0.98 and the scores
    of a row lie closer together than bf16's step there (2^-8). The values are exact in
    bf16: what a bf16 encoder hands to the loss."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.common = torch.randn(D, generator=self.g)
        self.own = torch.randn(B, D, generator=self.g)

    def __call__(self, *mid: int, noise: float = 0.2) -> torch.Tensor:
        """``(B, *mid, D)``."""
        own = self.own.reshape(B, *([1] * len(mid)), D)
        x = self.common + 0.35 * own + noise * torch.randn(B, *mid, D, generator=self.g)
        return (x / x.norm(dim=-1, keepdim=True)).bfloat16().float()


def patched(model, **encoders):
    for name, value in encoders.items():
        setattr(model, name, value)
    return model


def case(name: str):
    """``(model, loss_of, tensors, protected)``: ``loss_of(*tensors)`` is the model's loss
    dict with its encoders replaced by the given embeddings; ``protected`` names the loss
    terms that the float32 scores (or Gram matrix) keep exact."""
    t = Trained()
    g = torch.Generator().manual_seed(1)
    if name == "vsepp":
        model = VSEPP(VSEPPConfig(embed_size=8, word_dim=8), INFO)

        def loss_of(i, c):
            return patched(model, encode_image=lambda b: i, encode_text=lambda b: c).loss({})

        return model, loss_of, (t(), t()), ["loss"]
    if name == "mvvse":
        model = MVVSE(MVVSEConfig(embed_size=8, word_dim=8, views=K), INFO)

        def loss_of(i, c):
            return patched(model, encode_image=lambda b: i, encode_text=lambda b: c).loss({})

        return model, loss_of, (t(K, noise=0.1), t()), ["loss", "max", "up"]
    if name == "camera":
        model = CAMERA(CAMERAConfig(embed_size=8, heads=2, views=K), INFO)
        mask = torch.arange(G)[None] < torch.randint(1, G + 1, (B, 1), generator=g)  # (B, G)
        logits = torch.randn(B, G, K, generator=g).bfloat16().float()  # S~ (eq. 13)

        def loss_of(i, c, s):
            m = patched(model, _image=lambda b: (i, s, mask), encode_text=lambda b: c)
            return m.loss({})

        return model, loss_of, (t(K, noise=0.1), t(), logits), ["triplet", "diversity"]
    if name == "huse":
        a = torch.rand(C, C, generator=g, dtype=torch.float64)
        a = ((a + a.t()) / 2).fill_diagonal_(0)  # A, cosine distances, some under m = 0.5
        info = DataInfo(image_dim=8, document_dim=8, n_classes=C, class_distances=a.tolist())
        model = HUSE(HUSEConfig(hidden=8, image_layers=1, text_layers=1, use_tfidf=False), info)
        labels = torch.randint(0, C, (B,), generator=g)
        batch = {"labels": labels, "text_labels": labels}

        def loss_of(i, c):
            m = patched(
                model,
                encode_image=lambda b: i,
                encode_text=lambda b: c,
                classify=lambda emb, side=None: emb[:, :C] * 16,  # exact in bf16
            )
            return m.loss(batch)

        # cosine distances ~0.5 +- 0.05: many pairs near the margin m = 0.5 of s_ij (eq. 10)
        return model, loss_of, (t(noise=0.9), t(noise=0.9)), ["graph"]

    model = UniVSE(UniVSEConfig(embed_size=8, d_basic=4, d_modif=4), INFO)

    def some(*shape, p=0.8):
        return torch.rand(*shape, generator=g) < p

    batch = {
        "object_mask": some(B, N),
        "attribute_mask": some(B, N),
        "relation_mask": some(B, N),
        "epoch": 3,  # eta_r on
    }
    negatives = {f"{k}_valid": some(B, N) for k in ("object", "attribute", "relation")}
    ids = ("objects", "attr_nouns", "attr_adjectives", "rel_subjects", "rel_predicates")
    negatives.update(dict.fromkeys((*ids, "rel_objects")))  # read by the encoders replaced
    has_comp = some(B, p=0.9)

    def loss_of(v, regions, sent, comp, obj, attr, rel, n_obj, n_attr, n_rel):
        parts = {"sent": sent, "comp": comp, "obj": obj, "attr": attr, "rel": rel}
        m = patched(
            model,
            encode_regions=lambda b: (v, regions),
            encode_components=lambda b: {**parts, "has_comp": has_comp},
            encode_object=lambda ids: n_obj,
            encode_attribute=lambda noun, adjective: n_attr,
            encode_relation=lambda s, p, o: n_rel,
        )
        return m.loss(batch, negatives)

    tensors = (t(), t(G), t(), t(), t(N), t(N), t(N), t(N), t(N), t(N))
    return model, loss_of, tensors, ["sent", "comp", "obj", "attr", "rel"]


def run(loss_of, tensors, bf16: bool):
    """The loss terms and the total's gradients for ``tensors``: float32 leaves, or under
    CPU bf16 autocast with bf16 inputs (as bf16 encoders give)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        parts = loss_of(*[leaf.bfloat16() if bf16 else leaf for leaf in leaves])
    parts["loss"].backward()
    return {k: v.detach() for k, v in parts.items()}, [leaf.grad for leaf in leaves]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


MODELS = ["vsepp", "mvvse", "camera", "huse", "univse"]


@pytest.mark.parametrize("name", MODELS)
def test_model_losses_under_bf16_autocast_equal_float32(name):
    model, loss_of, tensors, protected = case(name)
    ref, ref_grads = run(loss_of, tensors, bf16=False)
    got, got_grads = run(loss_of, tensors, bf16=True)
    assert got.keys() == ref.keys()
    for key in ref:
        assert got[key].dtype == torch.float32, key
        torch.testing.assert_close(got[key], ref[key], rtol=RTOL, atol=0, msg=key)
    for key in protected:
        assert ref[key] > 0, key  # every protected term is active here
    for g, r in zip(got_grads, ref_grads, strict=True):
        # gradients of bf16 embeddings are bf16 (8 bits): ~0.4% per element, <1% in norm
        assert r.norm() > 0
        assert relative(g, r) <= 0.01
    # the scores themselves: float32, identical to the float32 computation
    img, txt = tensors[:2] if name != "univse" else (tensors[0], tensors[2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = model.similarity(img.bfloat16(), txt.bfloat16())
    assert scores.dtype == torch.float32
    assert torch.equal(scores, model.similarity(img, txt))


def _bf16_scores(device_type: str):
    return torch.autocast(device_type, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", MODELS)
def test_the_checks_fail_when_the_scores_are_bf16(name, monkeypatch):
    """The control: with the float32 protection switched off (``float32_scores`` turned
    into bf16 autocast, ``full_precision`` into a no-op, wherever they are used), every
    protected term moves by far more than the test above allows."""
    _, loss_of, tensors, protected = case(name)
    ref, _ = run(loss_of, tensors, bf16=False)
    for module in (models.common, models.mvvse, models.camera, models.univse):
        if hasattr(module, "float32_scores"):
            monkeypatch.setattr(module, "float32_scores", _bf16_scores)
        if hasattr(module, "full_precision"):
            monkeypatch.setattr(module, "full_precision", lambda *t: t)
    got, _ = run(loss_of, tensors, bf16=True)
    for key in protected:  # measured: 1e-3 (CAMERA's diversity) to 1e-2
        assert relative(got[key], ref[key]) > 100 * RTOL, key


def test_hardest_negatives_and_gradients_would_change_with_bf16_scores():
    """What the float32 scores prevent (the issue's measurement, emulated): scores
    rounded to bf16 pick other hardest negatives and move the gradient by percents."""
    t = Trained()
    img, txt = t(), t()
    exact = img @ txt.t()
    rounded = exact.bfloat16().float()
    eye = torch.eye(B, dtype=torch.bool)
    changed = exact.masked_fill(eye, -2).argmax(1) != rounded.masked_fill(eye, -2).argmax(1)
    assert int(changed.sum()) >= 3

    def loss_of(i, c, bf16_scores):
        scores = i @ c.t()
        if bf16_scores:
            scores = scores.bfloat16().float()
        return {"loss": hinge_triplet(scores, 0.2, True)}

    _, ref_grads = run(lambda i, c: loss_of(i, c, False), (img, txt), bf16=False)
    _, bad_grads = run(lambda i, c: loss_of(i, c, True), (img, txt), bf16=False)
    assert relative(bad_grads[0], ref_grads[0]) > 0.01


def test_mvvse_view_scores_are_float32():
    t = Trained()
    img, txt = t(K), t()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = view_scores(img.bfloat16(), txt.bfloat16())
    assert scores.dtype == torch.float32
    assert torch.equal(scores, torch.einsum("ivd,td->itv", img, txt))
