"""Word lists and lemma fixes the scene-graph rules consult (relational, frame, quantity and
collective nouns, colours, lexical compounds, placing verbs ...)."""

from __future__ import annotations

import re
from collections.abc import Collection

NOUNS = ("NOUN", "PROPN")


VERBS = ("VERB", "AUX")


RELATIONAL_NOUNS = {
    "front", "top", "left", "right", "side", "middle", "back", "bottom", "edge", "center",
    "centre", "inside", "outside", "rear",
    # "at the end of", "in the corner of", "on both sides of" (FACTUAL: "in end of", ...)
    "end", "corner", "sides", "ends", "corners",
}  # fmt: skip


FRAME_NOUNS = {"image", "picture", "photo", "photograph", "view", "shot", "scene", "closeup"}


# "a couple of people": the people are the objects; the quantity is not one
QUANTITY_NOUNS = {"couple", "lot", "lots", "number", "pair", "variety", "assortment", "plenty"}


# "a herd of elephants walking": the herd is an object, the elephants walk
COLLECTIVE_NOUNS = {
    "group", "herd", "flock", "crowd", "bunch", "pack", "line", "row", "pile", "stack",
    "cluster", "fleet", "swarm", "troop", "family", "team", "collection",
}  # fmt: skip


# adjectives that count or compare rather than describe
QUANTIFIERS = {
    "several", "many", "few", "some", "other", "various", "different", "same", "own",
    "such", "much", "more", "most", "multiple", "numerous", "certain", "each", "every",
}  # fmt: skip


# words that shade the colour after them: "dark green" is one attribute, as FACTUAL writes it
SHADES = {"dark", "light", "bright", "pale", "deep", "navy", "lime", "neon", "royal"}


# colour words the tagger often reads as noun compounds ("an orange rhombus"): attributes
COLOURS = {
    "red", "orange", "yellow", "green", "blue", "purple", "violet", "pink", "brown",
    "black", "white", "gray", "grey", "silver", "golden", "tan", "beige", "maroon",
    "crimson", "navy", "teal", "turquoise",
}  # fmt: skip


# adjective-noun names that are one object, not an attribute and an object
LEXICAL_COMPOUNDS = {
    ("hot", "dog"), ("polar", "bear"), ("teddy", "bear"), ("remote", "control"),
    ("high", "chair"), ("double", "decker"), ("living", "room"), ("dining", "room"),
    ("dining", "table"), ("cutting", "board"), ("swimming", "pool"), ("waiting", "room"),
    ("french", "fry"), ("hard", "hat"), ("wet", "suit"),
}  # fmt: skip


# words that start a phrasal preposition: "next to", "close to", "away from", "out of"
PHRASE_WORDS = {"next", "close", "adjacent", "near", "ahead", "away", "out", "off", "up", "down"}


# verbs whose prepositional phrase places the direct object: "put a pizza into the oven"
PLACING_VERBS = {
    "put", "place", "set", "lay", "hang", "pour", "throw", "toss", "drop", "swing", "kick",
    "hit", "stick", "stack", "load", "spread", "sprinkle", "insert",
}  # fmt: skip


SUBJECT_PREPOSITIONS = {"with", "without", "of", "for", "by", "like", "during"}  # never placing


# predicates in the form the project writes: "besides" misspells "beside"; "dressed in" is
# "wear", as "in a shirt" is (:mod:`features.scenegraph.learned`). Synonyms stay apart
# ("beneath" is not "under": the demo's captions and the project's gold sets keep the word).
CANONICAL_WORDS = {"besides": "beside"}  # a word of a predicate's lemma -> its form
CANONICAL_PREDICATES = {"dress in": "wear", "dress up in": "wear"}  # whole lemmas


def canonical_predicate(lemma: str) -> str:
    """``lemma`` of a predicate in its canonical form ("sit besides" -> "sit beside")."""
    lemma = CANONICAL_PREDICATES.get(lemma, lemma)
    if any(w in CANONICAL_WORDS for w in lemma.split()):
        lemma = " ".join(CANONICAL_WORDS.get(w, w) for w in lemma.split())
    return lemma


