"""Scene graphs judged on FACTUAL (Li et al. 2023, "FACTUAL: A Benchmark for Faithful and
Consistent Textual Scene Graph Parsing"): reading its CSV files (FACTUAL's own release:
``random_train.csv``, ``random_dev.csv``, ...) and matching parsed graphs against its gold
graphs (:func:`score`), in two modes.

Strict: lemmas on both sides through one function (:class:`Lemmas`), objects by their head
word ("fire hydrant" and "hydrant" match), predicates word by word ("sitting on" -> "sit
on"); "all" tuples are SPICE's union of objects, attributes and relations (Anderson et al.
2016, sec. 3). Convention-neutral: both sides further mapped to one convention where
FACTUAL's annotation rules and ours differ by design rather than by error (:func:`tuples`;
the list: docs/explanation/language.md, "Judging the parser on FACTUAL").
"""

from __future__ import annotations

import csv
import functools
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from features.scenegraph.lexicon import COLLECTIVE_NOUNS
from infra.config import UserError

TUPLE = re.compile(r"\(([^()]*)\)")

NUMBERS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve".split()
    )
}

ARTICLES = {"a", "an", "the"}

# person nouns as FACTUAL's annotators write them ("guy": "person" in 171 of 173 captions)
INFORMAL = {"guy": "person", "guys": "people", "dude": "person", "dudes": "people"}

# attributes as they write them ("wooden" for a caption's "wood" in 103 of 103 captions)
SPELLINGS = {"wood": "wooden", "blond": "blonde"}

# closed-class words that start the prepositional part of a predicate ("sit on top of")
PREPOSITIONS = {
    "on", "in", "at", "of", "to", "with", "by", "from", "under", "over", "above", "below",
    "behind", "beside", "besides", "near", "next", "into", "onto", "inside", "outside",
    "across", "along", "around", "against", "between", "through", "toward", "towards",
    "beneath", "underneath", "among", "atop", "up", "down", "off", "out", "for", "like",
    "without", "within", "upon", "past", "before", "after", "beyond", "alongside", "via",
    "about", "away", "front", "close", "throughout", "amid",
}  # fmt: skip

# nouns FACTUAL writes as an attribute of what follows "of" ("a group of people")
PORTION_NOUNS = COLLECTIVE_NOUNS | {"piece", "slice", "part", "half"}

KINDS = ("objects", "attributes", "relations", "pairs", "all")


def data_folder() -> Path:
    """``shared/data/factual`` in the nearest folder above this checkout that has one (the
    main checkout and worktrees sit at different depths)."""
    for root in Path(__file__).resolve().parents:
        if (root / "shared" / "data" / "factual").is_dir():
            return root / "shared" / "data" / "factual"
    return Path("shared/data/factual")


class FactualFormatError(UserError):
    """A FACTUAL file that cannot be read."""


class Raw(NamedTuple):
    """A graph as strings: objects (full names), attributes (object, attribute), relations
    (subject, predicate, object), before any lemmatisation."""

    objects: frozenset
    attributes: frozenset
    relations: frozenset


def parse_graph(text: str) -> Raw:
    """FACTUAL's ``( s , p , o ) , ( o , is , a ) , ( o )`` as a :class:`Raw` graph."""
    objects, attributes, relations = set(), set(), set()
    rest = TUPLE.sub("", text).replace(",", "").strip()
    if rest:
        raise ValueError(f"not a FACTUAL scene graph: {text.strip()[:60]!r}")
    for body in TUPLE.findall(text):
        parts = [p.strip().lower() for p in body.split(" , ")]
        if len(parts) == 1 and parts[0]:
            objects.add(parts[0])
        elif len(parts) == 3 and all(parts):
            s, p, o = parts
            if p == "is":
                objects.add(s)
                attributes.add((s, o))
            else:
                objects.update((s, o))
                relations.add((s, p, o))
        else:
            raise ValueError(f"not a FACTUAL tuple: ({body})")
    return Raw(frozenset(objects), frozenset(attributes), frozenset(relations))


