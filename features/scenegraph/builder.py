"""The rules that turn a (repaired) dependency parse into a scene graph: objects, attribute
-object pairs and relation triples, in the conventions of docs/explanation/language.md."""

from __future__ import annotations

from dataclasses import dataclass, field

from features.scenegraph.factual import Raw, predicted_raw
from features.scenegraph.gaps import Gaps
from features.scenegraph.lexicon import (
    COLLECTIVE_NOUNS,
    COLOURS,
    FRAME_NOUNS,
    INTRANSITIVE_DEPS,
    LEXICAL_COMPOUNDS,
    NAME_DEPS,
    NOUNS,
    OBJECT_DEPS,
    PARTICIPLES,
    PHRASE_WORDS,
    PLACING_VERBS,
    PREPOSITION_DEPS,
    QUANTIFIERS,
    QUANTITY_NOUNS,
    RELATIONAL_NOUNS,
    RELATIVE_PRONOUNS,
    SHADES,
    SPECIAL_NOUNS,
    SUBJECT_PREPOSITIONS,
    TRANSITIVE_VERBS,
    VERBS,
    attribute_lemma,
)
from features.scenegraph.placing import Placing


@dataclass
class SceneGraph:
    objects: list[dict] = field(default_factory=list)  # {"span", "head", "lemma"}
    attributes: list[dict] = field(default_factory=list)  # {"object", "attribute", "lemma"}
    relations: list[dict] = field(default_factory=list)  # subject, relation, lemma, object

    def lemma_tuples(self) -> Raw:
        """The graph as SPICE-style tuples of lemmas (objects, attributes, relations)."""
        return predicted_raw(self.to_json(), "lemma")

    def to_json(self) -> dict:
        return {"objects": self.objects, "attributes": self.attributes, "relations": self.relations}


class _Tok:
    """A token of the parse, editable by the repairs (a spaCy Doc is not)."""

    __slots__ = ("i", "text", "lemma", "pos", "tag", "dep", "head", "kids")

    def __init__(self, i, text, lemma, pos, tag, dep, head):
        self.i, self.text, self.lemma, self.pos, self.tag = i, text, lemma, pos, tag
        self.dep, self.head = dep, head
        self.kids: dict[str, list[_Tok]] = {}  # children by dependency label, once repaired

    def __repr__(self) -> str:  # for debugging rules
        return f"{self.text}/{self.pos}/{self.dep}/{self.head}/{self.lemma}"


