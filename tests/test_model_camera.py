"""CAMERA (models/camera.py): config checks, eq. 9 box code, AGSA (eq. 4-7) and the
summarisation (eq. 13-14) against direct computations, padding, both loss terms against
plain loops, the diversity term's zero on orthonormal views, and an overfit run."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_data import TinyPairs, overfit
from pydantic import ValidationError

from models.camera import AGSA, CAMERA, CAMERAConfig, Summarization, box_code, diversity
from models.data.info import DataInfo

SMALL = dict(
    embed_size=32,
    heads=4,
    views=4,
    kernels=[1, 3, 3],
    dilations=[1, 1, 2],
    channels=[16, 8, 8],
)


def small_model(seed: int = 0, **overrides) -> CAMERA:
    torch.manual_seed(seed)
    info = DataInfo(region_dim=10, token_dim=6)
    return CAMERA(CAMERAConfig(**{**SMALL, **overrides}), info)


def random_batch(b: int = 3, r: int = 5, t: int = 4, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    corners = torch.rand(b, r, 2, 2, generator=g).sort(dim=2).values  # (x1, y1) < (x2, y2)
    return {
        "regions": torch.randn(b, r, 10, generator=g),
        "region_lengths": torch.tensor([r, 2, 3][:b]),
        "boxes": corners.reshape(b, r, 4),  # x1, y1, x2, y2
        "tokens": torch.randn(b, t, 6, generator=g),
        "token_lengths": torch.tensor([t, 1, 2][:b]),
    }


def test_config_defaults_are_the_papers():
    cfg = CAMERAConfig()
    assert (cfg.embed_size, cfg.heads, cfg.views) == (2048, 64, 12)
    assert cfg.kernels == [1, 3, 3, 3, 5, 5, 5]
    assert cfg.dilations == [1, 1, 2, 3, 1, 2, 3]
    assert cfg.channels == [256] + [128] * 6
    assert (cfg.margin, cfg.diversity_weight) == (0.2, 0.01)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(embed_size=100, heads=64), "must divide embed_size"),
        (dict(kernels=[1, 3]), "same non-zero length"),
        (dict(kernels=[1, 3, 3, 3, 5, 5, 4]), "must be odd"),
        (dict(kernels=[], dilations=[], channels=[]), "same non-zero length"),
        (dict(dropout=0.1), "Extra inputs"),
    ],
)
def test_config_rejects(bad, message):
    with pytest.raises(ValidationError, match=message):
        CAMERAConfig(**bad)


def test_summarization_refuses_a_ragged_pyramid():
    """Table 1 gives each kernel its dilation and channels: the module built without
    the config's check refuses lists of different lengths rather than dropping kernels."""
    with pytest.raises(ValueError):
        Summarization(8, 2, kernels=[1, 3, 3], dilations=[1, 2], channels=[4, 4, 4])
    assert len(Summarization(8, 2, [1, 3], [1, 2], [4, 4]).convs) == 2


def test_box_code_is_eq_9():
    boxes = torch.tensor([[[0.1, 0.2, 0.5, 0.4], [0.0, 0.0, 1.0, 1.0]]])  # (1, 2, 4)
    code = box_code(boxes)
    # (x/w, y/h, w_i/w, h_i/h, w_i/h_i, area) with w_i = 0.4, h_i = 0.2
    expected = [[0.1, 0.2, 0.4, 0.2, 2.0, 0.08], [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]]
    torch.testing.assert_close(code[0], torch.tensor(expected))
    assert torch.isfinite(box_code(torch.zeros(1, 1, 4))).all()  # padded boxes
    # the aspect ratio in pixels: a 0.4 x 0.2 box of a 200 x 100 image is 80 x 20 pixels
    wide = box_code(boxes, torch.tensor([2.0]))
    assert wide[0, 0, 4] == pytest.approx(4.0) and wide[0, 1, 4] == pytest.approx(2.0)