def read_factual(path: str | Path) -> list[tuple[str, Raw]]:
    """(caption, gold graph) of every row of a FACTUAL CSV (columns ``caption`` and
    ``scene_graph``)."""
    path = Path(path)
    if not path.is_file():
        raise FactualFormatError(f"{path}: no such file (a FACTUAL CSV with caption, scene_graph)")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"caption", "scene_graph"} - set(reader.fieldnames or ())
        if missing:
            raise FactualFormatError(
                f"{path}: missing column(s) {', '.join(sorted(missing))}; a FACTUAL CSV has "
                "image_id, region_id, caption, scene_graph"
            )
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                rows.append((row["caption"] or "", parse_graph(row["scene_graph"] or "")))
            except ValueError as err:
                raise FactualFormatError(f"{path}, line {line}: {err}") from None
    return rows


def predicted_raw(graph: dict, name: str = "span") -> Raw:
    """A scene graph as the stage writes it (``SceneGraph.to_json()``) as a :class:`Raw`
    graph: objects by their field ``name`` ("span": as written, so that the matching
    lemmatises them as it does FACTUAL's; "lemma": the parser's lemmas), attributes and
    predicates as the parser's lemmas."""
    names = [o[name].lower() for o in graph["objects"]]
    return Raw(
        frozenset(names),
        frozenset((names[a["object"]], a["lemma"].lower()) for a in graph["attributes"]),
        frozenset(
            (names[r["subject"]], r["lemma"].lower(), names[r["object"]])
            for r in graph["relations"]
        ),
    )


class Lemmas:
    """Lemmas of single words by part of speech, from a spaCy pipeline's rule lemmatizer
    (the same function for gold and predicted words): the first candidate its index knows
    ("vases" -> "vase", not "vas"), else the word itself when the index knows it (a lemma
    stays itself: "glass", not "glas"), else the first candidate; without a lemmatizer,
    words are kept."""

    def __init__(self, nlp=None):
        self.nlp = nlp
        self.lemmatizer = None
        self.index: dict = {}
        if nlp is not None and "lemmatizer" in nlp.pipe_names:
            self.lemmatizer = nlp.get_pipe("lemmatizer")
            table = self.lemmatizer.lookups.get_table("lemma_index", {})
            self.index = {pos: frozenset(table.get(pos.lower(), ())) for pos in ("NOUN", "VERB")}
        self.nouns = self.index.get("NOUN", frozenset())  # empty without a lemmatizer
        self._cached = functools.cache(self._lemma)

    def __call__(self, word: str, pos: str) -> str:
        return self._cached(word, pos)

    def _lemma(self, word: str, pos: str) -> str:
        if self.lemmatizer is None or not word.isalpha():
            return word
        from spacy.tokens import Doc

        doc = Doc(self.nlp.vocab, words=[word])
        doc[0].pos_ = pos
        candidates = self.lemmatizer.rule_lemmatize(doc[0]) or [word]
        known = self.index.get(pos, ())
        found = next((c for c in candidates if c in known), None)
        return found or (word if word in known else candidates[0])


def neutral_predicate(words: list[str]) -> list[str]:
    """The predicate in the shared convention: articles dropped, a verb before a preposition
    dropped ("sit on" = "on"), "with" alone is "have"."""
    words = [w for w in words if w not in ARTICLES] or words
    first = next((i for i, w in enumerate(words) if w in PREPOSITIONS), None)
    if first:
        words = words[first:]
    return ["have" if w == "with" and len(words) == 1 else w for w in words]


