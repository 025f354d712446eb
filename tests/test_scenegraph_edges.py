"""The learned edge model after the rules (features/scenegraph/edges.py, train_edges.py): its
numpy forward pass against torch's, the rewrite policy with hand-set weights on a hand-made
parse, the label alignment of the trainer, and the shipped weights on the real pipeline."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from pydantic import ValidationError

from features.scenegraph.builder import SceneGraph, _Tok
from features.scenegraph.edges import WEIGHTS, EdgeModel, Scorer, Vocabulary
from features.scenegraph.factual import Lemmas, data_folder, parse_graph
from features.scenegraph.learned import caption_text
from features.scenegraph.parser import Parser
from features.scenegraph.stage import ScenegraphConfig, load_pipeline
from features.scenegraph.train_edges import Net, examples

WIDTH = 4  # token vector width of the hand-made model


def man_on_bench():
    """'man sitting on red bench' parsed by hand, with the rules' graph of it."""
    spec = [
        ("man", "man", "NOUN", "NN", "ROOT", 0),
        ("sitting", "sit", "VERB", "VBG", "acl", 0),
        ("on", "on", "ADP", "IN", "prep", 1),
        ("red", "red", "ADJ", "JJ", "amod", 4),
        ("bench", "bench", "NOUN", "NN", "pobj", 2),
    ]
    toks = [_Tok(i, *t) for i, t in enumerate(spec)]
    graph = SceneGraph(
        [
            {"span": "man", "head": "man", "lemma": "man"},
            {"span": "bench", "head": "bench", "lemma": "bench"},
        ],
        [{"object": 1, "attribute": "red", "lemma": "red"}],
        [{"subject": 0, "relation": "sitting on", "lemma": "sit on", "object": 1}],
    )
    return toks, {0: 0, 4: 1}, {0: [0], 4: [4]}, graph


def constant_model(
    relation_class: int, attribute_margin: float, confidence=(0, 0, 0), margins=(0, 0)
) -> EdgeModel:
    """A model whose scorers ignore their input: every pair gets ``relation_class`` of
    ("", "?", "on", "wear") with probability ~1, every attribute candidate the logit
    margin (yes - no) ``attribute_margin``."""
    predicates = ["", "?", "on", "wear"]
    arrays = {
        "vocab": np.array(["", "L:?"]),
        "predicates": np.array(predicates),
        "confidence": np.array(confidence, dtype=float),
        "threshold": np.array(margins, dtype=float),
        "pipeline": np.array(["en_core_web_sm", "3.8.0"]),
        "width": np.array(WIDTH),
    }
    biases = {"rel_": 20 * np.eye(4)[relation_class], "att_": np.array([0, attribute_margin])}
    for prefix, b2 in biases.items():
        fields = 11
        arrays[prefix + "emb"] = np.zeros((2, 3), np.float32)
        arrays[prefix + "w1"] = np.zeros((3 * WIDTH + (fields + 1) * 3, 5), np.float32)
        arrays[prefix + "b1"] = np.zeros(5, np.float32)
        arrays[prefix + "w2"] = np.zeros((5, len(b2)), np.float32)
        arrays[prefix + "b2"] = b2.astype(np.float32)
    return EdgeModel(arrays)


def rewrite(model: EdgeModel) -> SceneGraph:
    toks, index, names, graph = man_on_bench()
    model.apply(np.ones((5, WIDTH), np.float32), toks, index, names, graph)
    return graph