class _Builder(Gaps, Placing):
    """The rules over one repaired parse."""

    def __init__(self, toks: list[_Tok], attach, record: list | None = None):
        self.toks = toks
        # attach(v, n1, p, n2, noun) -> True (noun) / False (verb) / None (keep the parse's):
        # the learned prepositional attachment (features.scenegraph.learned); record: a list
        # that collects the decision points for training it
        self.attach, self.record = attach, record
        self.graph = SceneGraph()
        self.index: dict[int, int] = {}  # token -> object
        self.name_words: dict[int, list[int]] = {}  # object token -> words of its name
        self.seen: set[tuple] = set()  # relations and attributes already added
        self.subjects: dict[int, list[int]] = {}  # verb token -> its subjects
        self.located: set[tuple[int, int]] = set()  # (X, Y) of "X with Y on it"

    def build(self) -> SceneGraph:
        toks, objects = self.toks, self.graph.objects
        for t in toks:
            if t.pos in NOUNS and self._is_object(t):
                words = self._name(t) if t.kids else [t.i]
                self.index[t.i] = len(objects)
                self.name_words[t.i] = words
                name = [toks[w] for w in words]
                span = " ".join(w.text for w in name)
                lemma = " ".join(w.lemma if w.pos in NOUNS else w.text for w in name)
                objects.append({"span": span, "head": t.text, "lemma": lemma})
        for t in toks:
            if t.i in self.index:
                if t.kids:
                    self._attributes(t)
            elif t.lemma == "be" and "acomp" in t.kids and t.pos in VERBS:
                self._copula_attributes(t)
            elif t.pos == "VERB" and t.tag in PARTICIPLES and INTRANSITIVE_DEPS.isdisjoint(t.kids):
                self._state_attribute(t)
        for t in toks:
            dep = t.dep
            if dep in PREPOSITION_DEPS and "pobj" in t.kids:
                if dep in ("prep", "agent") or t.pos == "ADP":
                    self._prepositional(t)
            elif dep == "prep" and t.pos == "ADP" and not t.kids:
                self._stranded(t)
            if t.pos in VERBS:
                if t.lemma != "be" and not OBJECT_DEPS.isdisjoint(t.kids):
                    self._verb_object(t)
                elif t.dep == "relcl":
                    self._gapped_object(t)
            for owner in t.kids.get("poss", ()):  # "a man's hand": (man, have, hand)
                self._add(owner.i, [], t.i, fixed=("have", "have"))
        if self.located:  # "a building with a clock on it": (clock, on, building) says it
            self.graph.relations = [
                r
                for r in self.graph.relations
                if (r["subject"], r["object"]) not in self.located
                or r["lemma"] not in ("with", "have")
            ]
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

    def _distribute(
        self, noun: _Tok, modifier: _Tok, deps: tuple[str, ...], members: bool = False
    ) -> list[int]:
        """Objects of the nouns a modifier (preposition, participle) of ``noun`` applies to
        (:meth:`_entities`): all the conjuncts when it follows the last one and no other
        conjunct has its own."""
        nouns, group = [noun], self._group(noun)
        if len(group) > 1 and modifier.i > group[-1].i:
            if not any(self._children(g, *deps) for g in group if g is not noun):
                nouns = group
        return [e for n in nouns for e in self._entities(n, members)]

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
        frame = t.lemma in FRAME_NOUNS or t.text == "close"
        return frame and t.dep in ("ROOT", "attr") and self._of(t) is not None

    def _is_quantity(self, t: _Tok) -> bool:
        return t.text in QUANTITY_NOUNS and self._of(t) is not None

    def _is_relational(self, t: _Tok) -> bool:
        """A noun of a phrasal preposition: "front" in "in front of", "left" in "to the left of"."""
        return t.text in RELATIONAL_NOUNS and t.dep == "pobj" and self._of(t) is not None

    def _is_no_object(self, t: _Tok) -> bool:
        """A relational, frame or quantity noun: what its "of" takes stands in its place."""
        return self._is_relational(t) or self._is_frame(t) or self._is_quantity(t)

    def _is_name_modifier(self, t: _Tok) -> bool:
        head = self.toks[t.head]
        if head.i == t.i or head.pos not in NOUNS or t.i > head.i:
            return False
        if t.dep in NAME_DEPS and t.pos in NOUNS:  # also "living room"
            return t.text not in COLOURS
        return self._lexical(t)

    def _lexical(self, t: _Tok) -> bool:
        """An adjective that is part of the name: "hot" in "hot dog"."""
        if t.i + 1 >= len(self.toks) or t.dep not in NAME_DEPS:
            return False
        nxt = self.toks[t.i + 1]
        return (t.text, nxt.lemma) in LEXICAL_COMPOUNDS or (t.text, nxt.text) in LEXICAL_COMPOUNDS

    def _is_object(self, t: _Tok) -> bool:
        """Whether the noun ``t`` heads an object (conventions: docs/explanation/language.md)."""
        dep = t.dep
        if dep in NAME_DEPS and t.head > t.i:
            if self._is_name_modifier(t) or t.text in COLOURS:
                return False  # "fire" of "fire hydrant"; "orange" of "an orange rhombus"
        elif dep == "conj" and self.toks[t.head].pos == "ADJ":
            return False  # "small and crimson"
        elif dep == "npadvmod" and self.toks[t.head].pos in ("ADJ", "VERB"):  # "snow covered"
            return False
        if t.text in SPECIAL_NOUNS or t.lemma in FRAME_NOUNS:
            return not self._is_no_object(t)
        return True

    def _name(self, t: _Tok) -> list[int]:
        """The head noun and its noun modifiers, recursively ("video game controller")."""
        words, todo = [t.i], [t]
        while todo:
            x = todo.pop()
            for c in self._children(x, *NAME_DEPS):
                if c.i < x.i and self._is_name_modifier(c):
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
            return self._distribute(self.toks[head.head], head, ("acl", "relcl"), members)
        if t.pos in NOUNS or t.text == "close":
            if self._is_frame(t) or self._is_quantity(t):
                return self._of_objects(t, members)
        return []

    def _of_objects(self, t: _Tok, members: bool = False) -> list[int]:
        of = self._of(t)
        return [] if of is None else self._objects_of(of, "pobj", members=members)

    def _objects_of(self, t: _Tok, *deps: str, members: bool = False) -> list[int]:
        """Objects the ``deps`` children of ``t`` and their conjuncts stand for (``_entities``)."""
        return [
            e
            for o in self._children(t, *deps)
            for c in self._conjuncts(o)
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
        key = (self.index[obj_token], adjective.text, attribute_lemma(adjective))
        if self._shades(adjective.i - 1):  # "dark green": one attribute
            key = (key[0], *[f"{self.toks[adjective.i - 1].text} {adjective.text}"] * 2)
        elif self._shades(adjective.i):
            return  # the colour after it carries the shade
        if key not in self.seen:
            self.seen.add(key)
            self.graph.attributes.append({"object": key[0], "attribute": key[1], "lemma": key[2]})

    def _shades(self, i: int) -> bool:
        """Whether token ``i`` shades the colour after it: "dark green leaves", "are dark green"."""
        if not 0 <= i < len(self.toks) - 1:
            return False
        shade, colour = self.toks[i], self.toks[i + 1]
        return (
            shade.text in SHADES and colour.text in COLOURS and shade.head in (i + 1, colour.head)
        )

    def _attributes(self, noun: _Tok) -> None:
        for w in self.name_words[noun.i]:
            for m in self._children(self.toks[w], "amod", "nummod", "compound", "nmod"):
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
        for s in self._subjects(be):
            for c in self._children(be, "acomp"):
                for a in self._conjuncts(c):
                    self._add_attribute(s, a)

    def _state_attribute(self, verb: _Tok) -> None:
        """A participle relating its subject to nothing is its state: "zebras walking outside"."""
        if verb.dep not in ("ROOT", "acl", "conj") or verb.lemma in TRANSITIVE_VERBS:
            return  # "coat man is wearing": the object misparsed
        if any(a.text in PHRASE_WORDS or "prep" in a.kids for a in verb.kids.get("advmod", ())):
            return  # "standing next to"
        near = verb.i - 1
        acl = verb.dep == "acl" and self.toks[near].dep == "pobj" and near in self.index
        for s in [near] if acl else self._subjects(verb):  # "pole behind man skateboarding"
            self._add_attribute(s, verb)

    # -- relations

    def _subjects(self, verb: _Tok) -> list[int]:
        """Objects that do ``verb`` (for a passive, undergo it): explicit subjects, or
        "there is X", or the noun a participle / relative clause describes, or the subject
        of the verb this one is conjoined with or subordinate to."""
        if verb.i not in self.subjects:
            self.subjects[verb.i] = self._find_subjects(verb)
        return self.subjects[verb.i]

    def _find_subjects(self, verb: _Tok) -> list[int]:
        for deps in (("nsubj", "csubj"), ("nsubjpass",)):
            if self._children(verb, *deps):
                return self._objects_of(verb, *deps, members=True)
        if self._children(verb, "expl"):
            return self._objects_of(verb, "attr", members=True)
        head = self.toks[verb.head]
        if verb.dep in ("acl", "relcl") and verb.head != verb.i:
            return self._distribute(head, verb, ("acl", "relcl"), members=True)
        if verb.dep in ("conj", "advcl", "xcomp") and verb.head != verb.i and head.pos in VERBS:
            return self._subjects(head)
        return []

    def _particles(self, verb: _Tok) -> list[_Tok]:
        return [p for p in self._children(verb, "prt") if not self._children(p, "pobj")]

    def _verb_object(self, verb: _Tok) -> None:
        objects = self._objects_of(verb, *OBJECT_DEPS)
        if not objects or self._children(verb, "nsubjpass"):
            return
        words = [verb, *self._particles(verb)]
        self._add_targets(self._subjects(verb), [(words, o) for o in objects])

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
        if prep.text == "of" and self._is_no_object(anchor):
            return  # the outer preposition builds "in front of"; frames relate nothing
        targets: list[tuple[list[_Tok], int]] = []
        for pobj in self._children(prep, "pobj"):
            for target in self._conjuncts(pobj):
                if self._is_relational(target):
                    # "in front of the house", "to the left of a square"
                    of = self._of(target)
                    phrase = [*words, *self._children(target, "det"), target, of]
                    targets += [(phrase, e) for e in self._objects_of(of, "pobj")]
                else:
                    targets += [(words, e) for e in self._entities(target)]
        if not targets:
            self._on_it(prep, anchor, words)
            return
        if self._reattach(prep, anchor, words, targets):
            return
        if anchor.pos in VERBS:
            self._verb_prepositional(anchor, prep, words, targets)
        elif anchor.pos in NOUNS or self._entities(anchor):
            subjects = self._distribute(anchor, words[0], ("prep",), members=prep.text != "of")
            self._add_targets(subjects, targets)

    def _attachment_point(self, anchor: _Tok, words: list[_Tok]) -> tuple[_Tok, _Tok] | None:
        """(verb, noun) between which a prepositional phrase headed by ``words`` may attach:
        the anchor verb and the noun nearest before the phrase that is its object or the
        object of its other preposition; or the anchor noun (an object of a verb or of the
        verb's preposition) and that verb. None where there is no such choice."""
        toks = self.toks
        if anchor.pos in VERBS and anchor.lemma != "be":
            nouns = [
                t
                for t in toks[anchor.i + 1 : words[0].i]
                if t.i in self.index
                and (
                    (t.head == anchor.i and t.dep in ("dobj", "obj"))
                    or (
                        t.dep == "pobj"
                        and toks[t.head].dep == "prep"
                        and toks[t.head].head == anchor.i
                    )
                )
            ]
            return (anchor, nouns[-1]) if nouns else None
        if anchor.i in self.index and anchor.head != anchor.i:
            head = toks[anchor.head]
            if anchor.dep == "pobj" and head.dep == "prep" and head.head != head.i:
                head = toks[head.head]
            elif anchor.dep not in ("dobj", "obj"):
                return None
            if head.pos in VERBS and head.lemma != "be" and head.i < anchor.i:
                return head, anchor
        return None

    def _reattach(self, prep: _Tok, anchor: _Tok, words, targets) -> bool:
        """The learned attachment (Collins and Brooks 1995's backed-off model over (verb,
        noun, preposition, noun)) where it overrules the parse: the phrase goes to the noun
        ("a cat sitting next to a laptop on a desk": (laptop, on, desk)) or to the verb's
        subjects ("a surfer riding a wave in the ocean": (surfer, in, ocean)). True when it
        added the relations."""
        point = self._attachment_point(anchor, words)
        if point is None or prep.dep == "agent" or prep.text == "of":  # "of" stays on its noun
            return False
        verb, noun = point
        phrase = " ".join(w.text for w in words)
        target = self.toks[targets[0][1]]
        key = (verb.lemma, noun.lemma, phrase, target.lemma)
        if self.record is not None:
            name = {t: self.graph.objects[k]["lemma"] for t, k in self.index.items()}
            subjects = [name[i] for i in self._subjects(verb) if i in name]
            objects = [name[o] for _, o in targets if o in name]
            self.record.append((key, anchor is noun, subjects, name[noun.i], objects))
        choice = self.attach(*key, anchor is noun)
        if choice is None or choice == (anchor is noun):
            return False
        self._add_targets([noun.i] if choice else self._subjects(verb), targets)
        return True

    def _verb_prepositional(self, verb: _Tok, prep: _Tok, words, targets) -> None:
        if prep.dep == "agent":  # passive: "played by a woman", "a field surrounded by trees"
            patients = [([verb], p) for p in self._subjects(verb)]
            self._add_targets([agent for _, agent in targets], patients)
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
                objects = self._objects_of(verb, "dobj", "obj")
                owned = any(
                    c.pos == "PRON"
                    for p in self._children(prep, "pobj")
                    for c in self._children(p, "poss")
                )
                if objects and (verb.lemma in PLACING_VERBS or owned):
                    subjects = objects  # "put a pizza into the oven", "a phone in his hand"
        self._add_targets(subjects, targets, verb_words)

    def _add_targets(self, subjects: list[int], targets, verb_words=()) -> None:
        """Relations from each of ``subjects`` to each (phrase, object) of ``targets``."""
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
