"""Predicate choices learned from FACTUAL's training graphs (Li et al. 2023; 37k Visual Genome
region captions, FACTUAL's ``random_train.csv``), where a rule cannot see the
choice: "a man in a red shirt" is (man, wear, shirt), "a woman with glasses" (woman, wear,
glasses), while "a cat in a box" stays (cat, in, box).

The model is a table (preposition, object head) -> predicate, mined by
:func:`features.scenegraph.train_learned.mine`: the
stage's parser runs over the training captions; each of its relations whose predicate is a
bare preposition is aligned with the gold relation of the same (subject, object) pair; a
(preposition, object) key whose aligned gold predicate is another one -- and another one in
the convention-neutral matching too, so that "on" is never turned into "sit on" -- in at
least ``share`` of at least ``min_count`` aligned cases is kept. The table is written as the
Python module :mod:`features.scenegraph.learned_predicates` (it ships with the package, and
the DAG's code dependencies see it), with the training file's SHA-256. Reproduce:

    python -m features.scenegraph.train_learned [--train FACTUAL/random_train.csv]

:func:`relabel` applies it to a graph: the lemma changes, the surface form stays the
caption's words (adversarial captions replace words of the caption).
"""

from __future__ import annotations

from features.scenegraph.builder import SceneGraph
from features.scenegraph.learned_predicates import ATTACHMENT, NOUN_STARTS, PREDICATES
from features.scenegraph.lexicon import canonical_predicate, normalise_case


def caption_text(text: str, starts: frozenset[str] = NOUN_STARTS) -> str:
    """The text spaCy parses for a caption: :func:`normalise_case`, then "the " before a
    caption that starts with a word FACTUAL's annotators read as an object
    (:data:`NOUN_STARTS`, mined by :func:`features.scenegraph.train_learned.noun_starts`).
    Region captions drop their articles ("surfboard in the sand", "bear lies on ground"),
    and the small model then reads the first word as an adverb or a verb ("bear" as the
    root verb with "lies" as its object); with the article it reads the noun phrase. The
    graph does not change otherwise: its names and spans are words of the caption."""
    text = normalise_case(text)
    word = text.split(maxsplit=1)[0] if text.strip() else ""
    if word.lower() not in starts:
        return text
    if word[:1].isupper() and word[1:].islower():
        text = text.lstrip()
        text = text[:1].lower() + text[1:]  # "Man riding": no proper noun after "the"
    return "the " + text.lstrip()


def relabel(graph: SceneGraph, table: dict[tuple[str, str], str] = PREDICATES) -> SceneGraph:
    """``graph`` with every predicate lemma in its canonical form
    (:func:`features.scenegraph.lexicon.canonical_predicate`), then the learned predicate of
    every relation whose (predicate lemma, object head lemma) the table holds (in place;
    returned for chaining)."""
    kept = {}
    for r in graph.relations:
        head = graph.objects[r["object"]]["lemma"].split()[-1]
        lemma = canonical_predicate(r["lemma"])
        learned = table.get((lemma, head), lemma)
        if learned != r["lemma"]:
            r = {**r, "lemma": learned}
        # "in a shirt" and "wearing a shirt" are one relation
        kept.setdefault((r["subject"], r["lemma"], r["object"]), r)
    graph.relations = list(kept.values())
    return graph


def backoff(noun: bool, v: str, n1: str, p: str, n2: str) -> list[list[tuple]]:
    """The keys of Collins and Brooks (1995, sec. 3) from the most to the least specific
    level, each with the parse's own choice (noun or verb) in front: the model learns where
    the parse errs, not attachment from scratch."""
    c = "n" if noun else "v"
    return [
        [(c, v, n1, p, n2)],
        [(c, v, n1, p, ""), (c, v, "", p, n2), (c, "", n1, p, n2)],
        [(c, v, "", p, ""), (c, "", n1, p, ""), (c, "", "", p, n2)],
        [(c, "", "", p, "")],
    ]


def attach(
    v: str, n1: str, p: str, n2: str, noun: bool, table: dict[tuple, tuple] = ATTACHMENT
) -> bool | None:
    """Whether the phrase ``p n2`` attaches to the noun ``n1`` (True) or to the verb ``v``
    (False), given the parse's choice ``noun``: Collins and Brooks' backed-off estimate,
    the first level with counts deciding by majority; None where that level is a tie or no
    level has counts (the parse's choice stands)."""
    for level in backoff(noun, v, n1, p, n2):
        nouns = verbs = 0
        for key in level:
            n, vb = table.get(key, (0, 0))
            nouns, verbs = nouns + n, verbs + vb
        if nouns != verbs:
            return nouns > verbs
        if nouns:
            return None  # a tie: the parse's choice stands
    return None