def test_numpy_forward_matches_torch():
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    net = Net(vocab_size=20, fields=4, width=3 * WIDTH, classes=5, dim=6, hidden=7)
    dense = torch.randn(8, 3 * WIDTH)
    ids = torch.randint(1, 20, (8, 4))
    bag = torch.randint(0, 20, (8, 3))
    bag[0] = 0  # an empty bag: the mean of nothing is zeros
    with torch.no_grad():
        want = net(dense, ids, bag).numpy()
    weights = {f"x_{k}": v for k, v in net.export().items()}
    got = Scorer(weights, "x_")(dense.numpy(), ids.numpy(), bag.numpy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_relation_policy():
    # "on" says what the rules' "sit on" says in the neutral reading: the rules' stays
    relations = rewrite(constant_model(2, 5)).relations
    assert {(r["subject"], r["lemma"], r["object"]) for r in relations} == {
        (0, "sit on", 1),
        (1, "on", 0),  # the model relates the reversed pair too (a constant model)
    }
    # another predicate replaces the rules' one
    relations = rewrite(constant_model(3, 5)).relations
    assert {(r["subject"], r["lemma"], r["object"]) for r in relations} == {
        (0, "wear", 1),
        (1, "wear", 0),
    }
    assert rewrite(constant_model(0, 5)).relations == []  # none
    kept = rewrite(constant_model(1, 5)).relations  # "other": the rules' stand
    assert [(r["subject"], r["lemma"], r["object"]) for r in kept] == [(0, "sit on", 1)]


def test_attribute_policy():
    every = rewrite(constant_model(1, 5)).attributes
    assert {(a["object"], a["attribute"], a["lemma"]) for a in every} == {
        (0, "sitting", "sitting"),  # participles keep their form, as the rules write them
        (0, "red", "red"),
        (1, "sitting", "sitting"),
        (1, "red", "red"),
    }
    assert rewrite(constant_model(1, -5)).attributes == []
    # between the margins: the rules' attribute stays, no new one comes
    kept = rewrite(constant_model(1, 1.0, margins=(-2, 2))).attributes
    assert [(a["object"], a["attribute"]) for a in kept] == [(1, "red")]
    assert rewrite(constant_model(1, 3.0, margins=(-2, 2))).attributes == every


def test_gates_leave_the_rules_decision_below_the_confidence():
    rules = man_on_bench()[3].relations
    for c in (0, 3):  # none, and a predicate that changes the rules' one
        unsure = rewrite(constant_model(c, 5, confidence=(1.01, 1.01, 1.01))).relations
        assert unsure == rules
    # adding is allowed, changing is not: the rules' pair keeps "sit on", the new pair "wear"
    relations = rewrite(constant_model(3, 5, confidence=(0.5, 1.01, 1.01))).relations
    assert {(r["subject"], r["lemma"], r["object"]) for r in relations} == {
        (0, "sit on", 1),
        (1, "wear", 0),
    }


def test_portion_relations_stay():
    """(group, of, people) is how the rules say FACTUAL's attribute "group of"."""
    toks = [
        _Tok(0, "group", "group", "NOUN", "NN", "ROOT", 0),
        _Tok(1, "of", "of", "ADP", "IN", "prep", 0),
        _Tok(2, "people", "people", "NOUN", "NNS", "pobj", 1),
    ]
    graph = SceneGraph(
        [{"span": w, "head": w, "lemma": w} for w in ("group", "people")],
        [],
        [{"subject": 0, "relation": "of", "lemma": "of", "object": 1}],
    )
    constant_model(0, -5).apply(np.ones((3, WIDTH)), toks, {0: 0, 2: 1}, {}, graph)
    assert [(r["subject"], r["lemma"], r["object"]) for r in graph.relations] == [(0, "of", 1)]


def test_training_labels_align_gold_with_tokens():
    record = (np.zeros((5, WIDTH)), *man_on_bench()[:3], man_on_bench()[3].to_json())
    gold = parse_graph("( man , sit on , bench ) , ( bench , is , red )")
    relations, attributes = examples(record, gold, Lemmas(None))
    assert {pair: label for pair, _, _, label in relations} == {(0, 4): "sit on", (4, 0): ""}
    assert {pair: label for pair, _, _, label in attributes} == {
        (1, 0): 0,
        (3, 0): 0,
        (1, 4): 0,
        (3, 4): 1,
    }
    # two objects with one head lemma: which is which is unknown, no labels
    twice = parse_graph("( man , sit on , man )")
    toks, index, names, graph = man_on_bench()
    toks[4].text = "man"
    assert examples((np.zeros((5, WIDTH)), toks, index, names, graph.to_json()), twice,
                    Lemmas(None)) is None  # fmt: skip


def test_vocabulary_unknown_strings_fall_back_to_their_field():
    vocab = Vocabulary(["", "L:?", "P:?", "L:man", "P:NOUN"])
    assert vocab.ids(["L:man", "L:woman", "P:VERB", "Q:x"]) == [3, 1, 2, 0]
    assert vocab.bag(["L:man", "L:woman"], width=3) == [3, 0, 0]


@pytest.fixture(scope="module")
def english():
    return load_pipeline("en_core_web_sm")


def test_shipped_model_is_used_with_its_pipeline_only(english):
    nlp, _ = english
    model = EdgeModel.load()
    assert model is not None, f"{WEIGHTS} missing: python -m features.scenegraph.train_edges"
    assert model.fits(nlp) and Parser.for_pipeline(nlp).edges is not None
    other = type("Fake", (), {"meta": {"lang": "en", "name": "core_web_md", "version": "3.8.0"}})
    assert not model.fits(other())
    name, count, digest = (str(x) for x in np.load(WEIGHTS)["training"])
    train = data_folder() / name
    if train.is_file():  # the weights say which training file made them
        assert hashlib.sha256(train.read_bytes()).hexdigest() == digest


# the shipped model on captions of its kind: relations the rules alone do not find
LEARNED = [
    ("a woman with a black jacket and white shirt", ("woman", "wear", "shirt")),
    ("a girl about to hit a ball", ("girl", "hit", "ball")),
]


@pytest.mark.parametrize("caption, relation", LEARNED, ids=[c for c, _ in LEARNED])
def test_shipped_model_finds_what_the_rules_miss(english, caption, relation):
    nlp, _ = english
    parser = Parser.for_pipeline(nlp)
    doc = nlp(caption_text(caption))
    assert relation not in parser.rules(doc)[0].lemma_tuples()[2]
    assert relation in parser(doc).lemma_tuples()[2]


def test_modes_of_the_edge_model(english):
    nlp, _ = english
    assert Parser.for_pipeline(nlp, "off").edges is None
    shipped = Parser.for_pipeline(nlp, "project").edges
    factual = Parser.for_pipeline(nlp, "factual").edges
    assert factual.confidence == (0.0, 0.0, 0.0) and factual.threshold == (0.0, 0.0)
    assert shipped.confidence == tuple(np.load(WEIGHTS)["confidence"])  # not overwritten
    with pytest.raises(ValueError, match="project, factual or off"):
        Parser.for_pipeline(nlp, "fast")
    with pytest.raises(ValidationError):
        ScenegraphConfig(edges="fast")
