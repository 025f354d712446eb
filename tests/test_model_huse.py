"""HUSE (models/huse.py): each loss term against a loop written here, the graph-loss mask
s_ij, the config and data checks, and an overfit run on 32 tiny pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_data import TinyPairs, overfit
from pydantic import ValidationError

from models.data.info import DataInfo
from models.huse import HUSE, HUSEConfig, cosine_distance, gap_loss, graph_loss, tower

SMALL = dict(hidden=64, image_layers=2, text_layers=2, dropout=0.0)


def _info(n_classes: int = 4, seed: int = 0, **kw) -> DataInfo:
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.1, 1.0, size=(n_classes, n_classes))
    a = (a + a.T) / 2
    np.fill_diagonal(a, 0.0)
    base = dict(image_dim=12, document_dim=10, tfidf_dim=7, n_classes=n_classes)
    base.update(kw)
    return DataInfo(class_distances=a.tolist(), **base)


def _batch(info: DataInfo, b: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "image": torch.randn(b, info.image_dim, generator=g),
        "document": torch.randn(b, info.document_dim, generator=g),
        "tfidf": torch.rand(b, info.tfidf_dim, generator=g),
        "labels": torch.randint(0, info.n_classes, (b,), generator=g),
        # differs from labels on purpose: the text side must use its own labels
        "text_labels": torch.randint(0, info.n_classes, (b,), generator=g),
    }


def _cos_dist(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v, strict=True))
    nu = math.sqrt(sum(a * a for a in u))
    nv = math.sqrt(sum(b * b for b in v))
    return 1.0 - dot / (nu * nv)


def test_config_defaults_are_the_papers_and_strict():
    cfg = HUSEConfig()
    assert (cfg.image_layers, cfg.text_layers, cfg.hidden, cfg.dropout) == (5, 2, 512, 0.15)
    assert cfg.shared_classifier and cfg.use_tfidf  # BERT ++ TF-IDF (sec. 4.1.1)
    with pytest.raises(ValidationError):
        HUSEConfig(hiden=64)
    with pytest.raises(ValidationError):
        HUSEConfig(dropout=1.0)


def test_shapes_inputs_and_buffer():
    info = _info()
    model = HUSE(HUSEConfig(**SMALL, use_tfidf=False), info).eval()
    batch = _batch(info)
    img, txt = model.encode_image(batch), model.encode_text(batch)
    assert img.shape == (6, 64) and txt.shape == (6, 64)
    assert torch.allclose(img.norm(dim=-1), torch.ones(6), atol=1e-5)
    assert torch.allclose(txt.norm(dim=-1), torch.ones(6), atol=1e-5)
    assert model.similarity(img[:4], txt).shape == (4, 6)
    assert model.classify(img).shape == (6, 4)
    assert model.inputs == frozenset({"image", "document", "labels"})
    # A travels with checkpoints
    state = model.state_dict()
    assert torch.allclose(state["class_distances"], torch.tensor(info.class_distances))
    fresh = HUSE(HUSEConfig(**SMALL, use_tfidf=False), _info(seed=5))
    fresh.load_state_dict(state)
    assert torch.allclose(fresh.class_distances, torch.tensor(info.class_distances))
    # 5 image layers -> 5 Linear modules, 2 text layers -> 2
    paper = HUSE(HUSEConfig(hidden=16), info)
    assert sum(isinstance(m, torch.nn.Linear) for m in paper.image_tower) == 5
    assert sum(isinstance(m, torch.nn.Linear) for m in paper.text_tower) == 2


def test_tfidf_input_is_used_only_when_enabled():
    info = _info()
    batch = _batch(info)
    other = dict(batch, tfidf=torch.rand(6, info.tfidf_dim))
    on = HUSE(HUSEConfig(**SMALL, use_tfidf=True), info).eval()
    assert "tfidf" in on.inputs and HUSE.inputs_for(on.cfg) == on.inputs
    assert on.text_tower[0].in_features == info.document_dim + info.tfidf_dim
    assert not torch.allclose(on.encode_text(batch), on.encode_text(other))
    off = HUSE(HUSEConfig(**SMALL, use_tfidf=False), info).eval()
    assert "tfidf" not in off.inputs
    assert torch.equal(off.encode_text(batch), off.encode_text(other))
    with pytest.raises(ValueError, match="tfidf"):
        HUSE(HUSEConfig(use_tfidf=True), _info(tfidf_dim=0))


BAD_INFO = [
    (
        dict(n_classes=3, class_distances=None),
        "HUSE's graph loss (eqs. 9-11) needs the semantic graph A from class-name "
        "embeddings: DataInfo.class_distances is None (open the data with a "
        "class_embedder, e.g. Sentence-BERT on the manifest's class names)",
    ),
    (
        dict(n_classes=2, class_distances=[[0.0] * 3] * 3),
        "HUSE needs class labels and an n_classes x n_classes class_distances; got "
        "n_classes=2, class_distances of shape (3, 3)",
    ),
    (
        dict(n_classes=0, class_distances=[]),
        "HUSE needs class labels and an n_classes x n_classes class_distances; got "
        "n_classes=0, class_distances of shape (0,)",
    ),
    (dict(tfidf_dim=0), "use_tfidf is on but DataInfo.tfidf_dim is 0 (no TF-IDF terms)"),
    (dict(image_dim=0), "HUSE needs image_dim and document_dim > 0; got 0, 10"),
    (dict(document_dim=0), "HUSE needs image_dim and document_dim > 0; got 12, 0"),
]


@pytest.mark.parametrize("change, message", BAD_INFO)
def test_unusable_data_fails_in_one_line(change, message):
    good = dict(image_dim=12, document_dim=10, tfidf_dim=7, n_classes=1, class_distances=[[0.0]])
    HUSE(HUSEConfig(**SMALL), DataInfo(**good))  # one class, and the sizes, are enough
    HUSE(
        HUSEConfig(**SMALL), DataInfo(**{**good, "image_dim": 1, "document_dim": 1, "tfidf_dim": 1})
    )
    with pytest.raises(ValueError) as err:
        HUSE(HUSEConfig(**SMALL), DataInfo(**{**good, **change}))
    assert str(err.value) == message


def _linear(layer: torch.nn.Linear, x: list[float]) -> list[float]:
    """``W x + b`` with loops."""
    rows = zip(layer.weight.tolist(), layer.bias.tolist(), strict=True)
    return [sum(wi * xi for wi, xi in zip(w, x, strict=True)) + b for w, b in rows]


@pytest.mark.parametrize("shared", [True, False])
def test_loss_terms_match_loops(shared):
    """L_class (eq. 8; image logits from the image layer, text logits from the text
    layer when they are not shared), L_graph (eqs. 9-11) on the 2B image+text items,
    L_gap (eq. 12), and the weighted sum (eq. 5), against plain loops."""
    torch.manual_seed(0)
    info = _info(n_classes=4)
    cfg = HUSEConfig(
        **SMALL,
        class_weight=0.7,
        graph_weight=1.3,
        gap_weight=0.4,
        margin=0.6,
        shared_classifier=shared,
    )
    model = HUSE(cfg, info).eval()
    batch = _batch(info, b=6)
    out = model.loss(batch)

    with torch.no_grad():
        img = model.encode_image(batch).tolist()
        txt = model.encode_text(batch).tolist()
        text_layer = model.classifier if shared else model.text_classifier
        logits = [_linear(model.classifier, u) for u in img]
        logits += [_linear(text_layer, u) for u in txt]
    labels = batch["labels"].tolist() + batch["text_labels"].tolist()
    a = info.class_distances
    emb = img + txt
    n = len(emb)

    ce = 0.0
    for row, y in zip(logits, labels, strict=True):
        ce += -(row[y] - math.log(sum(math.exp(v) for v in row)))
    ce /= n

    graph, counted, masked = 0.0, 0, 0
    for i in range(n):
        for j in range(n):
            d = _cos_dist(emb[i], emb[j])
            target = a[labels[i]][labels[j]]
            if target < cfg.margin or d < cfg.margin:
                graph += (d - target) ** 2
                counted += 1
            else:
                masked += 1
    graph /= n * n
    assert counted > n and masked > 0  # both branches of s_ij occur in this batch

    gap = sum(_cos_dist(u, v) for u, v in zip(img, txt, strict=True)) / len(img)

    assert out["class"].item() == pytest.approx(ce, rel=1e-5)
    assert out["graph"].item() == pytest.approx(graph, rel=1e-4)
    assert out["gap"].item() == pytest.approx(gap, rel=1e-5)
    total = 0.7 * ce + 1.3 * graph + 0.4 * gap
    assert out["loss"].item() == pytest.approx(total, rel=1e-5)


def test_graph_mask_drops_far_pairs_and_keeps_close_ones():
    """s_ij = 0 when both A[y_i, y_j] >= m and d(u_i, u_j) >= m; 1 when either is < m."""
    e1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)  # d = 1
    labels = torch.tensor([0, 1])
    far = torch.tensor([[0.0, 0.8], [0.8, 0.0]])
    # masked out: A = 0.8 >= 0.5 and d = 1 >= 0.5 -> no loss, no gradient
    loss = graph_loss(e1, labels, far, margin=0.5)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(e1.grad) == 0
    # the same pair counts with a larger margin: 2 ordered pairs * (1 - 0.8)^2 / 2^2
    assert graph_loss(e1, labels, far, margin=0.9).item() == pytest.approx(0.02, abs=1e-6)
    # counts because the classes are close: A = 0.3 < 0.5
    close = torch.tensor([[0.0, 0.3], [0.3, 0.0]])
    assert graph_loss(e1, labels, close, margin=0.5).item() == pytest.approx(
        2 * 0.7**2 / 4, abs=1e-6
    )
    # counts because the embeddings are close: d = 0.2 < 0.5 though A = 0.8
    theta = math.acos(0.8)
    e2 = torch.tensor([[1.0, 0.0], [math.cos(theta), math.sin(theta)]])
    assert graph_loss(e2, labels, far, margin=0.5).item() == pytest.approx(
        2 * (0.2 - 0.8) ** 2 / 4, abs=1e-6
    )
    # same class: A = 0 < m always counts, pulling the pair together
    same = torch.tensor([0, 0])
    assert graph_loss(e1, same, far, margin=0.5).item() == pytest.approx(0.5, abs=1e-6)


def test_graph_mask_is_strict_at_the_margin():
    """Eq. 10: s_ij = 1 iff A[y_i, y_j] < m or d(u_i, u_j) < m, so a pair exactly at the
    margin on both counts adds nothing, and one just inside it on either count adds."""
    e = torch.tensor([[1.0, 0.0], [0.6, 0.8]])  # d = 0.4 up to rounding
    labels = torch.tensor([0, 1])
    d = float(cosine_distance(e, e)[0, 1])  # the float32 value the mask compares
    # d exactly at the margin, A above it: s_ij = 0
    far = torch.tensor([[0.0, 0.9], [0.9, 0.0]])
    assert graph_loss(e, labels, far, margin=d).item() == 0.0
    above = float(np.nextafter(np.float32(d), np.float32(1)))  # d < m in float32
    assert graph_loss(e, labels, far, margin=above).item() == pytest.approx(
        2 * (d - 0.9) ** 2 / 4, rel=1e-5
    )
    # A exactly at the margin (0.5), d above it (1.0): s_ij = 0
    orthogonal = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    at = torch.tensor([[0.0, 0.5], [0.5, 0.0]])
    assert graph_loss(orthogonal, labels, at, margin=0.5).item() == 0.0
    assert graph_loss(orthogonal, labels, at, margin=0.5001).item() == pytest.approx(
        2 * 0.5**2 / 4, rel=1e-5
    )


def test_towers_are_fc_layers_with_relu_and_dropout_between():
    """Sec. 3.2 / 4.1.3: FC layers, ReLU and dropout between them, the last one linear."""
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    for layers in (1, 2, 3):
        net = tower(5, layers, 4, dropout=0.15)
        linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        drops = [m for m in net if isinstance(m, torch.nn.Dropout)]
        assert len(linears) == layers and len(drops) == layers - 1
        assert all(m.p == 0.15 for m in drops)
        assert [linears[0].in_features] + [m.in_features for m in linears[1:]] == [5] + [4] * (
            layers - 1
        )
        net.eval()
        want = x
        for k, lin in enumerate(linears):
            want = want @ lin.weight.t() + lin.bias
            if k < layers - 1:
                want = want.clamp_min(0)
        torch.testing.assert_close(net(x), want)
        assert (net(x) < 0).any()  # the last layer is linear: no ReLU after it
        net.train()  # dropout between the layers only: the first layer's output is kept
        torch.testing.assert_close(net[0](x), x @ linears[0].weight.t() + linears[0].bias)


def test_tfidf_in_float64_as_scikit_learn_gives_it():
    """A dense TF-IDF matrix from scikit-learn is float64: the text tower takes it in the
    document feature's dtype."""
    info = _info()
    model = HUSE(HUSEConfig(**SMALL), info).eval()
    batch = _batch(info)
    wide = dict(batch, tfidf=batch["tfidf"].double())
    torch.testing.assert_close(model.encode_text(wide), model.encode_text(batch))


