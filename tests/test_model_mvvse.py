"""MV-VSE on GPO (models/mvvse.py): GPO against a direct computation, the losses of
eq. 8-12 and 15 against explicit loops, the K = 1 reduction to VSE++ MH, the bound of
eq. 14, and an overfit run on 32 demo pairs."""

from __future__ import annotations

import math

import numpy as np
import pydantic
import pytest
import torch
from model_data import TinyPairs, overfit

from models.common import hinge_triplet
from models.data.info import DataInfo
from models.mvvse import (
    GPO,
    MVVSE,
    MVVSEConfig,
    RegionEncoder,
    mv_avg_triplet,
    mv_max_triplet,
    mv_up_triplet,
    positional_encoding,
    up_indicators,
)

SMALL = dict(embed_size=64, word_dim=32)


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- direct losses
# scores[i][c][k] = s(v_k of image i, caption c); positives on the diagonal


def _star(s, i, c):
    return max(s[i][c])  # eq. 6


def direct_max(s, a):
    """Eq. 9 with plain loops: hardest negatives by s*."""
    n, total = len(s), 0.0
    for b in range(n):
        pos = _star(s, b, b)
        neg_t = max(_star(s, b, c) for c in range(n) if c != b)
        neg_v = max(_star(s, i, b) for i in range(n) if i != b)
        total += max(0.0, a - pos + neg_t) + max(0.0, a - pos + neg_v)
    return total


def direct_avg(s, a):
    """Eq. 8: per view k, hardest negatives measured in view k, then 1/K sum_k."""
    n, k_views, total = len(s), len(s[0][0]), 0.0
    for b in range(n):
        for k in range(k_views):
            pos = s[b][b][k]
            neg_t = max(s[b][c][k] for c in range(n) if c != b)
            neg_v = max(s[i][b][k] for i in range(n) if i != b)
            total += (max(0.0, a - pos + neg_t) + max(0.0, a - pos + neg_v)) / k_views
    return total


def direct_indicators(s, a):
    """Eq. 11-12: 1 iff for every view alpha - s(v_k, t) + s*(negative) > 0."""
    n, k_views = len(s), len(s[0][0])
    ind_t, ind_v = [], []
    for b in range(n):
        neg_t = max(_star(s, b, c) for c in range(n) if c != b)
        neg_v = max(_star(s, i, b) for i in range(n) if i != b)
        ind_t.append(all(a - s[b][b][k] + neg_t > 0 for k in range(k_views)))
        ind_v.append(all(a - s[b][b][k] + neg_v > 0 for k in range(k_views)))
    return ind_t, ind_v


def direct_up(s, a, rough=False):
    """Eq. 10 (or the rough bound of eq. 13 without the indicators)."""
    n, k_views, total = len(s), len(s[0][0]), 0.0
    ind_t, ind_v = direct_indicators(s, a)
    for b in range(n):
        neg_t = max(_star(s, b, c) for c in range(n) if c != b)
        neg_v = max(_star(s, i, b) for i in range(n) if i != b)
        for k in range(k_views):
            pos = s[b][b][k]
            wt = 1.0 if (rough or ind_t[b]) else 0.0
            wv = 1.0 if (rough or ind_v[b]) else 0.0
            total += (wt * max(0.0, a - pos + neg_t) + wv * max(0.0, a - pos + neg_v)) / k_views
    return total


