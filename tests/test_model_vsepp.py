"""VSE++ (models/vsepp.py): the SH (eq. 5) and MH (eq. 6) losses against a per-pair loop,
both of their terms on hand-made scores, the encoders against eq. 1-3 computed directly,
the official code's initialisation, and an overfit run on 32 demo pairs."""

from __future__ import annotations

import math

import numpy as np
import pydantic
import pytest
import torch
from model_data import TinyPairs, overfit

from models.vsepp import VSEPP, VSEPPConfig

SMALL = dict(embed_size=16, word_dim=8)


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- losses
# s[i][c] = s(image i, caption c); positive pairs on the diagonal


def caption_side(s, a, hardest):
    """Per positive pair (i, i): [a - s(i, i) + s(i, c')]_+ over negative captions c'."""
    n, total = len(s), 0.0
    for p in range(n):
        hinges = [max(0.0, a - s[p][p] + s[p][c]) for c in range(n) if c != p]
        total += max(hinges) if hardest else sum(hinges)
    return total


def image_side(s, a, hardest):
    """Per positive pair (i, i): [a - s(i, i) + s(i', i)]_+ over negative images i'."""
    n, total = len(s), 0.0
    for p in range(n):
        hinges = [max(0.0, a - s[p][p] + s[i][p]) for i in range(n) if i != p]
        total += max(hinges) if hardest else sum(hinges)
    return total


def direct_sh(s, a):
    """Eq. 5 summed over the batch: every negative of both kinds."""
    return caption_side(s, a, False) + image_side(s, a, False)


def direct_mh(s, a):
    """Eq. 6 summed over the batch: the hardest negative of each kind."""
    return caption_side(s, a, True) + image_side(s, a, True)


def model_and_batch(n=6, seed=0, **cfg):
    data = TinyPairs(n_images=n)
    torch.manual_seed(seed)
    model = VSEPP(VSEPPConfig(**{**SMALL, **cfg}), data.info).eval()
    return model, data.pair_batch(np.arange(n))


def test_each_term_on_hand_made_scores():
    """Eq. 5 and 6 hold two terms: negative captions for an image, negative images for a
    caption. With unequal positives a score violates only one of them."""
    # image 1's caption scores 0.5 with image 0: 0.2 - 0.6 + 0.5 = 0.1 on caption 1's
    # side (a negative image), 0.2 - 0.9 + 0.5 < 0 on image 0's side (a negative caption)
    only_image_side = [[0.9, 0.5], [0.0, 0.6]]
    # image 0 scores 0.5 with caption 1: 0.2 - 0.6 + 0.5 = 0.1 for image 0 (a negative
    # caption), 0.2 - 0.9 + 0.5 < 0 for caption 1
    only_caption_side = [[0.6, 0.5], [0.0, 0.9]]
    for loss in ("sh", "mh"):
        model = VSEPP(VSEPPConfig(loss=loss, **SMALL), TinyPairs(n_images=2).info)
        for scores in (only_image_side, only_caption_side):
            model.similarity = lambda img, txt, s=scores: torch.tensor(s, dtype=torch.float64)
            got = model.loss({"image": torch.zeros(2, 48), **_words(2)})["loss"].item()
            assert got == pytest.approx(0.1), (loss, scores)
    # three pairs, two violations in row 0: SH sums them, MH keeps the larger one
    s = [[0.5, 0.4, 0.45], [0.0, 0.9, 0.0], [0.0, 0.0, 0.9]]
    # row 0: 0.2 - 0.5 + 0.4 = 0.1 and 0.2 - 0.5 + 0.45 = 0.15 (caption side of pair 0);
    # columns 1 and 2: 0.2 - 0.9 + 0.4 < 0, 0.2 - 0.9 + 0.45 < 0 (no image side)
    for loss, want in (("sh", 0.25), ("mh", 0.15)):
        model = VSEPP(VSEPPConfig(loss=loss, **SMALL), TinyPairs(n_images=3).info)
        model.similarity = lambda img, txt: torch.tensor(s, dtype=torch.float64)
        got = model.loss({"image": torch.zeros(3, 48), **_words(3)})["loss"].item()
        assert got == pytest.approx(want), loss


def _words(n):
    return {"words": torch.ones(n, 2, dtype=torch.long), "word_lengths": torch.full((n,), 2)}


@pytest.mark.parametrize("seed", range(3))
def test_hinge_on_random_scores_matches_the_loop(seed):
    """Asymmetric scores with unequal positives: each side of each loss counted apart."""
    from models.common import hinge_triplet

    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(7, 7, generator=g, dtype=torch.float64) * 2 - 1
    scores += 0.6 * torch.rand(7, generator=g, dtype=torch.float64).diag()
    s = scores.tolist()
    for a in (0.2, 0.5):
        sh, mh = hinge_triplet(scores, a, False).item(), hinge_triplet(scores, a, True).item()
        assert sh == pytest.approx(direct_sh(s, a))
        assert mh == pytest.approx(direct_mh(s, a))
        # the sides differ here, so a loss that counted one side twice would be caught
        assert caption_side(s, a, True) != pytest.approx(image_side(s, a, True))
        assert 0 < mh < sh