def test_gap_loss_hand_values():
    img = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    txt = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    assert gap_loss(img, txt).item() == pytest.approx((0.0 + 1.0) / 2)


def test_classification_layer_is_shared_or_not():
    info = _info()
    batch = _batch(info)
    shared = HUSE(HUSEConfig(**SMALL), info).eval()
    txt = shared.encode_text(batch)
    assert torch.equal(shared.classify(txt, "text"), shared.classify(txt, "image"))
    split = HUSE(HUSEConfig(**SMALL, shared_classifier=False), info).eval()
    txt = split.encode_text(batch)
    assert not torch.allclose(split.classify(txt, "text"), split.classify(txt, "image"))
    # each side its own layer (eq. 6 without the sharing)
    torch.testing.assert_close(split.classify(txt, "image"), split.classifier(txt))
    torch.testing.assert_close(split.classify(txt, "text"), split.text_classifier(txt))
    with pytest.raises(ValueError) as err:
        split.classify(txt)
    assert str(err.value) == "shared_classifier is off: classify needs side='image' or 'text'"
    assert torch.isfinite(split.loss(batch)["loss"])


def test_bf16_autocast():
    info = _info()
    model = HUSE(HUSEConfig(**SMALL), info)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.loss(_batch(info))
    assert all(torch.isfinite(v) for v in out.values())
    out["loss"].backward()


def test_overfit_tiny_pairs():
    torch.manual_seed(0)
    data = TinyPairs()
    model = HUSE(HUSEConfig(**SMALL), data.info)
    first = model.loss(data.pair_batch(np.arange(len(data))))
    assert set(first) == {"loss", "class", "graph", "gap"}
    assert torch.isfinite(first["loss"])
    r1 = overfit(model, data, steps=100, lr=1e-3)
    assert r1 >= 90.0
    with torch.no_grad():
        last = model.loss(data.pair_batch(np.arange(len(data))))
    assert last["loss"].item() < first["loss"].item() / 2
