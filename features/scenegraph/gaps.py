"""Relative clauses whose gap is the noun before them ("the sofa the man is sitting on",
"the pink shirt the woman is wearing"): the repair of their parse and the relations they
state. Region captions of this shape are common in Visual Genome; spaCy's small English
model reads the two noun phrases as two subjects of one verb, or the stranded preposition
as a particle."""

from __future__ import annotations

from features.scenegraph.lexicon import NOUNS, TRANSITIVE_VERBS, VERBS

PARTICLES = {"up", "out", "down", "off", "away", "back", "around", "over"}  # ending phrasal verbs


def repair_gapped_clause(toks) -> None:
    """A caption "NOUN-PHRASE NOUN-PHRASE [aux] VERB [PREPOSITION]" that ends in a stranded
    preposition or a transitive verb without an object: the second noun phrase's verb
    becomes a relative clause on the first noun (its head), the preposition a stranded
    ``prep`` of the verb; what the two noun phrases' own words hang on stays."""
    words = [t for t in toks if t.pos != "PUNCT"]
    if len(words) < 4 or any(t.pos == "PUNCT" for t in toks[: len(words)]):
        return
    last = words[-1]
    if last.text in PARTICLES:
        return  # "a towel hanging up", "giraffe tongue sticking out"
    if last.pos == "ADP" or (last.pos == "ADV" and last.text in ("on", "in")):  # "is on"
        verb = words[-2]
        if verb.pos not in VERBS or any(t.head == last.i for t in toks):
            return
    elif last.pos == "VERB" and last.lemma in TRANSITIVE_VERBS:
        verb = last
        if any(t.head == verb.i and t.dep in ("dobj", "obj") for t in toks):
            return
    else:
        return
    i = verb.i - 1
    while i > 0 and toks[i].pos == "AUX":
        i -= 1
    subject = toks[i]
    start = i  # the subject's phrase: determiner, adjectives, numbers before it
    while start > 0 and toks[start - 1].pos in ("DET", "ADJ", "NUM"):
        start -= 1
    noun = toks[start - 1] if start > 0 else None
    if subject.pos not in NOUNS or noun is None or noun.pos not in NOUNS:
        return
    if any(t.pos in VERBS for t in toks[:start]):
        return
    noun.dep, noun.head = "ROOT", noun.i
    for t in toks[:start]:
        if t is not noun and t.head >= start:
            t.head = noun.i
    for t in toks[start:i]:
        t.head = subject.i
    subject.dep, subject.head = "nsubj", verb.i
    verb.dep, verb.head = "relcl", noun.i
    for t in toks[i + 1 : verb.i]:
        t.dep, t.head = "aux", verb.i
    if last is not verb:
        last.pos, last.dep, last.head = "ADP", "prep", verb.i
    for t in toks[len(words) :]:
        t.head = noun.i


class Gaps:
    """The relations of such clauses, for :class:`features.scenegraph.builder._Builder`."""

    def _stranded(self, prep) -> None:
        """A preposition left at the end of a relative clause: "the desk the computer is
        on" -> (computer, on, desk); "the area the person is sitting on" -> (person, sit on,
        area)."""
        verb = self.toks[prep.head]
        if verb.pos not in VERBS or verb.dep != "relcl" or verb.i > prep.i:
            return
        words = [verb, prep] if verb.lemma != "be" and verb.i + 1 == prep.i else [prep]
        self._gap_relations(verb, words)

    def _gapped_object(self, verb) -> None:
        """A transitive verb ending a relative clause without a relative pronoun or an
        object: "the pink shirt the woman is wearing" -> (woman, wear, shirt)."""
        if verb.dep != "relcl" or verb.lemma not in TRANSITIVE_VERBS or verb.kids.get("dobj"):
            return
        if verb.i + 1 < len(self.toks) and self.toks[verb.i + 1].pos != "PUNCT":
            return
        if verb.head <= verb.i:
            self._gap_relations(verb, [verb])

    def _gap_relations(self, verb, words) -> None:
        """(subject of ``verb``, ``words``, the noun its clause describes)."""
        subjects = [e for s in self._children(verb, "nsubj") for e in self._entities(s)]
        self._add_targets(subjects, [(words, t) for t in self._entities(self.toks[verb.head])])
