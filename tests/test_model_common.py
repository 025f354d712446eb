"""The helpers the models share (models/common.py) against references written here: plain
loops and numpy for the similarities, pooling and the VSE++ hinge (eq. 5-6), torch's GRU
run on each unpadded caption for the packed text encoder, and the loop settings' check."""

from __future__ import annotations

import warnings

import numpy as np
import pydantic
import pytest
import torch
from device_check import made_elsewhere
from model_data import TinyPairs

from infra.device import autocast
from models.common import (
    GRUText,
    TrainConfig,
    cosine_sim,
    dot_sim,
    hinge_triplet,
    host_lengths,
    l2norm,
    lengths_mask,
    masked_mean,
    multiview_sim,
)
from models.registry import model_class


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- loop settings


def test_workers_need_a_batch_ahead():
    with pytest.raises(pydantic.ValidationError, match="workers build at least one batch ahead"):
        TrainConfig(num_workers=2, prefetch=0)
    assert TrainConfig(num_workers=0, prefetch=0).prefetch == 0  # built in the loop
    assert TrainConfig(num_workers=2, prefetch=1).num_workers == 2


def test_per_model_settings_override_the_shared_ones_for_that_model_only():
    cfg = TrainConfig(epochs=3, lr=1e-3, per_model={"mvvse": {"epochs": 5, "batch_size": 8}})
    mvvse = cfg.for_model("mvvse")
    assert (mvvse.epochs, mvvse.batch_size, mvvse.lr) == (5, 8, 1e-3)
    assert mvvse.per_model == {} and isinstance(mvvse, TrainConfig)
    other = cfg.for_model("vsepp")
    assert other.model_dump() == cfg.model_dump(exclude={"per_model"}) | {"per_model": {}}
    with pytest.raises(pydantic.ValidationError, match=r"per_model\.huse\.epochs"):
        TrainConfig(per_model={"huse": {"epochs": 0}})
    with pytest.raises(pydantic.ValidationError, match=r"per_model\.huse: epoch: not a train"):
        TrainConfig(per_model={"huse": {"epoch": 3}})