def test_agsa_matches_eq_4_to_7():
    torch.manual_seed(0)
    dim, heads, n = 8, 2, 4
    agsa = AGSA(dim, heads)
    x = torch.randn(2, n, dim)
    mask = torch.tensor([[True] * n, [True, True, False, False]])
    out = agsa(x, mask)
    d_k = dim // heads
    for b in range(2):
        valid = [j for j in range(n) if mask[b, j]]
        for i in range(n):
            heads_out = []
            for hd in range(heads):
                sl = slice(hd * d_k, (hd + 1) * d_k)
                q = agsa.query.weight[sl] @ x[b, i]  # Q_i row (eq. 3)
                keys, vals = [], []
                for j in valid:
                    qj = agsa.query.weight[sl] @ x[b, j]
                    kj = agsa.key.weight[sl] @ x[b, j]
                    gj = agsa.fuse_q(qj) * agsa.fuse_k(kj)  # eq. 4 at position j
                    keys.append(torch.sigmoid(agsa.gate_k(gj)) * kj)  # eq. 5-6
                    vals.append(agsa.value.weight[sl] @ x[b, j])
                ki = agsa.key.weight[sl] @ x[b, i]
                gi = agsa.fuse_q(q) * agsa.fuse_k(ki)
                qi = torch.sigmoid(agsa.gate_q(gi)) * q
                logits = torch.stack([qi @ k for k in keys]) / math.sqrt(d_k)
                att = torch.softmax(logits, 0)
                heads_out.append(sum(a * v for a, v in zip(att, vals, strict=True)))
            expected = torch.cat(heads_out) + x[b, i]  # eq. 7
            torch.testing.assert_close(out[b, i], expected, atol=1e-5, rtol=1e-5)


def test_shapes_norms_and_similarity():
    model = small_model().eval()
    batch = random_batch()
    with torch.no_grad():
        img, txt = model.encode_image(batch), model.encode_text(batch)
        sims = model.similarity(img, txt[:2])
    assert img.shape == (3, 4, 32) and txt.shape == (3, 32)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3, 4))
    torch.testing.assert_close(txt.norm(dim=-1), torch.ones(3))
    assert sims.shape == (3, 2)
    for i in range(3):  # eq. 19: the best view's cosine
        for c in range(2):
            best = max(float(img[i, v] @ txt[c]) for v in range(4))
            assert sims[i, c].item() == pytest.approx(best, abs=1e-6)


def test_views_are_eq_14_with_softmax_over_valid_regions():
    model = small_model().eval()
    batch = random_batch()
    with torch.no_grad():
        views, logits, mask = model._image(batch)
    # recompute V-bar (eq. 8-11) and eq. 13-14 directly for image 1 (2 valid regions)
    with torch.no_grad():
        v = model.region_fc(batch["regions"])
        p = torch.sigmoid(model.position_fc(box_code(batch["boxes"])))
        vbar = model.image_agsa(v * p, mask)[1, :2]  # (2, D)
        w = torch.softmax(logits[1, :2], dim=0)  # (2, N), over the regions
        expected = w.t() @ vbar
    expected = expected / expected.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(views[1], expected, atol=1e-5, rtol=1e-5)


def _box_code_by_hand(box: list[float], aspect: float) -> list[float]:
    """Eq. 9 for one normalised box of an image ``aspect`` = width / height."""
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    return [x1, y1, w, h, w / h * aspect, w * h]


