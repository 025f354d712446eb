"""Choices learned from FACTUAL's training graphs (Li et al. 2023; 37k Visual Genome region
captions) where a rule cannot see them: predicates (:func:`relabel`), prepositional
attachment (:func:`attach`) and an article before a caption whose first word is an object
(:func:`caption_text`). Their tables: the generated module
:mod:`features.scenegraph.learned_predicates` (``python -m features.scenegraph.train_learned``).
"""

from __future__ import annotations

from features.scenegraph.builder import SceneGraph
from features.scenegraph.learned_predicates import ATTACHMENT, NOUN_STARTS, PREDICATES
from features.scenegraph.lexicon import canonical_predicate, normalise_case


def caption_text(text: str, starts: frozenset[str] = NOUN_STARTS) -> str:
    """The text spaCy parses for a caption: :func:`normalise_case`, then "the " before a
    caption that starts with a word FACTUAL's annotators read as an object
    (:data:`NOUN_STARTS`): without the article a region caption's first word is often read
    as an adverb or a verb ("bear lies on ground": "bear" the root verb)."""
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
    every relation whose (predicate lemma, object head lemma) the table holds; the surface
    form stays the caption's words (in place; returned for chaining)."""
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
        nouns, verbs = map(sum, zip(*(table.get(key, (0, 0)) for key in level), strict=True))
        if nouns != verbs:
            return nouns > verbs
        if nouns:
            return None  # a tie: the parse's choice stands
    return None
