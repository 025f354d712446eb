"""UniVSE (models/univse.py): each loss term against a direct computation, the encoders
against the paper's formulas, u_cap, the eta schedule, negative sampling, GloVe loading and
an overfit run on TinyPairs."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from model_data import TinyPairs, overfit
from pydantic import ValidationError

from models.common import hinge_triplet
from models.data.info import DataInfo
from models.univse import (
    UniVSE,
    UniVSEConfig,
    _phrase_equal,
    _sample,
    load_glove,
    ranking_loss,
    region_alignment,
    relation_loss,
)

SMALL = dict(embed_size=16, d_basic=6, d_modif=5)

# hand-made vocabulary: 1 <start>, 2 <end>, nouns 5-8, adjectives 10-12, predicates 15-18
INFO = DataInfo(
    grid_dim=4,
    vocab_size=20,
    negatives={
        "nouns": [[5], [6], [7], [8]],
        "adjectives": [[10], [11], [12]],
        "relations": [[15], [16], [17, 18]],
    },
)


def hand_batch() -> dict:
    """Caption 0: "5 10 12 | 6" with relation (5, "17 18", 6); caption 1: "7 11", no
    relations. Object 0 of caption 0 carries both adjectives 10 and 12."""
    torch.manual_seed(1)
    return {
        "grid": torch.randn(2, 3, 4),
        "words": torch.tensor([[1, 5, 10, 6, 2], [1, 7, 11, 2, 0]]),
        "word_lengths": torch.tensor([5, 4]),
        "objects": torch.tensor([[[5], [6]], [[7], [0]]]),
        "object_mask": torch.tensor([[True, True], [True, False]]),
        "attributes": torch.tensor([[[10], [12]], [[11], [0]]]),
        "attribute_mask": torch.tensor([[True, True], [True, False]]),
        "attribute_objects": torch.tensor([[0, 0], [0, 0]]),
        "relations": torch.tensor([[[17, 18]], [[0, 0]]]),
        "relation_mask": torch.tensor([[True], [False]]),
        "relation_subjects": torch.tensor([[0], [0]]),
        "relation_objects": torch.tensor([[1], [0]]),
    }


def make_model(info: DataInfo = INFO, **kw) -> UniVSE:
    torch.manual_seed(0)
    return UniVSE(UniVSEConfig(**{**SMALL, **kw}), info)


def phi_direct(model: UniVSE, w: torch.Tensor) -> torch.Tensor:
    """Sec. 3.2: Norm(sigmoid(W1 w + b1) * tanh(W2 w + b2))."""
    g = torch.sigmoid(model.phi.gate.weight @ w + model.phi.gate.bias)
    h = torch.tanh(model.phi.value.weight @ w + model.phi.value.bias)
    x = g * h
    return x / x.norm()


def gru_direct(model: UniVSE, xs: list[torch.Tensor]) -> torch.Tensor:
    """psi: the GRU equations step by step, the normalised last state."""
    gru = model.psi
    w_ir, w_iz, w_in = gru.weight_ih_l0.chunk(3)
    w_hr, w_hz, w_hn = gru.weight_hh_l0.chunk(3)
    b_ir, b_iz, b_in = gru.bias_ih_l0.chunk(3)
    b_hr, b_hz, b_hn = gru.bias_hh_l0.chunk(3)
    h = torch.zeros(gru.hidden_size)
    for x in xs:
        r = torch.sigmoid(w_ir @ x + b_ir + w_hr @ h + b_hr)
        z = torch.sigmoid(w_iz @ x + b_iz + w_hz @ h + b_hz)
        n = torch.tanh(w_in @ x + b_in + r * (w_hn @ h + b_hn))
        h = (1 - z) * n + z * h
    return h / h.norm()


def word(model: UniVSE, i: int) -> torch.Tensor:
    """w^(basic) (+) w^(modif) of word i."""
    return torch.cat([model.basic.weight[i], model.modif.weight[i]])


def pair(model: UniVSE, noun: int, adjective: int) -> torch.Tensor:
    """w_{a,n} = w_n^(basic) (+) w_a^(modif)."""
    return torch.cat([model.basic.weight[noun], model.modif.weight[adjective]])


def norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


# ---- config -----------------------------------------------------------------------------


def test_config_defaults_are_the_papers_and_strict():
    cfg = UniVSEConfig()
    assert cfg.embed_size == 1024 and cfg.d_basic == 300
    assert cfg.alpha == 0.75 and cfg.margin == 0.2 and cfg.glove is None
    assert (cfg.eta_comp, cfg.eta_obj, cfg.eta_attr, cfg.eta_rel) == (0.5, 0.5, 0.5, 1.0)
    assert cfg.rel_start_epoch == 2 and cfg.eta_rel_start == 0.0
    with pytest.raises(ValidationError):
        UniVSEConfig(alfa=0.5)
    with pytest.raises(ValidationError):
        UniVSEConfig(alpha=1.5)


# ---- encoders (sec. 3.2-3.3) --------------------------------------------------------------


def test_shapes_and_similarity():
    model, batch = make_model(), hand_batch()
    img, txt = model.encode_image(batch), model.encode_text(batch)
    assert img.shape == (2, 16) and txt.shape == (2, 16)
    assert torch.allclose(img.norm(dim=1), torch.ones(2), atol=1e-5)
    v, regions = model.encode_regions(batch)
    assert regions.shape == (2, 3, 16)
    assert torch.allclose(img, v, atol=1e-5)
    # v = Norm(mean of the 1x1-conv regions): sec. 3.3
    conv = batch["grid"] @ model.conv.weight.t() + model.conv.bias  # (B, G, d)
    assert torch.allclose(v[1], norm(conv[1].mean(0)), atol=1e-5)
    assert torch.allclose(regions[0, 2], norm(conv[0, 2]), atol=1e-5)
    sims = model.similarity(img[:1], torch.cat([txt, txt]))
    assert sims.shape == (1, 4)
    assert torch.allclose(sims[0, 1], img[0] @ norm(txt[1]), atol=1e-5)


def test_components_follow_phi_and_psi():
    model, batch = make_model(), hand_batch()
    with torch.no_grad():
        u = model.encode_components(batch)
        # objects: phi(w_n^(basic) (+) w_n^(modif))
        assert torch.allclose(u["obj"][0, 1], phi_direct(model, word(model, 6)), atol=1e-5)
        # (adjective, noun): phi(w_n^(basic) (+) w_a^(modif)); attribute 1 of caption 0 is
        # "12" on object 0 ("5")
        assert torch.allclose(u["attr"][0, 1], phi_direct(model, pair(model, 5, 12)), atol=1e-5)
        # relation: psi(phi(5), phi(17), phi(18), phi(6))
        seq = [phi_direct(model, word(model, i)) for i in (5, 17, 18, 6)]
        assert torch.allclose(u["rel"][0, 0], gru_direct(model, seq), atol=1e-5)
        # sentence: psi over phi of the caption's words (caption 1 has 4)
        seq = [phi_direct(model, word(model, i)) for i in (1, 7, 11, 2)]
        assert torch.allclose(u["sent"][1], gru_direct(model, seq), atol=1e-5)


def test_multi_word_phrases_average_their_words():
    """A phrase's basic and modifier embeddings are the means over its words, padding
    excluded, for ids of any leading shape (``(..., W) -> (..., d)``)."""
    model = make_model()
    phrases = torch.tensor([[5, 6, 0], [7, 0, 0], [17, 18, 12]])  # (3, W=3)
    basic, modif = model.basic.weight, model.modif.weight
    with torch.no_grad():
        want = []
        for ids in ([5, 6], [7], [17, 18, 12]):
            mean_basic = sum(basic[i] for i in ids) / len(ids)
            mean_modif = sum(modif[i] for i in ids) / len(ids)
            want.append(phi_direct(model, torch.cat([mean_basic, mean_modif])))
        want = torch.stack(want)  # (3, d)
        for shape in [(3, 3), (1, 3, 3), (3, 1, 1, 3)]:
            got = model.encode_object(phrases.reshape(shape))
            assert got.shape == (*shape[:-1], 16)
            torch.testing.assert_close(got.reshape(3, 16), want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(model.encode_object(phrases[1]), want[1], atol=1e-6)  # (W,)
        # (adjective, noun): the noun phrase's basic mean, the adjective phrase's modifier mean
        got = model.encode_attribute(phrases[0], phrases[2])
        pair = torch.cat([(basic[5] + basic[6]) / 2, (modif[17] + modif[18] + modif[12]) / 3])
        torch.testing.assert_close(got, phi_direct(model, pair), rtol=1e-5, atol=1e-6)
        # a model cast to bf16 for inference encodes in bf16
        half = model.to(torch.bfloat16).encode_object(phrases)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=0, atol=0.02)


def test_sentence_state_is_read_after_its_length():
    """psi reads the GRU state after each caption's length, clamped to the padded width
    (a length 0 reads the first position, as ``GRUText`` does)."""
    model = make_model()
    words = torch.tensor([[1, 5, 10, 6, 2], [1, 7, 2, 0, 0], [1, 8, 0, 0, 0], [3, 0, 0, 0, 0]])
    with torch.no_grad():
        got = model.encode_sentence(words, torch.tensor([5, 3, 0, 9]))
        for b, n in enumerate([5, 3, 1, 5]):
            seq = [phi_direct(model, word(model, int(i))) for i in words[b, :n]]
            torch.testing.assert_close(got[b], gru_direct(model, seq), rtol=1e-5, atol=1e-5)


def test_caption_is_alpha_mix_of_sentence_and_components():
    model, batch = make_model(alpha=0.75), hand_batch()
    with torch.no_grad():
        u = model.encode_components(batch)
        # u_comp = Norm(sum of the valid components), written out per caption
        comp0 = norm(
            u["obj"][0, 0] + u["obj"][0, 1] + u["attr"][0, 0] + u["attr"][0, 1] + u["rel"][0, 0]
        )
        comp1 = norm(u["obj"][1, 0] + u["attr"][1, 0])  # no relation, padded rows excluded
        assert torch.allclose(u["comp"][0], comp0, atol=1e-5)
        assert torch.allclose(u["comp"][1], comp1, atol=1e-5)
        cap = model.encode_text(batch)
        assert torch.allclose(cap, 0.75 * u["sent"] + 0.25 * u["comp"], atol=1e-6)
        # alpha is read from the config
        other = UniVSE(UniVSEConfig(**SMALL, alpha=0.3), INFO)
        other.load_state_dict(model.state_dict())
        assert torch.allclose(
            other.encode_text(batch), 0.3 * u["sent"] + 0.7 * u["comp"], atol=1e-6
        )


# ---- loss terms (eq. 1-4) ---------------------------------------------------------------


def test_ranking_loss_eq1_direct():
    torch.manual_seed(3)
    img = norm_rows(torch.randn(4, 5))
    txt = norm_rows(torch.randn(4, 5))
    margin = 0.2

    def direct(keep):
        total = 0.0
        for i in keep:
            s = lambda a, b: float(img[a] @ txt[b])  # noqa: E731
            hardest_c = max([max(0.0, margin + s(i, c) - s(i, i)) for c in keep if c != i] + [0])
            hardest_i = max([max(0.0, margin + s(j, i) - s(i, i)) for j in keep if j != i] + [0])
            total += hardest_c + hardest_i
        return total

    got = ranking_loss(img, txt, margin)
    assert got.item() == pytest.approx(direct(range(4)), abs=1e-5)
    assert got.item() == pytest.approx(hinge_triplet(img @ txt.t(), margin, True).item(), abs=1e-5)
    valid = torch.tensor([True, False, True, True])
    assert ranking_loss(img, txt, margin, valid).item() == pytest.approx(
        direct([0, 2, 3]), abs=1e-5
    )
    assert direct([0, 2, 3]) != pytest.approx(direct(range(4)))  # the mask matters here


def norm_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def test_region_alignment_eq2_3_direct():
    torch.manual_seed(4)
    regions = norm_rows(torch.randn(2, 3, 4))  # (B, G, d)
    pos = norm_rows(torch.randn(2, 2, 4))  # (B, N, d)
    neg = norm_rows(torch.randn(2, 2, 4))
    margin = 0.5
    got = region_alignment(regions, pos, neg, margin)
    assert got.shape == (2, 2)
    for b in range(2):
        for n in range(2):
            s_pos = [float(pos[b, n] @ regions[b, i]) for i in range(3)]
            s_neg = [float(neg[b, n] @ regions[b, i]) for i in range(3)]
            z = sum(math.exp(s) for s in s_pos)
            want = sum(
                math.exp(s_pos[i]) / z * max(0.0, margin + s_neg[i] - s_pos[i]) for i in range(3)
            )
            assert got[b, n].item() == pytest.approx(want, abs=1e-5)
    assert got.sum().item() > 0  # the hinge is active somewhere in this example


def test_relation_loss_textual_negatives_direct():
    torch.manual_seed(5)
    img = norm_rows(torch.randn(3, 4))
    pos = norm_rows(torch.randn(3, 2, 4))
    neg = norm_rows(torch.randn(3, 2, 4))
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    neg_valid = torch.tensor([[True, False], [True, True], [True, True]])
    margin = 0.3
    got = relation_loss(img, pos, neg, mask, neg_valid, margin)
    want = 0.0
    for b in range(3):
        for r in range(2):
            if not mask[b, r]:
                continue
            candidates = [float(neg[b, r] @ img[b])] if neg_valid[b, r] else []
            candidates += [
                float(pos[o, q] @ img[b])
                for o in range(3)
                for q in range(2)
                if o != b and mask[o, q]
            ]
            s_pos = float(pos[b, r] @ img[b])
            want += max(0.0, margin + max(candidates) - s_pos)
    assert got.item() == pytest.approx(want, abs=1e-5)
    assert want > 0


def test_model_loss_terms_match_direct_computation():
    model, batch = make_model(), hand_batch()
    batch["epoch"] = 5
    neg = model.sample_negatives(batch, torch.Generator().manual_seed(0))
    out = model.loss(batch, neg)
    m = model.cfg.margin
    with torch.no_grad():
        v, regions = model.encode_regions(batch)
        u = model.encode_components(batch)

        def hardest_pair_loss(txt):
            total = 0.0
            for i in range(2):
                j = 1 - i
                total += max(0.0, m + float(v[i] @ txt[j]) - float(v[i] @ txt[i]))
                total += max(0.0, m + float(v[j] @ txt[i]) - float(v[i] @ txt[i]))
            return total

        def eq3(b, u_pos, u_neg):
            s_pos = [float(u_pos @ regions[b, i]) for i in range(3)]
            s_neg = [float(u_neg @ regions[b, i]) for i in range(3)]
            z = sum(math.exp(s) for s in s_pos)
            pairs = zip(s_pos, s_neg, strict=True)
            return sum(math.exp(p) / z * max(0.0, m + n - p) for p, n in pairs)

        obj = sum(
            eq3(b, u["obj"][b, o], phi_direct(model, word(model, int(neg["objects"][b, o, 0]))))
            for b, o in [(0, 0), (0, 1), (1, 0)]
        )
        attr = 0.0
        for b, a in [(0, 0), (0, 1), (1, 0)]:
            noun, adj = int(neg["attr_nouns"][b, a, 0]), int(neg["attr_adjectives"][b, a, 0])
            attr += eq3(b, u["attr"][b, a], phi_direct(model, pair(model, noun, adj)))
        # the only relation (caption 0); caption 1 has none, so only the sampled negative
        ids = [
            int(t)
            for t in torch.cat(
                [neg["rel_subjects"][0, 0], neg["rel_predicates"][0, 0], neg["rel_objects"][0, 0]]
            )
            if t != 0
        ]
        u_neg = gru_direct(model, [phi_direct(model, word(model, i)) for i in ids])
        rel = max(0.0, m + float(u_neg @ v[0]) - float(u["rel"][0, 0] @ v[0]))

    assert out["sent"].item() == pytest.approx(hardest_pair_loss(u["sent"]), abs=1e-5)
    assert out["comp"].item() == pytest.approx(hardest_pair_loss(u["comp"]), abs=1e-5)
    assert out["obj"].item() == pytest.approx(obj, abs=1e-5)
    assert out["attr"].item() == pytest.approx(attr, abs=1e-5)
    assert out["rel"].item() == pytest.approx(rel, abs=1e-5)
    # eq. 4 after the relation warm-up
    want = out["sent"] + 0.5 * (out["comp"] + out["obj"] + out["attr"]) + 1.0 * out["rel"]
    assert out["loss"].item() == pytest.approx(want.item(), abs=1e-5)


def test_eta_schedule_sec_3_5():
    model = make_model()
    for epoch in (0, 1):
        assert model.etas(epoch) == {"comp": 0.5, "obj": 0.5, "attr": 0.5, "rel": 0.0}
    for epoch in (2, 3, 30):
        assert model.etas(epoch) == {"comp": 0.5, "obj": 0.5, "attr": 0.5, "rel": 1.0}
    assert make_model(rel_start_epoch=4, eta_rel=2.0).etas(3)["rel"] == 0.0
    assert make_model(rel_start_epoch=4, eta_rel=2.0).etas(4)["rel"] == 2.0
    # no "epoch" in the batch: epoch 0, relations off
    batch = hand_batch()
    neg = model.sample_negatives(batch, torch.Generator().manual_seed(0))
    out = model.loss(batch, neg)
    assert out["rel"].item() > 0
    want = out["sent"] + 0.5 * (out["comp"] + out["obj"] + out["attr"])
    assert out["loss"].item() == pytest.approx(want.item(), abs=1e-6)
    # epoch 0 is before epoch 1: relations from epoch 1 are still off without "epoch"
    early = make_model(rel_start_epoch=1)
    out = early.loss(batch, neg)
    want = out["sent"] + 0.5 * (out["comp"] + out["obj"] + out["attr"])
    assert out["loss"].item() == pytest.approx(want.item(), abs=1e-6)
    out = early.loss({**batch, "epoch": 1}, neg)
    assert out["loss"].item() == pytest.approx((want + out["rel"]).item(), abs=1e-6)


# ---- negatives (sec. 3.4) ---------------------------------------------------------------


def test_negatives_differ_from_the_positives_they_replace():
    model, batch = make_model(), hand_batch()
    gen = torch.Generator().manual_seed(0)
    swaps = {"attr": set(), "rel": set()}
    for _ in range(60):
        neg = model.sample_negatives(batch, gen)
        # nouns: never one of the caption's nouns
        assert neg["object_valid"][batch["object_mask"]].all()
        assert set(neg["objects"][0, :, 0].tolist()) <= {7, 8}
        assert neg["objects"][1, 0, 0].item() in {5, 6, 8}
        # (adjective, noun): exactly one of the two replaced
        for b, a in [(0, 0), (0, 1), (1, 0)]:
            noun = batch["objects"][b, batch["attribute_objects"][b, a], 0].item()
            adj = batch["attributes"][b, a, 0].item()
            new_noun = neg["attr_nouns"][b, a, 0].item()
            new_adj = neg["attr_adjectives"][b, a, 0].item()
            assert neg["attribute_valid"][b, a]
            assert (new_noun != noun) + (new_adj != adj) == 1
            if new_adj != adj:  # not another adjective of the same object ("5 10 12")
                assert new_adj in ({11} if b == 0 else {10, 12})
                swaps["attr"].add("adjective")
            else:
                assert new_noun not in {o[0] for o in batch["objects"][b].tolist()}
                swaps["attr"].add("noun")
        # relation (5, "17 18", 6): exactly one of subject, predicate, object replaced
        triple = (
            neg["rel_subjects"][0, 0].tolist(),
            neg["rel_predicates"][0, 0].tolist(),
            neg["rel_objects"][0, 0].tolist(),
        )
        positive = ([5], [17, 18], [6])
        changed = [
            i
            for i in range(3)
            if triple[i][: len(positive[i])] != positive[i] or any(triple[i][len(positive[i]) :])
        ]
        assert len(changed) == 1 and neg["relation_valid"][0, 0]
        swaps["rel"].add(changed[0])
        if changed[0] == 1:
            assert triple[1][0] in {15, 16} and not any(triple[1][1:])
        else:
            assert triple[changed[0]][0] in {7, 8}
    assert swaps == {"attr": {"adjective", "noun"}, "rel": {0, 1, 2}}


def test_negatives_respect_the_image_and_an_exhausted_vocabulary():
    batch = hand_batch()
    # both captions describe one image: caption 1's noun 7 is excluded for caption 0 too
    batch["caption_image"] = torch.tensor([0, 0])
    model = make_model()
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        neg = model.sample_negatives(batch, gen)
        assert set(neg["objects"][:, :, 0][batch["object_mask"]].tolist()) == {8}
    # vocabularies with nothing left to sample: no valid negatives, a finite loss
    info = DataInfo(grid_dim=4, vocab_size=20, negatives={"nouns": [[5], [6], [7]]})
    model = make_model(info)
    neg = model.sample_negatives(batch, gen)
    assert not neg["object_valid"].any() and not neg["relation_valid"].any()
    assert not neg["attribute_valid"].any()
    out = model.loss({**batch, "epoch": 3}, neg)
    assert out["obj"].item() == 0 and out["attr"].item() == 0 and out["rel"].item() == 0
    assert torch.isfinite(out["loss"])


def test_same_generator_seed_same_negatives():
    model, batch = make_model(), hand_batch()
    torch.manual_seed(1)
    a = model.sample_negatives(batch, torch.Generator().manual_seed(7))
    state = torch.get_rng_state()
    b = model.sample_negatives(batch, torch.Generator().manual_seed(7))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # every draw is the generator's: the global RNG (dropout, other models) is not touched
    assert torch.equal(torch.get_rng_state(), state)


def test_phrase_equality_against_loops():
    """Phrase ids ``(..., Wa)`` against a vocabulary ``(K, Wv)``: equal word for word,
    zero padding aside, whichever is wider."""
    vocab = torch.tensor([[5, 6, 7], [5, 0, 0], [6, 0, 0]])  # K = Wv = 3
    narrow = torch.tensor([[5], [6], [7]])  # K = 3, Wv = 1
    long = torch.tensor([[5, 6, 7, 8]])  # K = 1 < Wv = 4
    for phrases in ([[5, 6]], [[5], [6]], [[5, 6, 7, 8]], [[5, 6, 7], [6, 0, 0]]):
        for table in (vocab, narrow, long):
            a = torch.tensor(phrases)

            def same(p, q):
                return [x for x in p if x] == [x for x in q if x]

            want = [[same(p, q) for q in table.tolist()] for p in a.tolist()]
            assert _phrase_equal(a, table).tolist() == want  # (N, W)
            assert _phrase_equal(a[None], table).tolist() == [want]  # (B, N, W)


def test_sample_is_uniform_among_the_allowed_entries():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.tensor([[True, False, True, True]])  # one row
    seen = set()
    for _ in range(60):
        index, valid = _sample(allowed, gen)
        assert index.shape == (1,) and valid.tolist() == [True]
        seen.add(int(index))
    assert seen == {0, 2, 3}
    counts = torch.bincount(
        torch.stack([_sample(allowed.expand(300, 4), gen)[0] for _ in range(10)]).flatten(),
        minlength=4,
    )
    assert counts[1] == 0 and all(abs(int(c) - 1000) < 100 for c in counts[[0, 2, 3]])  # 4 sd
    # rows with nothing allowed are not valid; no rows at all give empty results
    index, valid = _sample(torch.tensor([[[True, False], [False, False]]]), gen)
    assert index.shape == (1, 2) and valid.tolist() == [[True, False]] and index[0, 0] == 0
    for shape in [(0, 4), (2, 0, 4)]:
        with torch.device("meta"):  # made where the inputs are, not on the default device
            index, valid = _sample(torch.ones(shape, dtype=torch.bool, device="cpu"), gen)
        assert index.shape == valid.shape == shape[:-1]
        assert index.dtype == torch.long and index.device.type == "cpu"


def _widths_batch(objects, attributes, predicates) -> dict:
    """One caption: one object phrase, one attribute phrase on it, and two relations of
    the object to itself with the given predicates."""
    return {
        "objects": torch.tensor([[objects]]),
        "object_mask": torch.tensor([[True]]),
        "attributes": torch.tensor([[attributes]]),
        "attribute_mask": torch.tensor([[True]]),
        "attribute_objects": torch.tensor([[0]]),
        "relations": torch.tensor([predicates]),
        "relation_mask": torch.tensor([[True, True]]),
        "relation_subjects": torch.tensor([[0, 0]]),
        "relation_objects": torch.tensor([[0, 0]]),
    }


@pytest.mark.parametrize(
    "objects, attributes, predicates, vocab",
    [
        # caption phrases wider than the vocabulary's
        ([5, 6, 7], [10, 11, 12], [[16, 17, 18], [16, 0, 0]], ([[8, 9]], [[13]], [[15]])),
        # vocabulary phrases wider than the caption's (and than there are phrases)
        ([5], [10], [[16], [17]], ([[8, 9]], [[13, 14]], [[15, 14]])),
    ],
)
def test_negative_phrases_keep_every_word(objects, attributes, predicates, vocab):
    """Multi-word phrases: the (adjective, noun) and (subject, predicate, object)
    negatives keep the whole phrases they do not replace and take the whole vocabulary
    phrase they draw, whichever is wider."""
    nouns, adjectives, relations = vocab
    info = DataInfo(
        grid_dim=4,
        vocab_size=20,
        negatives={"nouns": nouns, "adjectives": adjectives, "relations": relations},
    )
    model, batch = make_model(info), _widths_batch(objects, attributes, predicates)
    gen = torch.Generator().manual_seed(0)

    def words(ids):
        return [int(i) for i in ids if i]

    attr_swaps, rel_swaps = set(), set()
    for _ in range(30):
        neg = model.sample_negatives(batch, gen)
        assert words(neg["objects"][0, 0]) == nouns[0]
        noun, adjective = words(neg["attr_nouns"][0, 0]), words(neg["attr_adjectives"][0, 0])
        assert (noun, adjective) in [(objects, adjectives[0]), (nouns[0], attributes)]
        attr_swaps.add(noun == objects)
        for r in range(2):
            triple = [words(neg[f"rel_{k}"][0, r]) for k in ("subjects", "predicates", "objects")]
            positive = [objects, words(predicates[r]), objects]
            replaced = [i for i in range(3) if triple[i] != positive[i]]
            assert len(replaced) == 1
            assert triple[replaced[0]] == (relations[0] if replaced[0] == 1 else nouns[0])
            rel_swaps.add(replaced[0])
    assert attr_swaps == {True, False} and rel_swaps == {0, 1, 2}


def test_adjectives_of_other_objects_are_negatives():
    """The adjective replaced in (adjective, noun) is one not modifying the same object:
    another object's adjective in the caption is a fine negative."""
    batch = hand_batch()
    # caption 0: 10 on object 0 ("5"), 12 on object 1 ("6")
    batch["attribute_objects"] = torch.tensor([[0, 1], [0, 0]])
    model, gen = make_model(), torch.Generator().manual_seed(0)
    drawn = set()
    for _ in range(60):
        neg = model.sample_negatives(batch, gen)
        if neg["attr_nouns"][0, 0, 0] == 5:  # the adjective of "5" was replaced
            drawn.add(int(neg["attr_adjectives"][0, 0, 0]))
    assert drawn == {11, 12}