def test_image_branch_is_eq_8_to_14_on_the_valid_regions():
    """Each image recomputed on its valid regions alone: FC (eq. 8), the box code in
    pixels (eq. 9) through FC + sigmoid (eq. 10), AGSA (eq. 11, tested above), the
    pyramid of dilated convolutions with zero padding and a ReLU (eq. 12), the FC to N
    logits (eq. 13), the softmax over the regions and the views (eq. 14)."""
    model = small_model(seed=3).eval()
    batch = random_batch(seed=4)
    batch["region_lengths"] = torch.tensor([5, 1, 3])
    batch["image_aspect"] = torch.tensor([1.5, 0.75, 1.0])
    with torch.no_grad():
        views, logits, mask = model._image(batch)
    assert mask.sum(1).tolist() == [5, 1, 3]
    for b, n in enumerate([5, 1, 3]):
        with torch.no_grad():
            v = batch["regions"][b, :n] @ model.region_fc.weight.t() + model.region_fc.bias
            aspect = float(batch["image_aspect"][b])
            code = torch.tensor(
                [_box_code_by_hand(r, aspect) for r in batch["boxes"][b, :n].tolist()]
            )
            fc = model.position_fc
            p = torch.sigmoid(code @ fc.weight.t() + fc.bias)
            vbar = model.image_agsa((v * p)[None], torch.ones(1, n, dtype=torch.bool))[0]
            maps = []
            pyramid = zip(model.summarize.convs, SMALL["kernels"], SMALL["dilations"], strict=True)
            for conv, k, r in pyramid:
                y = F.conv1d(
                    vbar.t()[None], conv.weight, conv.bias, padding=r * (k - 1) // 2, dilation=r
                )
                maps.append(y[0].clamp_min(0))  # (c_k, n)
            s = torch.cat(maps).t()  # (n, sum c_k)
            want_logits = s @ model.summarize.fc.weight.t() + model.summarize.fc.bias  # (n, N)
            weights = torch.softmax(want_logits, dim=0)  # over the regions
            want = weights.t() @ vbar  # (N, D)
            want = want / want.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(logits[b, :n], want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(views[b], want, rtol=1e-5, atol=1e-5)


def test_view_attention_is_the_softmax_over_the_valid_regions():
    """Each view's weights over the regions (S-bar of eq. 13), 0 at padded regions; an
    image whose every region is padding (length 0) attends to its first one."""
    model = small_model(seed=3).eval()
    batch = random_batch(seed=4)
    batch["region_lengths"] = torch.tensor([5, 0, 3])
    with torch.no_grad():
        got = model.view_attention(batch)  # (B, N, R)
        _, logits, _ = model._image(batch)  # (B, R, N)
    assert got.shape == (3, 4, 5)
    for b, n in enumerate([5, 1, 3]):
        for v in range(4):
            z = [math.exp(float(logits[b, r, v])) for r in range(n)]
            want = [x / sum(z) for x in z] + [0.0] * (5 - n)
            assert got[b, v].tolist() == pytest.approx(want, abs=1e-6)


def test_a_bf16_model_reads_float32_boxes():
    """A model cast to bf16 for inference, with the boxes and aspect ratios as the
    stores give them (float32 and float64): the box code follows the model's dtype."""
    model = small_model().eval()
    batch = random_batch()
    batch["image_aspect"] = torch.tensor([1.5, 0.75, 1.0], dtype=torch.float64)
    code = box_code(batch["boxes"], batch["image_aspect"])
    assert code.dtype == torch.float32
    with torch.no_grad():
        want = model.encode_image(batch)
        half = model.to(torch.bfloat16)
        regions = {**batch, "regions": batch["regions"].bfloat16()}
        got = half.encode_image(regions)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0)


def test_text_is_eq_15_to_18():
    model = small_model().eval()
    batch = random_batch()
    with torch.no_grad():
        txt = model.encode_text(batch)
        # caption 2 has 2 valid tokens: FC (eq. 15), AGSA (eq. 16), MLP + residual (eq. 17)
        t = model.token_fc(batch["tokens"][2:3, :2])
        t = model.text_agsa(t, torch.ones(1, 2, dtype=torch.bool))[0]  # (2, D)
        lin1, lin2 = model.mlp[0], model.mlp[2]
        rows = [lin2(torch.relu(lin1(t[i]))) + t[i] for i in range(2)]
        z = (rows[0] + rows[1]) / 2  # eq. 18
    torch.testing.assert_close(txt[2], z / z.norm(), atol=1e-5, rtol=1e-5)


def test_padding_is_ignored():
    model = small_model().eval()
    batch = random_batch()
    noisy = {k: v.clone() for k, v in batch.items()}
    noisy["regions"][1, 2:] = 100 * torch.randn(3, 10)
    noisy["boxes"][1, 2:] = torch.rand(3, 4)
    noisy["tokens"][1, 1:] = 100 * torch.randn(3, 6)
    with torch.no_grad():
        a, la, _ = model._image(batch)
        b, lb, _ = model._image(noisy)
        ta, tb = model.encode_text(batch), model.encode_text(noisy)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(la[:, :2], lb[:, :2])
    torch.testing.assert_close(diversity(la, _mask(batch)), diversity(lb, _mask(batch)))
    torch.testing.assert_close(ta, tb)
    # and padding is not a no-op: changing a valid region changes the views
    noisy["regions"][1, 0] += 1.0
    with torch.no_grad():
        assert not torch.allclose(model.encode_image(noisy)[1], a[1])


def _mask(batch):
    r = batch["regions"].size(1)
    return torch.arange(r)[None, :] < batch["region_lengths"][:, None]


