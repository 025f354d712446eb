"""A small spaCy pipeline trained on the demo's gold trees, so the demo runs the real
scene-graph path offline (no English model can be installed here).

The demo captions come from a grammar, so each has a gold dependency tree, POS tags and
lemmas (:mod:`features.demo`). We train a morphologizer (POS), a dependency parser and a
trainable lemmatizer on train-split captions, and score them on test-split captions: POS
accuracy, UAS/LAS, lemma accuracy, and the scene graphs that :mod:`features.scenegraph`
builds from the predicted parses against the gold graphs.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from pydantic import Field

from features.config import Section


class ParserConfig(Section):
    """``parser`` section of params.yaml (the demo's spaCy pipeline)."""

    epochs: int = Field(2, ge=1)
    max_train_captions: int = Field(2000, ge=1)
    batch_size: int = Field(32, ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    seed: int = 0


def gold_doc(vocab, tree: dict):
    from spacy.tokens import Doc

    return Doc(
        vocab,
        words=tree["words"],
        spaces=tree["spaces"],
        heads=tree["heads"],
        deps=tree["deps"],
        pos=tree["pos"],
        tags=tree["tags"],
        lemmas=tree["lemmas"],
    )


def gold_graph(graph: dict) -> tuple[set, set, set]:
    names = graph["objects"]
    return (
        set(names),
        {(names[o], a) for o, a in graph["attributes"]},
        {(names[s], p, names[o]) for s, p, o in graph["relations"]},
    )


def sentences(dataset: dict, split: str) -> list[dict]:
    return [s for img in dataset["images"] if img["split"] == split for s in img["sentences"]]


def train(dataset: dict, cfg: ParserConfig, log: Callable[[str], None] = print):
    """A blank English pipeline trained on the gold trees of the train split."""
    import spacy
    from spacy.tokens import Doc
    from spacy.training import Example
    from spacy.util import fix_random_seed, minibatch

    fix_random_seed(cfg.seed)
    nlp = spacy.blank("en")
    nlp.add_pipe("morphologizer")
    nlp.add_pipe("parser")
    nlp.add_pipe("trainable_lemmatizer", config={"backoff": "orth", "min_tree_freq": 1})
    rng = random.Random(cfg.seed)
    chosen = sentences(dataset, "train")
    rng.shuffle(chosen)
    examples = [
        Example(
            Doc(nlp.vocab, words=s["tree"]["words"], spaces=s["tree"]["spaces"]),
            gold_doc(nlp.vocab, s["tree"]),
        )
        for s in chosen[: cfg.max_train_captions]
    ]
    optimizer = nlp.initialize(lambda: examples)
    for epoch in range(cfg.epochs):
        rng.shuffle(examples)
        losses: dict = {}
        for batch in minibatch(examples, size=cfg.batch_size):
            nlp.update(batch, drop=cfg.dropout, sgd=optimizer, losses=losses)
        log(
            f"parser: epoch {epoch + 1}/{cfg.epochs}, losses "
            + ", ".join(f"{k} {float(v):.2f}" for k, v in losses.items())
        )
    return nlp


def evaluate(nlp, dataset: dict, split: str = "test") -> dict:
    """Parse and scene-graph accuracy on held-out captions."""
    from spacy.tokens import Doc
    from spacy.training import Example

    from features.scenegraph import Parser, graph_scores

    held_out = sentences(dataset, split)
    examples = [
        Example(
            Doc(nlp.vocab, words=s["tree"]["words"], spaces=s["tree"]["spaces"]),
            gold_doc(nlp.vocab, s["tree"]),
        )
        for s in held_out
    ]
    scores = nlp.evaluate(examples)
    parser = Parser()
    predicted = [parser(doc) for doc in nlp.pipe(s["raw"] for s in held_out)]
    graphs = graph_scores(predicted, [gold_graph(s["scene_graph"]) for s in held_out])
    return {
        "captions": len(held_out),
        "pos_acc": round(scores["pos_acc"], 4),
        "dep_uas": round(scores["dep_uas"], 4),
        "dep_las": round(scores["dep_las"], 4),
        "lemma_acc": round(scores["lemma_acc"], 4),
        "scene_graph": graphs,
    }