def test_has_components_when_any_kind_is_there():
    model, batch = make_model(), hand_batch()
    none = torch.zeros(2, 2, dtype=torch.bool)
    one = torch.tensor([[True, False], [False, False]])  # caption 0 only
    for omask, amask, rmask in [(one, none, none), (none, one, none), (none, none, one)]:
        masks = {"object_mask": omask, "attribute_mask": amask, "relation_mask": rmask[:, :1]}
        with torch.no_grad():
            u = model.encode_components({**batch, **masks})
        assert u["has_comp"].tolist() == [True, False]


def test_relation_with_a_short_predicate_reads_the_object_next():
    """u_rel = psi(phi(w_s), phi(w_r..), phi(w_o)): a one-word predicate padded to the
    batch's width is followed by the object, and psi stops there."""
    model = make_model()
    with torch.no_grad():
        got = model.encode_relation(
            torch.tensor([[5], [7]]),
            torch.tensor([[15, 0, 0], [17, 18, 0]]),
            torch.tensor([[6], [8]]),
        )
        for row, ids in enumerate([(5, 15, 6), (7, 17, 18, 8)]):
            want = gru_direct(model, [phi_direct(model, word(model, i)) for i in ids])
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


def test_captions_without_attributes_or_relations_give_finite_loss_and_grads():
    model, batch = make_model(), hand_batch()
    batch["attribute_mask"] = torch.zeros(2, 2, dtype=torch.bool)
    batch["relation_mask"] = torch.zeros(2, 1, dtype=torch.bool)
    batch["object_mask"] = torch.tensor([[True, True], [False, False]])  # caption 1: nothing
    batch["epoch"] = 3
    out = model.loss(batch)
    out["loss"].backward()
    assert all(torch.isfinite(v) for v in out.values())
    assert out["attr"].item() == 0 and out["rel"].item() == 0
    assert out["comp"].item() == 0  # only one caption has components: no negative pair
    for p in model.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
    assert torch.isfinite(model.encode_text(batch)).all()