# nouns ending in -ing that are things, not participles the tagger took for nouns
ING_NOUNS = {
    "building", "ceiling", "railing", "painting", "drawing", "clothing", "wedding", "icing",
    "frosting", "topping", "filling", "stuffing", "dressing", "pudding", "dumpling",
    "awning", "siding", "bedding", "seating", "lighting", "landing", "opening", "crossing",
    "parking", "housing", "flooring", "shelving", "carving", "morning", "evening", "string",
    "ring", "earring", "wing", "king", "thing", "swing", "spring", "sling", "offering",
    "serving", "setting", "clearing", "recording",
}  # fmt: skip


OBJECT_DEPS = frozenset(("dobj", "obj", "attr", "oprd", "dative"))


PARTICIPLES = frozenset(("VBG", "VBN", "VBD"))

# dependents that make a participle relate its subject to something (or say more of it)
INTRANSITIVE_DEPS = frozenset(
    ("dobj", "obj", "prep", "agent", "dative", "xcomp", "ccomp", "attr", "acomp", "oprd",
     "prt", "advcl", "relcl", "npadvmod")
)  # fmt: skip

# verbs that take an object: without one the parse lost it, no state of the subject
TRANSITIVE_VERBS = {
    "wear", "hold", "carry", "ride", "use", "eat", "cover", "surround", "touch", "watch",
    "follow", "chase", "support", "contain", "drive", "pull", "push", "throw", "catch",
}  # fmt: skip

NAME_DEPS = frozenset(("compound", "amod", "nmod"))  # a noun with these may be part of a name


SPECIAL_NOUNS = RELATIONAL_NOUNS | QUANTITY_NOUNS | FRAME_NOUNS | {"close"}


PREPOSITION_DEPS = frozenset(("prep", "agent", "prt", "advmod"))


RELATIVE_PRONOUNS = {"who", "whom", "which", "that"}


def _cvc(stem: str) -> bool:
    """Ends consonant-vowel-consonant ("rid", "hop", "star"): such a stem doubles its last
    letter before -ing/-ed ("ridding"), so an undoubled form comes from stem + e."""
    vowels = "aeiou"
    return (
        len(stem) >= 3
        and stem[-1] not in vowels + "wxy"
        and stem[-2] in vowels
        and stem[-3] not in vowels
    )


def verb_lemma(text: str, lemma: str, verbs: Collection[str] | None) -> str:
    """``lemma`` of the verb form ``text``, unless it contradicts the spelling: "riding" ->
    "rid" becomes "ride" (see :func:`_cvc`) when ``verbs`` (the lemmatizer's verb index)
    knows "ride". Without an index the lemma is trusted."""
    text = text.lower()
    if verbs is None:
        return lemma
    for suffix in ("ing", "ed"):
        if text.endswith(suffix):
            stem = text[: -len(suffix)]
            if lemma == stem and _cvc(stem) and stem + "e" in verbs:
                return stem + "e"
    return lemma


def attribute_lemma(t) -> str:
    """The lemma of an attribute word (a token): participles and numbers keep their form
    ("parked", "two"), adjectives their lemma."""
    participle = t.pos == "VERB" or t.tag in PARTICIPLES
    return t.text if participle or t.pos == "NUM" else t.lemma


def participle_lemma(text: str, verbs: Collection[str] | None) -> str | None:
    """The verb of an -ing form the tagger called a noun ("grazing" -> "graze"), if known."""
    if not text.endswith("ing") or len(text) < 6:
        return None
    stem = text[:-3]
    candidates = []
    if len(stem) >= 2 and stem[-1] == stem[-2] and stem[-1] not in "aeiouls":
        candidates.append(stem[:-1])  # swimming -> swim
    if _cvc(stem):
        candidates.append(stem + "e")  # grazing -> graze
    candidates += [stem, stem + "e"]
    if verbs is None:
        return candidates[0]
    return next((c for c in candidates if c in verbs), None)


def normalise_case(text: str) -> str:
    """All-capital or Title Case captions ("A MAN RIDING A WAVE", "A Woman On A Bench") in
    lower case: the tagger reads capitals as proper nouns. Other captions are unchanged."""
    if text[1:].islower():
        return text  # the usual case: nothing but the first letter is a capital
    words = re.findall(r"[A-Za-z]+", text)
    if len(words) < 3:
        return text
    long = [w for w in words if len(w) > 1]
    capitalised = sum(w[0].isupper() for w in words[1:])
    if (long and all(w.isupper() for w in long)) or capitalised >= 0.75 * (len(words) - 1):
        return text.lower()
    return text