@pytest.mark.parametrize("loss", ["sh", "mh"])
def test_model_loss_matches_the_loop(loss):
    model, batch = model_and_batch(loss=loss, margin=0.3)
    with torch.no_grad():
        got = model.loss(batch)["loss"].item()
        img, txt = model.encode_image(batch), model.encode_text(batch)
    s = [[float(img[i] @ txt[c]) for c in range(6)] for i in range(6)]
    want = {"sh": direct_sh, "mh": direct_mh}[loss](s, 0.3)
    assert got == pytest.approx(want, rel=1e-5)
    assert want > 0 and want != pytest.approx(direct_sh(s, 0.2), rel=1e-3)  # margin used
    other = direct_mh(s, 0.3) if loss == "sh" else direct_sh(s, 0.3)
    assert got != pytest.approx(other, rel=1e-3)  # the option picks the loss
    assert model.loss(batch).keys() == {"loss"}


def test_loss_gradient_flows_to_both_encoders():
    model, batch = model_and_batch()
    model.train()
    model.loss(batch)["loss"].backward()
    assert model.image_fc.weight.grad.abs().sum() > 0
    assert model.text.rnn.weight_ih_l0.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- encoders


def test_image_is_eq_1_normalised():
    model, batch = model_and_batch()
    w, b = model.image_fc.weight.detach(), model.image_fc.bias.detach()  # (D, F), (D,)
    with torch.no_grad():
        got = model.encode_image(batch)
    assert got.shape == (6, 16)
    for i in range(6):
        f = [
            sum(float(w[d, k]) * float(batch["image"][i, k]) for k in range(w.shape[1]))
            for d in range(16)
        ]
        f = [v + float(b[d]) for d, v in enumerate(f)]
        norm = math.sqrt(sum(v * v for v in f))
        for d in range(16):
            assert got[i, d].item() == pytest.approx(f[d] / norm, abs=1e-5)


def test_text_is_the_gru_state_at_the_last_word_normalised():
    """Eq. 2: mu(c), the GRU's state after the caption's last word (each caption run alone,
    unpadded), normalised; the padding of the batch changes nothing."""
    model, batch = model_and_batch()
    with torch.no_grad():
        got = model.encode_text(batch)
        assert got.shape == (6, 16)
        lengths = batch["word_lengths"].tolist()
        assert len(set(lengths)) > 1  # captions of different lengths are padded
        for c, n in enumerate(lengths):
            out, _ = model.text.rnn(model.text.embed(batch["words"][c : c + 1, :n]))
            want = out[0, -1] / out[0, -1].norm()
            torch.testing.assert_close(got[c], want, rtol=1e-5, atol=1e-6)
        longer = dict(batch, words=torch.cat([batch["words"], torch.zeros(6, 3).long()], 1))
        torch.testing.assert_close(model.encode_text(longer), got)


def test_similarity_is_the_inner_product_eq_3():
    model, batch = model_and_batch()
    with torch.no_grad():
        img, txt = model.encode_image(batch), model.encode_text(batch)[:4]
        sims = model.similarity(img, txt)
    assert sims.shape == (6, 4) and sims.dtype == torch.float32
    for i in range(6):
        for c in range(4):
            want = sum(float(img[i, d]) * float(txt[c, d]) for d in range(16))
            assert sims[i, c].item() == pytest.approx(want, abs=1e-6)
    assert sims.abs().max() <= 1 + 1e-6 and sims.std() > 0.05  # cosines, not all equal


def test_initialisation_is_the_official_codes():
    """Xavier-uniform W_f with zero bias (EncoderImagePrecomp), words U(-0.1, 0.1)."""
    data = TinyPairs(n_images=2)
    torch.manual_seed(3)
    model = VSEPP(VSEPPConfig(embed_size=64, word_dim=32), data.info)
    w = model.image_fc.weight
    bound = math.sqrt(6.0 / (data.info.image_dim + 64))
    assert w.shape == (64, data.info.image_dim)
    assert w.abs().max() <= bound and w.abs().max() > 0.98 * bound
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    assert torch.equal(model.image_fc.bias, torch.zeros(64))
    e = model.text.embed.weight
    assert e.abs().max() <= 0.1 and e.abs().max() > 0.098
    assert model.text.rnn.hidden_size == 64 and not model.text.rnn.bidirectional


def test_config_defaults_and_inputs():
    cfg = VSEPPConfig()
    assert (cfg.embed_size, cfg.word_dim, cfg.margin, cfg.loss) == (1024, 300, 0.2, "mh")
    assert VSEPP.inputs == {"image", "words"} and VSEPP.name == "vsepp"
    for bad in ({"loss": "max"}, {"margin": 0}, {"embed": 3}):
        with pytest.raises(pydantic.ValidationError):
            VSEPPConfig(**bad)


def test_overfit_tiny_pairs():
    data = TinyPairs()
    torch.manual_seed(0)
    model = VSEPP(VSEPPConfig(embed_size=64, word_dim=32), data.info)
    r1 = overfit(model, data, steps=80, lr=2e-3)  # 100% at 80 steps for seeds 0-2
    assert r1 >= 90.0, r1