def test_bf16_autocast():
    data = TinyPairs(n_images=8)
    torch.manual_seed(0)
    model = UniVSE(UniVSEConfig(**SMALL), data.info)
    batch = {**data.pair_batch(np.arange(8)), "epoch": 3}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.loss(batch)
    assert torch.isfinite(out["loss"].float())


# ---- GloVe (sec. 3.2) -------------------------------------------------------------------


def test_initialisation_and_what_checkpoints_hold():
    """Word embeddings U(-0.1, 0.1) with <pad> (id 0) zero and never trained, the 1x1
    convolution Xavier-uniform (as VSE++'s image FC); the negative-sampling vocabularies
    come from the data, not from the checkpoint."""
    info = DataInfo(grid_dim=64, vocab_size=300, negatives=INFO.negatives)
    model = make_model(info, embed_size=64, d_basic=32, d_modif=32)
    for table in (model.basic.weight, model.modif.weight):
        assert torch.equal(table[0], torch.zeros_like(table[0]))
        rest = table[1:]
        assert rest.abs().max() <= 0.1 and rest.min() < -0.099 and rest.max() > 0.099
    r = math.sqrt(6.0 / (64 + 64))
    w = model.conv.weight
    assert w.abs().max() <= r and w.min() < -0.99 * r and w.max() > 0.99 * r
    assert torch.equal(model.conv.bias, torch.zeros(64))
    assert not any(key.startswith("neg_") for key in model.state_dict())
    # <start> (id 1) is trained like any word, <pad> is not
    batch = {**hand_batch(), "epoch": 3}
    small = make_model()
    small.loss(batch)["loss"].backward()
    for table in (small.basic.weight, small.modif.weight):
        assert table.grad[1].abs().sum() > 0
        assert torch.equal(table.grad[0], torch.zeros_like(table.grad[0]))