def _scores(n=5, k=3, seed=0):
    """Random (B, B, K) scores with raised positives, so that both indicator values occur."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(n, n, k, generator=g, dtype=torch.float64) * 2 - 1
    return s + 0.7 * torch.eye(n, dtype=torch.float64)[..., None]


@pytest.mark.parametrize("seed", range(4))
def test_losses_match_direct_loops(seed):
    s = _scores(seed=seed)
    rows = s.tolist()
    for a in (0.2, 0.6):
        assert mv_max_triplet(s, a).item() == pytest.approx(direct_max(rows, a))
        assert mv_avg_triplet(s, a).item() == pytest.approx(direct_avg(rows, a))
        assert mv_up_triplet(s, a).item() == pytest.approx(direct_up(rows, a))
        ind_t, ind_v = up_indicators(s, a)
        assert (ind_t.tolist(), ind_v.tolist()) == direct_indicators(rows, a)


def test_indicators_hand_made():
    # 2 pairs, 2 views, margin 0.2; off-diagonal s*: image 0 / caption 1 = 0.5, image 1 /
    # caption 0 = 0.1. Pair 0 has views (0.3, 0.8), pair 1 views (0.4, 0.4).
    s = torch.tensor(
        [
            [[0.3, 0.8], [0.5, 0.2]],
            [[0.1, -0.2], [0.4, 0.4]],
        ],
        dtype=torch.float64,
    )
    ind_t, ind_v = up_indicators(s, 0.2)
    # pair 0: caption side 0.2 - {0.3, 0.8} + 0.5 = {0.4, -0.1} -> 0
    #         image side   0.2 - {0.3, 0.8} + 0.1 = {0.0, -0.5} -> 0
    # pair 1: caption side 0.2 - 0.4 + 0.1 = -0.1 -> 0; image side 0.2 - 0.4 + 0.5 = 0.3 -> 1
    assert ind_t.tolist() == [False, False]
    assert ind_v.tolist() == [False, True]
    # the Up loss is then only pair 1's image side: 1/2 * (0.3 + 0.3)
    assert mv_up_triplet(s, 0.2).item() == pytest.approx(0.3)
    # Max: pair 0 caption [0.2 - 0.8 + 0.5]_+ = 0, image 0; pair 1 image 0.3
    assert mv_max_triplet(s, 0.2).item() == pytest.approx(0.3)
    # an indicator is 1 exactly when the s*-hinge is violated (the remark after eq. 13)
    s = _scores(n=6, k=3, seed=1)
    star = s.amax(-1)
    neg = star.masked_fill(torch.eye(6, dtype=torch.bool), -9)
    ind_t, ind_v = up_indicators(s, 0.2)
    assert torch.equal(ind_t, 0.2 - star.diag() + neg.amax(1) > 0)
    assert torch.equal(ind_v, 0.2 - star.diag() + neg.amax(0) > 0)
    assert ind_t.any() and not ind_t.all()  # the checks above are not vacuous
    assert ind_v.any() and not ind_v.all()


def test_indicators_are_strict_at_the_margin():
    """Eq. 11-12: 1 iff alpha - s(v_k, t) + s* > 0 in every view; a view exactly at the
    margin (binary fractions, so exactly 0) turns the indicator off."""
    # pair 0: views (0.75, 0.5), hardest negatives 0.5 both ways; margin 0.25
    # view 0: 0.25 - 0.75 + 0.5 = 0 (not > 0); view 1: 0.25 - 0.5 + 0.5 = 0.25
    s = torch.tensor(
        [
            [[0.75, 0.5], [0.5, 0.5]],
            [[0.5, 0.5], [1.0, 1.0]],
        ],
        dtype=torch.float64,
    )
    ind_t, ind_v = up_indicators(s, 0.25)
    assert ind_t.tolist() == [False, False] and ind_v.tolist() == [False, False]
    assert mv_up_triplet(s, 0.25).item() == 0.0
    # just inside the margin in view 0: both views violate, both count
    ind_t, _ = up_indicators(s, 0.25 + 2**-20)
    assert ind_t.tolist() == [True, False]


def test_region_encoder_against_direct():
    """vse_infty's precomp encoder: fc(x) + W2 relu(BN(W1 x)), the batch statistics of
    BN over the valid regions only in training, its running statistics in evaluation."""
    torch.manual_seed(0)
    enc = RegionEncoder(region_dim=6, embed_size=8)
    x = torch.randn(3, 4, 6)
    lengths = torch.tensor([4, 2, 1])
    x[1, 2:] = 100.0  # padding, far from the real values
    x[2, 1:] = -100.0
    valid = torch.cat([x[b, :n] for b, n in enumerate(lengths.tolist())])  # (7, 6)

    def direct(train: bool):
        h = valid @ enc.mlp_in.weight.t() + enc.mlp_in.bias  # (7, 4)
        bn = enc.mlp_bn
        if train:
            mean, var = h.mean(0), h.var(0, unbiased=False)
        else:
            mean, var = bn.running_mean, bn.running_var
        normed = (h - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
        mlp = normed.clamp_min(0) @ enc.mlp_out.weight.t() + enc.mlp_out.bias
        return valid @ enc.fc.weight.t() + enc.fc.bias + mlp  # (7, 8)

    for train in (True, False):
        enc.train(train)
        with torch.no_grad():
            want = direct(train)
            got = enc(x, lengths)  # (3, 4, 8)
        rows = torch.cat([got[b, :n] for b, n in enumerate(lengths.tolist())])
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
    # the running mean moved towards the valid regions' mean only
    with torch.no_grad():
        h = valid @ enc.mlp_in.weight.t() + enc.mlp_in.bias
    torch.testing.assert_close(enc.mlp_bn.running_mean, 0.1 * h.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_upper_bound_chain(seed):
    """Eq. 14: L_Max <= L_Up <= L_Up-Rough, and strictly above Max when views differ."""
    s = _scores(n=6, k=3, seed=seed)
    lmax, lup = mv_max_triplet(s, 0.2).item(), mv_up_triplet(s, 0.2).item()
    assert lmax <= lup + 1e-12
    assert lup <= direct_up(s.tolist(), 0.2, rough=True) + 1e-12
    if seed == 0:
        assert lup > lmax  # otherwise the bound test could pass with Up == Max


def test_single_view_is_vsepp_mh():
    for seed in range(3):
        s = _scores(n=6, k=1, seed=seed)
        mh = hinge_triplet(s[..., 0], 0.2, max_violation=True)
        for fn in (mv_max_triplet, mv_avg_triplet, mv_up_triplet):
            assert fn(s, 0.2).item() == pytest.approx(mh.item())
    # and through the model: every loss option with K = 1 equals MH on its own scores
    data = TinyPairs(n_images=8)
    batch = data.pair_batch(np.arange(8))
    for loss in ("mv", "avg", "max", "up"):
        torch.manual_seed(0)
        model = MVVSE(MVVSEConfig(views=1, loss=loss, margin=0.3, **SMALL), data.info).eval()
        with torch.no_grad():
            got = model.loss(batch)["loss"].item()
            sims = model.similarity(model.encode_image(batch), model.encode_text(batch))
        assert got == pytest.approx(hinge_triplet(sims, 0.3, True).item(), rel=1e-5)


@pytest.mark.parametrize("loss", ["mv", "avg", "max", "up"])
def test_model_loss_matches_direct(loss):
    data = TinyPairs(n_images=6)
    batch = data.pair_batch(np.arange(6))
    torch.manual_seed(1)
    cfg = MVVSEConfig(loss=loss, lambda_=0.3, **SMALL)
    model = MVVSE(cfg, data.info).eval()
    with torch.no_grad():
        out = model.loss(batch)
        img, txt = model.encode_image(batch), model.encode_text(batch)  # (B, K, D), (B, D)
    s = [[[float(img[i, k] @ txt[c]) for k in range(3)] for c in range(6)] for i in range(6)]
    want = {
        "avg": direct_avg(s, 0.2),
        "max": direct_max(s, 0.2),
        "up": direct_up(s, 0.2),
        "mv": 0.3 * direct_max(s, 0.2) + 0.7 * direct_up(s, 0.2),
    }[loss]
    assert out["loss"].item() == pytest.approx(want, rel=1e-5)
    assert want > 0
    if loss == "mv":
        assert out["max"].item() == pytest.approx(direct_max(s, 0.2), rel=1e-5)
        assert out["up"].item() == pytest.approx(direct_up(s, 0.2), rel=1e-5)


def test_up_gradient_reaches_every_violating_view_max_only_the_best():
    """Eq. 9 updates one view per pair; eq. 10 all of them while the indicator is on."""
    # pair 0: views (0.10, 0.15, 0.05) against negatives at 0 -> every view violates;
    # pair 1: 0.9 in every view, all constraints met
    s = torch.tensor([[[0.10, 0.15, 0.05], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], [0.9, 0.9, 0.9]]])
    s.requires_grad_(True)
    mv_max_triplet(s, 0.2).backward()
    assert (s.grad[0, 0] != 0).tolist() == [False, True, False]
    s.grad = None
    mv_up_triplet(s, 0.2).backward()
    assert (s.grad[0, 0] != 0).tolist() == [True, True, True]
    assert (s.grad[1, 1] == 0).all()  # pair 1 satisfies every constraint


# ----------------------------------------------------------------------------- GPO


def test_positional_encoding_formula():
    pe = positional_encoding(5, 8)
    for pos in range(5):
        for i in range(4):
            angle = pos / 10000 ** (2 * i / 8)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_gpo_defaults_are_vse_infty_s():
    """GPO's ``gpo.py``: d_pe = d_hidden = 32, a one-layer BiGRU, a linear score without
    bias, temperature 0.1."""
    gpo = GPO()
    assert (gpo.pe_dim, gpo.temperature) == (32, 0.1)
    gru = gpo.gru
    assert (gru.input_size, gru.hidden_size, gru.num_layers, gru.bidirectional) == (32, 32, 1, True)
    assert gpo.linear.in_features == 32 and gpo.linear.bias is None


def test_gpo_weights_direct_and_size_only():
    torch.manual_seed(0)
    gpo = GPO(pe_dim=8, hidden=6, temperature=0.1)
    lengths = torch.tensor([3, 5, 1, 3])
    w = gpo.weights(lengths, 7)  # (B, L, 1)
    assert w.shape == (4, 7, 1)
    # direct: BiGRU on the n encodings alone, directions averaged, linear, softmax(x / 0.1)
    for b, n in enumerate(lengths.tolist()):
        out, _ = gpo.gru(positional_encoding(n, 8)[None])  # (1, n, 12)
        h = (out[..., :6] + out[..., 6:]) / 2
        want = torch.softmax(gpo.linear(h)[0, :, 0] / 0.1, 0)
        torch.testing.assert_close(w[b, :n, 0], want, rtol=1e-5, atol=1e-6)
        assert w[b, n:].abs().max().item() < 1e-12
    # a function of the set size only: same rows whatever the padding or the batch
    w2 = gpo.weights(torch.tensor([3, 2]), 3)
    torch.testing.assert_close(w2[0], w[0, :3])
    torch.testing.assert_close(w[3], w[0])
    assert not torch.allclose(w[1, :3], w[0, :3])  # different sizes do differ


def test_gpo_pools_sorted_features_with_size_weights():
    torch.manual_seed(0)
    gpo = GPO(pe_dim=8, hidden=6)
    lengths = torch.tensor([4, 2, 4])
    w = gpo.weights(lengths, 4)[..., 0]  # (B, L)
    for trial in range(2):
        x = torch.randn(3, 4, 5) * (trial + 1) + 3 * trial
        x[1, 2:] = 50.0  # padding must be ignored, even when larger than the real values
        got = gpo(x, lengths)  # (B, D)
        for b, n in enumerate(lengths.tolist()):
            for d in range(5):
                vals = sorted(x[b, :n, d].tolist(), reverse=True)
                want = sum(w[b, j].item() * vals[j] for j in range(n))
                assert got[b, d].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    # bf16 features (a bf16 model or autocast) pool into bf16
    half = gpo(x.bfloat16(), lengths)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), got, rtol=0.02, atol=0.05)


# ----------------------------------------------------------------------------- model


def test_architecture_follows_the_config():
    """K GPOs with the configured encoding size, GRU size and temperature; a BiGRU text
    encoder (eq. 1); the region MLP's hidden layer half the embedding, the region FC
    Xavier-uniform (vse_infty's ``EncoderImageAggr``)."""
    info = DataInfo(region_dim=40, vocab_size=10, token_dim=8)
    cfg = MVVSEConfig(embed_size=88, word_dim=8, gpo_pe_dim=6, gpo_hidden=5, gpo_temperature=0.3)
    torch.manual_seed(0)
    model = MVVSE(cfg, info)
    for gpo in [*model.views, model.text_gpo]:
        assert (gpo.pe_dim, gpo.gru.hidden_size, gpo.temperature) == (6, 5, 0.3)
        assert gpo.gru.input_size == 6 and gpo.gru.bidirectional
    assert model.words.bidirectional and model.words.rnn.bidirectional
    enc = model.regions
    assert enc.mlp_in.out_features == 44 and enc.mlp_out.in_features == 44
    r = math.sqrt(6.0 / (40 + 88))
    w = enc.fc.weight
    assert w.abs().max() <= r and w.min() < -0.99 * r and w.max() > 0.99 * r
    assert torch.equal(enc.fc.bias, torch.zeros(88))


def test_shapes_inputs_and_similarity():
    data = TinyPairs(n_images=6)
    for enc, key in (("bigru", "words"), ("bert", "tokens")):
        torch.manual_seed(0)
        model = MVVSE(MVVSEConfig(text_encoder=enc, **SMALL), data.info).eval()
        assert model.inputs == {"regions", key} == MVVSE.inputs_for(model.cfg)
        with torch.no_grad():
            img = model.encode_image(data.image_batch(np.arange(6)))
            txt = model.encode_text(data.text_batch(np.arange(4)))
            sims = model.similarity(img, txt)
        assert img.shape == (6, 3, 64) and txt.shape == (4, 64)
        torch.testing.assert_close(img.norm(dim=-1), torch.ones(6, 3))
        torch.testing.assert_close(txt.norm(dim=-1), torch.ones(4))
        assert sims.shape == (6, 4)
        want = torch.tensor(
            [[max(float(img[i, k] @ txt[c]) for k in range(3)) for c in range(4)] for i in range(6)]
        )
        torch.testing.assert_close(sims, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(img[:, 0], img[:, 1])  # the views are distinct aggregators


def test_view_attention_is_each_views_cosine_with_each_region():
    """What Fig. 5 draws: the cosine of each region's feature (eq. 1) with each view's
    embedding v_k (eq. 4), 0 at padded regions."""
    data = TinyPairs(n_images=4)
    torch.manual_seed(0)
    model = MVVSE(MVVSEConfig(**SMALL), data.info).eval()
    batch = data.image_batch(np.arange(4))
    batch["region_lengths"] = torch.tensor([4, 2, 1, 3])
    with torch.no_grad():
        got = model.view_attention(batch)  # (B, K, R)
        feats = model.regions(batch["regions"], batch["region_lengths"])  # (B, R, D)
        views = model.encode_image(batch)  # (B, K, D)
    assert got.shape == (4, 3, 4)
    for b, n in enumerate([4, 2, 1, 3]):
        for k in range(3):
            for r in range(4):
                f, v = feats[b, r], views[b, k]
                want = float(f @ v / (f.norm() * v.norm())) if r < n else 0.0
                assert got[b, k, r].item() == pytest.approx(want, abs=1e-5)


def test_bert_option_reads_tokens_not_words():
    data = TinyPairs(n_images=4)
    model = MVVSE(MVVSEConfig(text_encoder="bert", **SMALL), data.info).eval()
    batch = data.text_batch(np.arange(4))
    del batch["words"], batch["word_lengths"]
    with torch.no_grad():
        assert model.encode_text(batch).shape == (4, 64)


def test_config_defaults_and_validation():
    cfg = MVVSEConfig()
    assert (cfg.views, cfg.lambda_, cfg.margin, cfg.loss, cfg.embed_size) == (
        3,
        0.7,
        0.2,
        "mv",
        1024,
    )
    for bad in ({"lambda_": 1.5}, {"gpo_pe_dim": 31}, {"lamda": 0.5}, {"loss": "sum"}):
        with pytest.raises(pydantic.ValidationError):
            MVVSEConfig(**bad)


def test_bf16_autocast_runs():
    data = TinyPairs(n_images=8)
    batch = data.pair_batch(np.arange(8))
    torch.manual_seed(0)
    model = MVVSE(MVVSEConfig(**SMALL), data.info)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(batch)["loss"]
    assert torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("enc", ["bigru", "bert"])
def test_overfit_tiny_pairs(enc):
    data = TinyPairs()
    torch.manual_seed(0)
    model = MVVSE(MVVSEConfig(text_encoder=enc, **SMALL), data.info)
    first = model.loss(data.pair_batch(np.arange(len(data))))["loss"]
    assert torch.isfinite(first)
    r1 = overfit(model, data, steps={"bigru": 100, "bert": 80}[enc], lr=2e-3)
    assert r1 >= 90.0
