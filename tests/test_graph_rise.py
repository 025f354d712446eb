"""Graph-RISE-style embedding (features.images.graph_rise): labels, graph, loss, trainer."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from features.images.graph_rise import graph as G
from features.images.graph_rise import model as M
from features.images.graph_rise.labels import (
    ImageLabels,
    image_labels,
    label_vocabulary,
    multi_hot,
)
from features.images.graph_rise.stage import GraphRiseConfig
from infra.resume import Preempted


def row(objects, attributes=(), relations=()):
    """A row of graphs.parquet, as the scenegraph stage writes it."""
    return {
        "key": "x#0",
        "caption": "",
        "objects": [{"span": o, "head": o, "lemma": o} for o in objects],
        "attributes": [{"object": i, "attribute": a, "lemma": a} for i, a in attributes],
        "relations": [
            {"subject": s, "relation": r, "lemma": r, "object": o} for s, r, o in relations
        ],
    }


def test_labels_of_a_hand_made_image():
    # "a red circle above a blue square" and "there is a small circle"
    graphs = [
        row(["circle", "square"], [(0, "red"), (1, "blue")], [(0, "above", 1)]),
        row(["circle"], [(0, "small")]),
    ]
    assert image_labels(graphs) == {
        ("object", "circle"),
        ("object", "square"),
        ("attribute", "red circle"),
        ("attribute", "blue square"),
        ("attribute", "small circle"),
        ("relation", "circle above square"),
    }
    images = ImageLabels.of_sets(
        [
            {("object", "circle"), ("attribute", "red circle")},
            {("object", "circle"), ("object", "square")},
            {("object", "circle"), ("attribute", "red circle"), ("relation", "a b c")},
        ]
    )
    vocab = label_vocabulary(images, min_images=2)  # the floor drops square and the triple
    assert vocab == [
        {"kind": "object", "label": "circle", "images": 3},
        {"kind": "attribute", "label": "red circle", "images": 2},
    ]
    np.testing.assert_array_equal(multi_hot(images, vocab), [[1, 1], [1, 0], [1, 1]])


def test_image_labels_of_the_graphs_table_a_block_at_a_time(monkeypatch):
    import pyarrow as pa

    from features.images.graph_rise import labels

    shapes = ["circle", "square", "star"]
    graphs = [
        row([shapes[i % 3], shapes[(i + 1) % 3]], [(i % 2, "red")], [(0, "above", 1)] * (i % 2))
        for i in range(7)
    ]
    counts = [2, 0, 1, 3, 1]  # an image without captions has no labels
    table = pa.Table.from_pylist([{"key": f"c{i}", **g} for i, g in enumerate(graphs)])
    monkeypatch.setattr(labels, "BLOCK", 2)  # blocks of images end inside the table
    images = ImageLabels.of_graphs(table, counts)
    starts = np.cumsum([0, *counts])
    expected = [image_labels(graphs[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert [{images.labels[i] for i in ids} for ids in images.ids] == expected
    assert len(images[[0, 3]]) == 2 and images[[3]].ids[0] is images.ids[3]


def test_idf_weights_and_weighted_targets_by_hand():
    from features.images.graph_rise.labels import WeightedLabels, idf_weights

    labels = np.array([[1, 1, 0], [1, 0, 0], [1, 0, 0]], np.uint8)  # label 2 on no image
    w = idf_weights(labels)
    np.testing.assert_allclose(w, [np.log(4 / 4) + 1, np.log(4 / 2) + 1, np.log(4 / 1) + 1])
    targets = WeightedLabels(labels, w)
    assert targets.shape == (3, 3) and len(targets) == 3
    batch = targets[np.array([2, 0])]  # (2, 3), a batch in any order
    assert batch.dtype == np.float32
    np.testing.assert_allclose(batch, [[w[0], 0, 0], [w[0], w[1], 0]])
    # the loss: cross entropy against the weighted labels as a distribution
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    logp = logits[0] - torch.logsumexp(logits[0], 0)
    want = -(w[0] * logp[0] + w[1] * logp[1]) / (w[0] + w[1])
    got = M.label_loss(logits, torch.from_numpy(targets[np.array([0])]))
    assert float(got) == pytest.approx(float(want))


def test_knn_graph_matches_brute_force():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    x[7] = x[3]  # a tie: the lower index comes first
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    src, dst, w = G.knn_graph(x, 5)
    expected = []
    for i in range(len(x)):
        sims = [(-float(np.dot(x[i], x[j])), j) for j in range(len(x)) if j != i]
        for s, j in sorted(sims)[:5]:
            expected.append((i, j, max(-s, 0.0)))
    assert [(int(a), int(b)) for a, b in zip(src, dst, strict=True)] == [
        (i, j) for i, j, _ in expected
    ]
    np.testing.assert_allclose(w, [e[2] for e in expected], atol=1e-6)
    # image vectors: the normalised mean of each image's caption vectors
    caps = rng.standard_normal((6, 4)).astype(np.float32)
    v = G.image_vectors(caps, [2, 0, 4])
    mean = caps[2:].mean(0)
    np.testing.assert_allclose(v[2], mean / np.linalg.norm(mean), rtol=1e-5)
    np.testing.assert_array_equal(v[1], 0)


@pytest.mark.parametrize("block", [1, 7, 1024])
def test_top_k_with_many_ties_equals_a_stable_sort(monkeypatch, block):
    # a small integer grid: most similarities tie, at the k-th place too (integers, so that
    # every product is exact in float32 whatever the matrix shape BLAS is given)
    x = np.random.default_rng(1).integers(-1, 2, (60, 3)).astype(np.float32)
    monkeypatch.setattr(G, "BLOCK", block)
    for same, k in [(True, 6), (False, 6), (True, 59), (False, 60)]:
        idx, sim = G.top_k(x, x, k, same)
        s = x @ x.T
        if same:
            np.fill_diagonal(s, -np.inf)
        order = np.argsort(-s, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(idx, order)
        np.testing.assert_array_equal(sim, np.take_along_axis(s, order, 1))


def test_label_comparisons_in_blocks_equal_one_block(monkeypatch):
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((50, 4)).astype(np.float32)
    labels = (rng.random((50, 9)) < 0.3).astype(np.uint8)
    src, dst, w = G.knn_graph(vectors / np.linalg.norm(vectors, axis=1, keepdims=True), 4)

    def both():
        return G.label_precision(vectors, labels, 4), G.graph_statistics(src, dst, w, labels, 50)

    whole = both()
    monkeypatch.setattr(G, "VALUES", 20)  # a query or two edges a block
    assert both() == whole


def test_label_precision_by_hand():
    vectors = np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]], np.float32)
    labels = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 1], [0, 1, 1]], np.float32)
    # k=1: 0 -> 1: |{0}|/1 = 1; 1 -> 0: 1/2; 2 -> 3: 1/2; 3 -> 2: 1/1
    assert G.label_precision(vectors, labels, k=1) == pytest.approx((1 + 0.5 + 0.5 + 1) / 4)


def test_regulariser_matches_a_loop():
    torch.manual_seed(0)
    h = torch.randn(6, 4)
    src, dst = torch.tensor([0, 0, 2, 5, 3]), torch.tensor([1, 4, 3, 0, 2])
    w = torch.rand(5)
    total = 0.0
    for e in range(5):
        i, j = int(src[e]), int(dst[e])
        total += float(w[e]) * sum((float(h[i, d]) - float(h[j, d])) ** 2 for d in range(4))
    assert float(M.graph_regulariser(h, src, dst, w)) == pytest.approx(total, rel=1e-5)


def test_head_pools_the_valid_items_by_mean_and_max():
    torch.manual_seed(0)
    head = M.Head(3, 4, 2, 5)
    x = torch.randn(2, 3, 3)  # (B, R, D)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    x_poisoned = x.clone()
    x_poisoned[~mask] = 1e6  # masked items must not count
    got = head(x_poisoned, mask)
    for b in range(2):  # naive: per image, the valid items only
        v = torch.stack([head.item(x[b, r]) for r in range(3) if mask[b, r]])  # (R', hidden)
        want = F.normalize(head.mlp(torch.cat([v.mean(0), v.max(0).values])), dim=-1)
        torch.testing.assert_close(got[b], want)


def test_region_sets_scale_boxes_by_the_image_size_a_batch_at_a_time():
    from features.images.graph_rise.stage import region_sets

    fields = {  # the regions store's fields: image 0 has one region, image 1 none
        "features": np.stack([np.ones((2, 3)), 2 * np.ones((2, 3))]).astype(np.float16),
        "boxes": np.array([[[10, 20, 50, 60], [0, 0, 0, 0]]] * 2, np.float32),
        "n_regions": np.array([1, 0]),
        "image_hw": np.array([[100, 200], [10, 10]]),  # height 100, width 200
        "valid": np.array([1, 1], np.uint8),
    }

    class FakeStore:  # Store.read / gather / fields over those arrays
        def __len__(self):
            return 2

        def read(self, lo, hi, names):
            return {n: fields[n][lo:hi] for n in names}

        def gather(self, name, rows):
            return fields[name][np.asarray(rows)]

        @property
        def fields(self):
            return {n: type("Spec", (), {"shape": a.shape[1:]}) for n, a in fields.items()}

    sets, valid = region_sets(FakeStore())
    assert sets.dim == 3 + 5 and valid.tolist() == [True, False]  # no region: not valid
    items, mask = sets.load(np.array([1, 0]))  # any order
    np.testing.assert_allclose(items[1, 0], [1, 1, 1, 0.05, 0.2, 0.25, 0.6, 0.2 * 0.4])
    assert mask.tolist() == [[False, False], [True, False]]
    assert not items[0].any() and not items[1, 1].any()  # masked regions are zeros


def test_item_statistics_merge_blocks_like_one_pass():
    rng = np.random.default_rng(3)
    feats = rng.normal(5.0, 2.0, (9, 4, 6)).astype(np.float32)  # (N, R, D)
    mask = rng.random((9, 4)) < 0.6
    mask[2] = False  # an image without regions
    rows = np.array([8, 0, 2, 5, 3, 1, 7])
    mean, std = M.item_statistics(M.ItemSets.of_arrays(feats, mask), rows, block=2)
    valid = np.concatenate([feats[r][mask[r]] for r in rows]).astype(np.float64)
    np.testing.assert_allclose(mean, valid.mean(0), rtol=1e-12)
    np.testing.assert_allclose(std, valid.std(0, ddof=1), rtol=1e-10)


def test_label_loss_is_cross_entropy_against_the_label_distribution():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    targets = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # the second has no label
    logp = logits[0] - torch.logsumexp(logits[0], 0)
    assert float(M.label_loss(logits, targets)) == pytest.approx(float(-(logp[0] + logp[1]) / 2))


def test_batches_pack_neighbours_and_their_edges():
    src = np.array([0, 0, 1, 2, 3])
    dst = np.array([1, 2, 3, 0, 0])
    g = M.Graph(src, dst, np.array([0.5, 0.6, 0.7, 0.8, 0.9]), 5)
    rows, s, d, w = M.pack_batch(np.array([0]), g, 2, np.random.default_rng(0))
    assert sorted(rows.tolist()) == [0, 1, 2]  # seed 0 and both its neighbours
    edges = {(int(rows[a]), int(rows[b])): float(x) for a, b, x in zip(s, d, w, strict=True)}
    # every graph edge with both ends in the batch, none other
    assert edges == pytest.approx({(0, 1): 0.5, (0, 2): 0.6, (2, 0): 0.8})


def tiny(seed=0):
    rng = np.random.default_rng(seed)
    labels = (rng.random((48, 5)) < 0.4).astype(np.float32)
    x = labels @ rng.standard_normal((5, 12)) + 0.3 * rng.standard_normal((48, 12))
    src, dst, w = G.knn_graph(G.image_vectors(labels + 0.01, [1] * 48), 3)
    cfg = GraphRiseConfig(epochs=3, batch_size=16, hidden=16, dim=8)
    # each image a set of two items: its vector and noise, the second masked out for half
    items = np.stack([x, rng.standard_normal(x.shape)], 1).astype(np.float32)  # (48, 2, 12)
    mask = np.ones((48, 2), bool)
    mask[::2, 1] = False
    return M.ItemSets.of_arrays(items, mask), labels, M.Graph(src, dst, w, 48), cfg


ROWS = np.arange(48)


def test_training_is_deterministic_and_resumes_bit_identically(tmp_path, monkeypatch):
    x, y, g, cfg = tiny()
    whole, hist = M.train_head(
        x, ROWS, y, g, cfg, 1.0, {"run": 1}, tmp_path / "a", log=lambda s: None
    )
    again, _ = M.train_head(x, ROWS, y, g, cfg, 1.0, {"run": 1}, None, log=lambda s: None)
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)
    assert hist[-1]["graph"] > 0

    real_batches = M.epoch_batches

    def sigterm_in_epoch_1(n, batch_size, seed, epoch):  # a queue preempts epoch 1
        if epoch == 1:
            signal.raise_signal(signal.SIGTERM)
        return real_batches(n, batch_size, seed, epoch)

    monkeypatch.setattr(M, "epoch_batches", sigterm_in_epoch_1)
    with pytest.raises(Preempted):  # epoch 1 finishes and is saved, then the run stops
        M.train_head(x, ROWS, y, g, cfg, 1.0, {"run": 1}, tmp_path / "b", log=lambda s: None)
    monkeypatch.setattr(M, "epoch_batches", real_batches)
    assert torch.load(tmp_path / "b" / "last.pt", weights_only=True)["epoch"] == 1
    resumed, hist_b = M.train_head(
        x, ROWS, y, g, cfg, 1.0, {"run": 1}, tmp_path / "b", resume=True, log=lambda s: None
    )
    assert [h["epoch"] for h in hist_b] == [0, 1, 2]
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=0)
    emb = M.embed(resumed, x, ROWS)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1, rtol=1e-5)


def test_resume_from_another_run_is_one_line(tmp_path):
    x, y, g, cfg = tiny()
    M.train_head(x, ROWS, y, g, cfg, 1.0, {"run": 1}, tmp_path, log=lambda s: None)
    with pytest.raises(M.GraphRiseTrainingError) as err:
        M.train_head(x, ROWS, y, g, cfg, 0.5, {"run": 1}, tmp_path, resume=True, log=lambda s: None)
    message = str(err.value)
    assert "\n" not in message and "last.pt" in message and "alpha" in message


def test_regulariser_pulls_neighbours_together():
    x, y, g, cfg = tiny()
    cfg = cfg.model_copy(update={"epochs": 10})
    off, _ = M.train_head(x, ROWS, y, g, cfg, 0.0, {}, None, log=lambda s: None)
    on, _ = M.train_head(x, ROWS, y, g, cfg, 5.0, {}, None, log=lambda s: None)

    def edge_distance(model):
        h = M.embed(model, x, ROWS)
        src = np.repeat(np.arange(48), 3)  # knn_graph's sources, in order
        return float(np.mean([np.sum((h[i] - h[j]) ** 2) for i, j in zip(src, g.dst, strict=True)]))

    assert edge_distance(on) < edge_distance(off)


def test_a_label_floor_nothing_reaches_is_one_line(tmp_path):
    from features.images.graph_rise.stage import GraphRiseError, train_graph_rise
    from features.ingest.manifest import Dataset, Record, read_manifest, write_manifest
    from features.scenegraph.files import write_scene_graphs
    from features.store.spec import StoreConfig

    records = [
        Record(f"{s}{i}", f"{s}{i}.png", s, ["a red circle", "a circle"])
        for s in ("train", "test")
        for i in range(3)
    ]
    write_manifest(records, Dataset("coco", records), 2, tmp_path / "m.parquet")
    rows = [
        {**row(["circle"], [(0, "red")]), "key": f"{r.key}#{c}", "caption": r.captions[c]}
        for r in records
        for c in range(2)
    ]
    write_scene_graphs(tmp_path / "sg", rows, {"nouns": {}, "adjectives": {}, "relations": {}})
    cfg = GraphRiseConfig(min_images=4)  # 3 train images carry each label
    with pytest.raises(GraphRiseError) as err:
        train_graph_rise(
            read_manifest(tmp_path / "m.parquet"),
            tmp_path / "global.zarr",
            tmp_path / "regions.zarr",
            tmp_path / "text.zarr",
            tmp_path / "sg",
            cfg,
            tmp_path / "out.zarr",
            tmp_path / "model",
            tmp_path / "labels.json",
            tmp_path / "graph.parquet",
            StoreConfig(),
        )
    message = str(err.value)
    assert "\n" not in message and "graph_rise.min_images 4" in message and "lower it" in message


def test_dropout_acts_in_training_only():
    torch.manual_seed(0)
    head = M.Head(3, 4, 2, 5, dropout=0.5)
    plain = M.Head(3, 4, 2, 5)  # the same weights, no dropout: the reference
    plain.load_state_dict(head.state_dict())
    x, mask = torch.randn(6, 3, 3), torch.ones(6, 3, dtype=torch.bool)
    torch.testing.assert_close(head.eval()(x, mask), plain.eval()(x, mask))
    assert not torch.allclose(head.train()(x, mask), plain(x, mask))