def test_glove_rows_are_copied_and_missing_words_stay_random(tmp_path):
    path = tmp_path / "glove.txt"
    path.write_text("clock 1 2 3\ntable 4 5 6\nat name@x.com 7 8 9\nclock 0 0 0\n<pad> 1 1 1\n")
    words = ["<pad>", "table", "clock", "wall", "at name@x.com"]
    matrix = load_glove(path, words)
    assert matrix.shape == (5, 3)
    assert np.isnan(matrix[3]).all()  # "wall" is not in the file
    assert matrix[1].tolist() == [4, 5, 6] and matrix[2].tolist() == [1, 2, 3]
    assert matrix[4].tolist() == [7, 8, 9]
    info = DataInfo(grid_dim=4, vocab_size=5)
    model = make_model(info, d_basic=3)
    before = model.basic.weight.detach().clone()
    assert model.init_basic_embeddings(matrix) == 3
    after = model.basic.weight.detach()
    assert after[1].tolist() == [4, 5, 6] and after[2].tolist() == [1, 2, 3]
    assert torch.equal(after[3], before[3]) and after[3].abs().sum() > 0  # random, kept
    assert torch.equal(after[0], torch.zeros(3))  # <pad>
    with pytest.raises(ValueError, match="d_basic"):
        make_model(info, d_basic=4).init_basic_embeddings(matrix)


