"""Placing relations said through a pronoun: "a building with a clock on it", "the building
has bricks on it", "a table with a laptop sitting on it", "a car with a canoe on top of it".
The thing is placed on the holder: (clock, on, building) in place of (building, with,
clock), as FACTUAL's annotators write it (the builder drops the "with"/"have" relation of a
pair it records in ``located``)."""

from __future__ import annotations

from features.scenegraph.lexicon import VERBS


class Placing:
    """The builder's handling of "X with Y on it" (mixed into
    :class:`features.scenegraph.builder._Builder`, whose state and helpers it uses)."""

    def _on_it(self, prep, anchor, words) -> None:
        """The placing relation of ``prep`` whose object is "it" or "them": (clock, on,
        building), (fork, on, plate) for "a plate with a fork and a knife on it", (laptop,
        sit on, table), (canoe, on top of, car)."""
        toks = self.toks
        pobjs = self._children(prep, "pobj")
        if pobjs and self._is_relational(pobjs[0]):  # "on top of it"
            of = self._of(pobjs[0])
            words = [*words, pobjs[0], of]
            pobjs = self._children(of, "pobj")
        if not any(p.text in ("it", "them") for p in pobjs):
            return
        if anchor.pos in VERBS and anchor.dep == "acl" and anchor.head in self.index:
            words = [anchor, *words]  # "a laptop sitting on it"
            anchor = toks[anchor.head]
        pairs = []
        if anchor.i in self.index and anchor.dep in ("pobj", "conj", "dobj"):
            first = anchor
            while first.dep == "conj" and toks[first.head].i in self.index:
                first = toks[first.head]
            things = [e for c in self._conjuncts(first) for e in self._entities(c)]
            head = toks[first.head]
            if first.dep == "pobj" and head.text == "with" and head.head != head.i:
                pairs = [(x, h) for x in things for h in self._entities(toks[head.head])]
            elif first.dep == "dobj" and head.pos in VERBS and head.lemma == "have":
                pairs = [(x, h) for x in things for h in self._subjects(head)]
        elif anchor.pos in VERBS and anchor.lemma == "have":
            things = [e for o in self._children(anchor, "dobj") for e in self._entities(o)]
            pairs = [(x, h) for x in things for h in self._subjects(anchor)]
        elif anchor.i in self.index:  # "with" and "on it" both on the holder
            withs = [w for w in self._children(anchor, "prep") if w.text == "with"]
            things = [
                e for w in withs for o in self._children(w, "pobj") for e in self._entities(o)
            ]
            pairs = [(x, anchor.i) for x in things if x < prep.i]
        for thing, holder in pairs:
            if thing in self.index and holder in self.index:
                self.located.add((self.index[holder], self.index[thing]))
                self._add(thing, words, holder)