def tuples(raw: Raw, lemma: Lemmas, neutral: bool = False) -> dict[str, set]:
    """The matching tuples of a graph: ``objects`` (head lemmas), ``attributes`` (head,
    attribute), ``relations`` (subject head, predicate, object head), ``pairs`` (subject
    head, object head) and ``all`` (objects, attributes and relations together)."""

    def name_words(name: str) -> list[str]:
        if not neutral:
            return name.split()
        words = name.replace("-", " ").split()
        if len(words) > 1 and words[-2] + words[-1] in lemma.nouns:
            words[-2:] = [words[-2] + words[-1]]  # "cell phone" = "cellphone"
        return words

    def head(name: str) -> str:
        words = name_words(name)
        if not words:
            return name
        return lemma(INFORMAL.get(words[-1], words[-1]) if neutral else words[-1], "NOUN")

    def attribute(text: str) -> str:
        words = [lemma(SPELLINGS.get(w, w) if neutral else w, "ADJ") for w in text.split()]
        if neutral:
            words = [NUMBERS.get(w, w) for w in words]
            if len(words) == 2 and words[1] == "of":  # FACTUAL's "group of"
                words = words[:1]
        return " ".join(words)

    objects = {head(o) for o in raw.objects}
    attributes = {(head(o), attribute(a)) for o, a in raw.attributes}
    relations = set()
    for s, p, o in raw.relations:
        words = [w if w in PREPOSITIONS else lemma(w, "VERB") for w in p.split()]
        if neutral:
            if words == ["of"]:
                if head(s) in PORTION_NOUNS:
                    attributes.add((head(o), head(s)))
                    continue
                s, words, o = o, ["have"], s  # "the tail of a dog": (dog, have, tail)
            words = neutral_predicate(words)
        relations.add((head(s), " ".join(words), head(o)))
    if neutral:
        for o in raw.objects:
            words = name_words(o)
            # through the attributes' own lemmatisation: gold's (chair, leather) and the
            # name "leather chair" give one tuple (as an adjective "leather" is "leath")
            attributes.update((head(o), attribute(w)) for w in words[:-1])
        portions = {a for _, a in attributes if a in PORTION_NOUNS}
        objects -= portions
        relations = {r for r in relations if r[0] not in portions and r[2] not in portions}
    out = {
        "objects": objects,
        "attributes": attributes,
        "relations": relations,
        "pairs": {(s, o) for s, _, o in relations},
    }
    out["all"] = (
        {("o", x) for x in objects}
        | {("a", *x) for x in attributes}
        | {("r", *x) for x in relations}
    )
    return out


def prf(counts: Counter) -> dict[str, float]:
    tp, fp, fn = counts["tp"], counts["fp"], counts["fn"]
    precision, recall = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-12)
    return {"precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4)}


def score(
    predicted: Iterable[Raw], gold: Iterable[Raw], lemma: Lemmas, neutral: bool = False
) -> tuple[dict, dict]:
    """Micro P/R/F1 per kind (:data:`KINDS`) over the captions, and the error counts:
    ``{kind: Counter}`` of missed ("fn") and spurious ("fp") tuples by their class
    (:func:`error_class`)."""
    counts = {k: Counter() for k in KINDS}
    errors = {k: Counter() for k in ("fn", "fp")}
    for p, g in zip(predicted, gold, strict=True):
        got, want = tuples(p, lemma, neutral), tuples(g, lemma, neutral)
        for k in KINDS:
            counts[k].update(
                tp=len(got[k] & want[k]), fp=len(got[k] - want[k]), fn=len(want[k] - got[k])
            )
        for side, extra, other in (("fn", want, got), ("fp", got, want)):
            for k in ("objects", "attributes", "relations"):
                for t in extra[k] - other[k]:
                    errors[side][error_class(k, t, other)] += 1
    return {k: prf(c) for k, c in counts.items()}, errors


def error_class(kind: str, t, other: dict) -> str:
    """A missed or spurious tuple's class: for a relation, whether the other side relates the
    same pair with another predicate ("predicate X vs Y"), else its predicate; for an
    attribute, the attribute; for an object, "object"."""
    if kind == "objects":
        return "object"
    if kind == "attributes":
        return f"attribute {t[1]!r}"
    s, p, o = t
    others = sorted(q for s2, q, o2 in other["relations"] if (s2, o2) == (s, o))
    if others:
        return f"predicate {p!r} vs {others[0]!r}"
    return f"relation {p!r}"