def test_glove_files_as_they_come(tmp_path):
    """What GloVe and fastText text files hold: words with a non-breaking space and bytes
    that are not UTF-8 (glove.840B), lines ending in a space (fastText's .vec), blank
    lines, and a download cut off mid-line (that word stays missing)."""
    path = tmp_path / "vectors.txt"
    path.write_bytes(
        b"\n"  # blank before the first vector
        b"caf\xe9 9 9 9\n"  # Latin-1, not UTF-8: replaced, the rest still read
        b"a\xc2\xa0b 1 2 3 \n"  # "a<NBSP>b", and a trailing space
        b"clock 4 5 6 \n"
        b"\n"
        b"table 7 8 9\n"
        b"wall 1\n"  # cut short
    )
    words = ["<pad>", "a\xa0b", "clock", "table", "wall", "a"]
    matrix = load_glove(path, words)
    assert matrix.dtype == np.float32 and matrix.shape == (6, 3)
    assert matrix[1].tolist() == [1, 2, 3]
    assert matrix[2].tolist() == [4, 5, 6]
    assert matrix[3].tolist() == [7, 8, 9]
    assert np.isnan(matrix[[0, 4, 5]]).all()
    # one-dimensional vectors are vectors too
    (tmp_path / "one.txt").write_text("clock 0.5\ntable -1.5\n")
    assert load_glove(tmp_path / "one.txt", ["clock", "table"]).tolist() == [[0.5], [-1.5]]
    # a file without vectors: one line naming it
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError) as err:
        load_glove(empty, words)
    assert str(err.value) == f"{empty}: no GloVe vectors in this file"