def test_autocast_is_bf16_on_cuda_and_off_elsewhere(monkeypatch):
    with autocast(torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(_rand(2, 2), _rand(2, 2)).dtype == torch.float32
    with warnings.catch_warnings():  # no CUDA here: torch warns and disables it
        warnings.simplefilter("ignore")
        cuda = autocast(torch.device("cuda"))
    assert cuda.device == "cuda" and cuda.fast_dtype == torch.bfloat16
    assert cuda._enabled == torch.cuda.is_available()
    # what is asked of torch, whether or not this machine has a GPU
    asked = []
    monkeypatch.setattr(torch, "autocast", lambda *a, **kw: asked.append((a, kw)))
    autocast(torch.device("cuda", 0))
    autocast(torch.device("cpu"))
    assert asked == [
        (("cuda",), {"dtype": torch.bfloat16, "enabled": True}),
        (("cpu",), {"dtype": torch.bfloat16, "enabled": False}),
    ]


def test_host_lengths_keeps_the_host_copy():
    lengths = torch.tensor([3, 1])
    assert host_lengths(lengths) is lengths  # already on the host
    on_device = torch.empty(2, dtype=torch.long, device="meta")
    on_device.host = lengths  # what models.data.to_device keeps
    assert host_lengths(on_device) is lengths

    class OnGPU:  # lengths on a GPU without a host copy, as host_lengths sees them
        device = torch.device("cuda", 0)

        def cpu(self):
            return lengths

    assert host_lengths(OnGPU()) is lengths  # copied back
    kept = OnGPU()
    kept.host = torch.tensor([5])
    assert host_lengths(kept) is kept.host


# ----------------------------------------------------------------------------- similarities


def test_l2norm_against_numpy():
    x = _rand(4, 3, 5)
    for dim in (-1, 1, 0):
        want = x.numpy() / np.linalg.norm(x.numpy(), axis=dim, keepdims=True)
        np.testing.assert_allclose(l2norm(x, dim=dim).numpy(), want, rtol=1e-6, atol=1e-7)
    zero = torch.zeros(2, 3)
    assert torch.equal(l2norm(zero), zero)  # no NaN for a zero vector
    tiny = torch.full((1, 2), 1e-12)  # under eps: divided by eps, not normalised
    torch.testing.assert_close(l2norm(tiny), tiny / 1e-8)


def test_dot_and_cosine_similarities_against_loops():
    img, txt = _rand(3, 4, seed=1), _rand(5, 4, seed=2)
    dots = [[sum(float(a) * float(b) for a, b in zip(i, t, strict=True)) for t in txt] for i in img]
    torch.testing.assert_close(dot_sim(img, txt), torch.tensor(dots))
    norm = lambda v: float(v.norm())  # noqa: E731
    cos = [[dots[i][c] / (norm(img[i]) * norm(txt[c])) for c in range(5)] for i in range(3)]
    torch.testing.assert_close(cosine_sim(img, txt), torch.tensor(cos))
    # bf16 embeddings (a bf16 encoder's output): float32 scores of the same values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dot_sim(img.bfloat16(), txt.bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, img.bfloat16().float() @ txt.bfloat16().float().t())


def test_multiview_sim_is_the_best_view():
    img, txt = l2norm(_rand(4, 3, 6, seed=3)), l2norm(_rand(5, 6, seed=4))
    want = [[max(float(img[i, v] @ txt[c]) for v in range(3)) for c in range(5)] for i in range(4)]
    got = multiview_sim(img, txt)
    torch.testing.assert_close(got, torch.tensor(want))
    best = torch.einsum("ivd,td->itv", img, txt).argmax(-1)
    assert len(set(best.flatten().tolist())) == 3  # every view wins somewhere
    assert torch.equal(multiview_sim(img[:, :1], txt), img[:, 0] @ txt.t())  # one view


# ----------------------------------------------------------------------------- masking, pooling


def test_lengths_mask_and_masked_mean_against_loops():
    lengths = torch.tensor([3, 1, 0, 4])
    mask = lengths_mask(lengths, 4)
    assert mask.tolist() == [[j < n for j in range(4)] for n in (3, 1, 0, 4)]
    x = _rand(4, 4, 2, seed=5)
    got = masked_mean(x, mask)
    for b, n in enumerate((3, 1, 0, 4)):
        want = [sum(float(x[b, j, d]) for j in range(n)) / max(n, 1) for d in range(2)]
        assert got[b].tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
    # a bf16 input (a bf16 encoder's tokens) gives a bf16 mean
    assert masked_mean(x.bfloat16(), mask).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- VSE++ hinge


def _hinges(s: list[list[float]], margin: float, hardest: bool) -> float:
    """VSE++ eq. 5 (sum over negatives) or eq. 6 (the hardest), summed over the pairs."""
    n, total = len(s), 0.0
    for b in range(n):
        caption = [max(0.0, margin - s[b][b] + s[b][c]) for c in range(n) if c != b]
        image = [max(0.0, margin - s[b][b] + s[i][b]) for i in range(n) if i != b]
        total += (max(caption) + max(image)) if hardest else (sum(caption) + sum(image))
    return total


@pytest.mark.parametrize("hardest", [True, False])
def test_hinge_triplet_is_vsepp_eq_5_and_6(hardest):
    g = torch.Generator().manual_seed(6)
    s = torch.rand(5, 5, generator=g, dtype=torch.float64) * 2 - 1
    s = s + 0.6 * torch.eye(5, dtype=torch.float64)
    s[0, 1] = 3.0  # one image row and one caption column with a clear hardest negative
    for margin in (0.2, 0.5):
        got = hinge_triplet(s, margin, max_violation=hardest).item()
        assert got == pytest.approx(_hinges(s.tolist(), margin, hardest))
    # the two directions differ on a non-symmetric matrix: both are counted
    one_sided = _hinges(torch.triu(s).tolist(), 0.2, hardest)
    assert hinge_triplet(torch.triu(s), 0.2, hardest).item() == pytest.approx(one_sided)


def test_hinge_triplet_hand_made():
    # pair 0: 0.9 vs negatives caption 0.5, image 0.8; pair 1: 0.4 vs caption 0.8, image 0.5
    s = torch.tensor([[0.9, 0.5], [0.8, 0.4]])
    # MH: pair 0 caption [0.2 - 0.9 + 0.5]_+ = 0, image [0.2 - 0.9 + 0.8] = 0.1;
    #     pair 1 caption [0.2 - 0.4 + 0.8] = 0.6, image [0.2 - 0.4 + 0.5] = 0.3
    assert hinge_triplet(s, 0.2, True).item() == pytest.approx(1.0)
    assert hinge_triplet(s, 0.2, False).item() == pytest.approx(1.0)  # one negative each
    s3 = torch.tensor([[0.9, 0.5, 0.85], [0.8, 0.4, 0.3], [0.0, 0.0, 0.95]])
    # caption 1 has two violating negatives (0.8, 0.3 against 0.4): SH adds both, MH one
    assert hinge_triplet(s3, 0.2, False).item() == pytest.approx(_hinges(s3.tolist(), 0.2, False))
    assert hinge_triplet(s3, 0.2, False).item() > hinge_triplet(s3, 0.2, True).item()


# ----------------------------------------------------------------------------- GRU text


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gru_text_matches_the_gru_on_each_unpadded_caption(bidirectional):
    """Packing against torch's GRU run on each caption alone: the state at the last word
    (VSE++'s mu(c), eq. 2), or with ``pool=False`` the per-word states, the two
    directions averaged (SCAN's ``EncoderText``); padded positions are zero."""
    torch.manual_seed(0)
    enc = GRUText(vocab_size=12, word_dim=5, embed_size=4, bidirectional=bidirectional)
    lengths = torch.tensor([4, 1, 3, 0])  # 0: an empty caption reads its first position
    words = torch.tensor([[3, 4, 5, 6, 0], [7, 0, 0, 0, 0], [8, 9, 10, 0, 0], [0, 0, 0, 0, 0]])
    pooled, states = enc(words, lengths), enc(words, lengths, pool=False)
    assert pooled.shape == (4, 4) and states.shape == (4, 5, 4)
    for b, n in enumerate(lengths.tolist()):
        n = max(n, 1)
        out, _ = enc.rnn(enc.embed(words[b : b + 1, :n]))  # (1, n, H or 2H)
        if bidirectional:
            out = (out[..., :4] + out[..., 4:]) / 2
        torch.testing.assert_close(states[b, :n], out[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(states[b, n:], torch.zeros(5 - n, 4))
        torch.testing.assert_close(pooled[b], out[0, n - 1], rtol=1e-5, atol=1e-6)
    # word embeddings start U(-0.1, 0.1), as VSE++'s and SCAN's
    w = enc.embed.weight
    assert w.abs().max() <= 0.1 and w.std() > 0.05
    # <pad> (id 0) is never trained, even where an empty caption reads it; words are
    pooled.sum().backward()
    assert torch.equal(w.grad[0], torch.zeros(5))
    assert all(w.grad[i].abs().sum() > 0 for i in (3, 7, 8))


def test_gru_text_is_one_directional_unless_asked():
    """VSE++'s text encoder (eq. 2) is a one-direction GRU."""
    enc = GRUText(vocab_size=12, word_dim=5, embed_size=4)
    assert not enc.bidirectional and not enc.rnn.bidirectional


# ----------------------------------------------------------------------------- devices

SMALL = {
    "vsepp": dict(embed_size=16, word_dim=8),
    "mvvse": dict(embed_size=16, word_dim=8),
    "camera": dict(
        embed_size=16, heads=2, views=3, kernels=[1, 3], dilations=[1, 2], channels=[4, 4]
    ),
    "huse": dict(hidden=16, image_layers=2, text_layers=2, dropout=0.0),
    "univse": dict(embed_size=16, d_basic=8, d_modif=8),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_models_make_their_tensors_on_the_inputs_device(name):
    """Masks, identities and indices are made on the device of the batch, not on torch's
    default device: with the default set to "meta" (a device that holds no values),
    CPU inputs give the same losses, embeddings and attention maps as a plain run,
    where a tensor made on the default device would fail to combine with them (as it
    would on a GPU)."""
    data = TinyPairs(n_images=6)
    batch = {**data.pair_batch(np.arange(6)), "epoch": 3}
    torch.manual_seed(0)
    cls = model_class(name)
    model = cls(cls.Config(**SMALL[name]), data.info).eval()

    def run():
        out = {}
        if name == "univse":
            negatives = model.sample_negatives(batch, torch.Generator().manual_seed(0))
            out.update({f"neg_{k}": v for k, v in negatives.items()})
            parts = model.loss(batch, negatives)
        else:
            parts = model.loss(batch)
        out.update({k: v.detach() for k, v in parts.items()})
        img, txt = model.encode_image(batch), model.encode_text(batch)
        out.update(img=img, txt=txt, sim=model.similarity(img, txt))
        if hasattr(model, "view_attention"):
            out["attention"] = model.view_attention(batch)
        return out

    want = run()
    with torch.device("meta"):
        got = run()
    with made_elsewhere():  # and every tensor it moves names where to
        moved = run()
    assert got.keys() == want.keys() == moved.keys()
    for key, value in want.items():
        assert got[key].device.type == "cpu", key
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(moved[key], value, rtol=0, atol=0, msg=key)