def direct_diversity(s: np.ndarray) -> float:
    """Eq. 21 with loops: columns L2-normalised, ||S^T S - I||_F^2."""
    r, n = s.shape
    cols = [s[:, j] / max(np.sqrt(sum(x * x for x in s[:, j])), 1e-8) for j in range(n)]
    total = 0.0
    for a in range(n):
        for b in range(n):
            dot = sum(cols[a][i] * cols[b][i] for i in range(r))
            total += (dot - (1.0 if a == b else 0.0)) ** 2
    return total


def test_diversity_zero_for_orthonormal_views_positive_otherwise():
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(16, 12))  # (R=16, N=12) orthonormal columns
    scaled = q * torch.linspace(0.5, 3.0, 12)  # the term normalises the columns itself
    mask = torch.ones(1, 16, dtype=torch.bool)
    assert diversity(scaled[None], mask).item() == pytest.approx(0.0, abs=1e-5)
    # rows of padded regions do not count, whatever their values
    padded = torch.cat([scaled, torch.randn(4, 12)])[None]  # (1, 20, 12)
    mask20 = torch.arange(20)[None] < 16
    assert diversity(padded, mask20).item() == pytest.approx(0.0, abs=1e-5)
    overlap = scaled.clone()
    overlap[:, 1] = q[:, 0] + q[:, 1]  # views 0 and 1 share regions
    value = diversity(overlap[None], mask).item()
    assert value > 0.1
    assert value == pytest.approx(direct_diversity(overlap.numpy().astype(np.float64)), rel=1e-4)


def test_diversity_against_loops_with_padding():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 3, generator=g)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    got = diversity(logits, mask)
    for b, n_valid in enumerate([5, 3]):
        expected = direct_diversity(logits[b, :n_valid].numpy().astype(np.float64))
        assert got[b].item() == pytest.approx(expected, rel=1e-4)


def test_losses_against_direct_computation():
    model = small_model()
    batch = random_batch()
    out = model.loss(batch)
    assert set(out) == {"loss", "triplet", "diversity"}
    with torch.no_grad():
        views, logits, mask = model._image(batch)
        txt = model.encode_text(batch)
    n = 3
    s = [[max(float(views[i, v] @ txt[c]) for v in range(4)) for c in range(n)] for i in range(n)]
    margin = 0.2
    triplet = 0.0
    for i in range(n):  # eq. 20 with the hardest negative caption and image, summed
        hard_c = max(s[i][c] for c in range(n) if c != i)
        hard_i = max(s[j][i] for j in range(n) if j != i)
        triplet += max(0.0, margin - s[i][i] + hard_c) + max(0.0, margin - s[i][i] + hard_i)
    div = sum(
        direct_diversity(logits[b, : int(batch["region_lengths"][b])].numpy().astype(np.float64))
        for b in range(n)
    )
    assert out["triplet"].item() == pytest.approx(triplet, abs=1e-5)
    assert out["diversity"].item() == pytest.approx(div, rel=1e-4)
    assert out["loss"].item() == pytest.approx(triplet + 0.01 * div, rel=1e-5)
    assert triplet > 0 and div > 0  # both terms are exercised
    out["loss"].backward()
    assert model.summarize.fc.weight.grad.abs().sum() > 0


def test_bf16_autocast_loss_is_finite():
    model = small_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.loss(random_batch())
    assert all(torch.isfinite(v).item() for v in out.values())


def test_overfits_tiny_pairs():
    data = TinyPairs()
    torch.manual_seed(0)
    cfg = CAMERAConfig(**{**SMALL, "embed_size": 64, "heads": 4})
    model = CAMERA(cfg, data.info)
    batch = data.pair_batch(np.arange(len(data)))
    first = model.loss(batch)
    assert torch.isfinite(first["loss"])
    assert model.encode_image(data.image_batch(np.arange(4))).shape == (4, 4, 64)
    assert model.encode_text(data.text_batch(np.arange(4))).shape == (4, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: one thread is faster, and steady on a busy CPU
    try:
        r1 = overfit(model, data, steps=60, lr=1e-3)  # 100% at 50 steps for seeds 0-3
    finally:
        torch.set_num_threads(threads)
    assert r1 >= 90, r1
    last = model.loss(batch)
    assert last["loss"].item() < first["loss"].item()