def test_prepare_reads_the_glove_file_for_the_training_vocabulary(tmp_path):
    path = tmp_path / "glove.txt"
    path.write_text("table 4 5 6\nclock 1 2 3\n")

    class Data:  # what prepare reads of the training data
        word_index = {"<pad>": 0, "clock": 1, "table": 2, "wall": 3}

    info = DataInfo(grid_dim=4, vocab_size=4)
    logged = []
    model = make_model(info, d_basic=3, glove=str(path))
    before = model.basic.weight.detach().clone()
    model.prepare(Data(), log=logged.append)
    after = model.basic.weight.detach()
    assert after[1].tolist() == [1, 2, 3] and after[2].tolist() == [4, 5, 6]
    assert torch.equal(after[3], before[3])
    assert logged == [f"univse: 2 basic word embeddings initialised from {path}"]
    plain = make_model(info, d_basic=3)  # no glove: nothing read, nothing said
    before = plain.basic.weight.detach().clone()
    plain.prepare(Data(), log=logged.append)
    assert torch.equal(plain.basic.weight, before) and len(logged) == 1


# ---- overfit ----------------------------------------------------------------------------


def test_overfit_32_pairs(one_thread):
    data = TinyPairs()
    torch.manual_seed(0)
    model = UniVSE(UniVSEConfig(embed_size=64, d_basic=32, d_modif=32), data.info)
    batch = {**data.pair_batch(np.arange(len(data))), "epoch": 3}
    first = model.loss(batch)
    assert all(torch.isfinite(v) for v in first.values())
    assert all(first[k].item() > 0 for k in ("sent", "comp", "obj", "attr", "rel"))
    assert model.encode_image(data.image_batch(np.arange(4))).shape == (4, 64)
    assert model.encode_text(data.text_batch(np.arange(5))).shape == (5, 64)
    r1 = overfit(model, data, steps=100, lr=1e-3)
    assert r1 >= 90
    last = model.loss(batch)
    assert last["loss"].item() < 0.5 * first["loss"].item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_loss_and_negatives():
    data = TinyPairs(n_images=8)
    torch.manual_seed(0)
    model = UniVSE(UniVSEConfig(**SMALL), data.info).cuda()
    batch = {
        k: v.cuda() if torch.is_tensor(v) else v for k, v in data.pair_batch(np.arange(8)).items()
    }
    batch["epoch"] = 3
    neg = model.sample_negatives(batch, torch.Generator(device="cuda").manual_seed(0))
    assert all(v.device.type == "cuda" for v in neg.values())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.loss(batch, neg)
        plain = model.loss(batch)  # global RNG
    out["loss"].backward()
    assert torch.isfinite(out["loss"].float()) and torch.isfinite(plain["loss"].float())
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_glove_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    """glove.840B is UTF-8; under an ASCII locale (C, with Python's coercion to UTF-8 off)
    a reader that used the locale's encoding would miss the words with non-ASCII letters."""
    path = tmp_path / "vectors.txt"
    path.write_bytes("café 1 2\nnaïve 3 4\n".encode())
    code = (  # ASCII only: the command line itself is read in the locale's encoding
        "import locale, sys; from models.univse import load_glove; "
        "words = ['caf\\u00e9', 'na\\u00efve']; "
        "print(locale.getencoding(), load_glove(sys.argv[1], words).tolist())"
    )
    env = {
        **os.environ,
        "LC_ALL": "C",
        "PYTHONCOERCECLOCALE": "0",
        "PYTHONUTF8": "0",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], env=env, capture_output=True, check=True
    ).stdout.decode()
    assert out.split(" ", 1) == ["ANSI_X3.4-1968", "[[1.0, 2.0], [3.0, 4.0]]\n"]
    # the same in this process (which also lets mutation testing see that this test reads
    # GloVe files: it maps tests to the functions they call in-process)
    assert load_glove(path, ["café", "naïve"]).tolist() == [[1.0, 2.0], [3.0, 4.0]]
