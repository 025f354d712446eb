"""The spaCy side of the scene-graph parser: the parse of a caption, repaired where spaCy's
small English model errs systematically on captions, then handed to the rules."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Collection

from features.scenegraph.builder import SceneGraph, _Builder, _Tok
from features.scenegraph.edges import EdgeModel
from features.scenegraph.gaps import repair_gapped_clause
from features.scenegraph.learned import attach, relabel
from features.scenegraph.lexicon import (
    ING_NOUNS,
    LEXICAL_COMPOUNDS,
    NAME_DEPS,
    NOUNS,
    VERBS,
    participle_lemma,
    verb_lemma,
)

# pipeline -> {edge model mode: Parser}
_PARSERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Parser:
    """Builds one :class:`SceneGraph` per spaCy ``Doc``.

    ``verbs``/``nouns``: the lemmatizer's word indexes (:meth:`for_pipeline`), used by the
    lemma guard and the repairs; without them those checks trust the parse.
    """

    def __init__(
        self,
        verbs: Collection[str] | None = None,
        nouns: Collection[str] | None = None,
        noun_exceptions: dict | None = None,
    ):
        self.verbs = frozenset(verbs) if verbs is not None else None
        self.nouns = frozenset(nouns) if nouns is not None else None
        self.noun_exceptions = noun_exceptions or {}  # irregular plurals: leaves -> leaf
        self.edges: EdgeModel | None = None  # the learned edge model, for its pipeline only

    @classmethod
    def for_pipeline(cls, nlp, edges: str = "project") -> Parser:
        """A parser with the verb and noun indexes of ``nlp``'s rule lemmatizer, if any
        (built once per pipeline: the indexes hold some 66k words), and the learned edge
        model where it was trained on ``nlp``, in mode ``edges`` ("project", "factual" or
        "off": :meth:`features.scenegraph.edges.EdgeModel.gated`)."""
        parsers = _PARSERS.get(nlp)
        if parsers is None:
            parser = cls()
            if "lemmatizer" in nlp.pipe_names:
                lookups = getattr(nlp.get_pipe("lemmatizer"), "lookups", None)
                if lookups is not None and lookups.has_table("lemma_index"):
                    index = lookups.get_table("lemma_index")
                    exceptions = dict(lookups.get_table("lemma_exc", {}).get("noun", {}))
                    parser = cls(index.get("verb", []), index.get("noun", []), exceptions)
            parsers = _PARSERS[nlp] = {"off": parser}
            model = EdgeModel.load()
            if model is not None and model.fits(nlp):
                for mode in ("project", "factual"):
                    parsers[mode] = copy.copy(parser)
                    parsers[mode].edges = model.gated(mode)
        if edges not in ("project", "factual", "off"):
            raise ValueError(f"edge model mode {edges!r}: project, factual or off")
        return parsers.get(edges, parsers["off"])

    def __call__(self, doc, record: list | None = None) -> SceneGraph:
        """The scene graph of ``doc``: the rules' (:meth:`rules`), rewritten by the learned
        edge model where the parser has one and ``doc`` has the token vectors it was
        trained on."""
        graph, toks, builder = self.rules(doc, record)
        tensor = getattr(doc, "tensor", None)
        width = None if self.edges is None else self.edges.width
        if tensor is not None and tensor.shape == (len(doc), width):
            self.edges.apply(tensor, toks, builder.index, builder.name_words, graph)
        return graph

    def rules(self, doc, record: list | None = None) -> tuple[SceneGraph, list[_Tok], _Builder]:
        """The rules' scene graph of ``doc``, the repaired tokens and the builder (its
        ``index``: object head token -> object); ``record``: a list that collects the
        prepositional attachment decisions (for :mod:`features.scenegraph.train_learned`)."""
        toks = []
        for t in doc:
            lemma = (t.lemma_ or t.text).lower()
            if t.pos_ in VERBS:
                lemma = verb_lemma(t.text, lemma, self.verbs)
            toks.append(_Tok(t.i, t.lower_, lemma, t.pos_, t.tag_, t.dep_, t.head.i))
        self._repair(toks)
        for t in toks:
            if t.head != t.i:
                toks[t.head].kids.setdefault(t.dep, []).append(t)
        builder = _Builder(toks, attach, record)
        return relabel(builder.build()), toks, builder

    # -- repairs of frequent parser errors, on the editable view

    def _repair(self, toks: list[_Tok]) -> None:
        self._caption_head(toks)
        repair_gapped_clause(toks)
        for t in toks:
            head = toks[t.head]
            dep = t.dep
            if dep in ("nsubj", "nsubjpass") and head.dep in ("aux", "auxpass"):
                t.head = head.head  # "the street is lined with": the subject hangs on the auxiliary
            elif dep == "npadvmod" and t.pos in NOUNS and head.tag == "VBG" and t.i < head.i:
                # "baby laying on a blanket": the noun before a participle is its subject
                if head.dep == "ROOT" and not any(
                    c.head == head.i and c.dep in ("nsubj", "nsubjpass") for c in toks
                ):
                    t.dep = "nsubj"
            elif dep == "pcomp" and t.text in ING_NOUNS and head.pos == "ADP":
                # "window on building": a noun in -ing read as a gerund
                t.pos, t.tag, t.dep, t.lemma = "NOUN", "NN", "pobj", t.text
            elif dep in NAME_DEPS and t.pos in NOUNS:
                # "the large red disk sitting above": a noun compound of a verb is its subject
                if dep == "compound" and head.pos == "VERB" and t.i < head.i:
                    t.dep = "nsubj"
                # "fire hydrant" parsed as fire <- hydrant: English compounds are right-headed
                elif head.pos in NOUNS and head.i == t.i - 1:
                    self._promote(toks, head, t, "compound")
            elif dep == "prep" and t.text in ("in", "with") and head.lemma == "cover":
                # "a tree covered in snow" says what "covered by snow" says: (snow, cover, tree)
                if head.tag == "VBN":
                    t.dep = "agent"
        for t in toks:
            if t.pos == "NOUN" and t.i and toks[t.i - 1].dep == "compound":
                self._participle_as_noun(toks, t)
        for t in toks:
            # "a woman holds a baby and smiles": a noun conjoined with a verb is a verb
            if t.dep == "conj" and t.pos in NOUNS and toks[t.head].pos == "VERB":
                if self.verbs is None or t.lemma in self.verbs:
                    t.pos = "VERB"
        self._repair_lists(toks)

    def noun_lemma(self, text: str) -> str | None:
        """The singular of a noun form the noun index knows ("leaves" -> "leaf", "clock"),
        else None (also without an index)."""
        if self.nouns is None:
            return None
        if text in self.noun_exceptions:
            return self.noun_exceptions[text][0]
        for old, new in (("ies", "y"), ("ves", "f"), ("es", ""), ("s", ""), ("", "")):
            if text.endswith(old) and len(text) > len(old) + 1:
                stem = text[: len(text) - len(old)] + new
                if stem in self.nouns:
                    return stem
        return None

    def _caption_head(self, toks: list[_Tok]) -> None:
        """Region captions without a verb whose first noun the tagger reads as one: "clock
        on a pole", "leaves on the trees" (a root verb without subject or object, only
        modifiers before it, that is a noun), "exposed rocks in snow" (a participle with the
        object after it: an adjective of that noun) and "cutting board with bread" (a
        lexical compound)."""
        root = next((t for t in toks if t.head == t.i), None)
        if root is None or root.pos != "VERB":
            return
        kids = [t for t in toks if t.head == root.i and t is not root]
        if any(t.dep in ("nsubj", "nsubjpass", "aux", "auxpass", "expl", "csubj") for t in kids):
            return
        if any(t.head != root.i or t.dep not in ("det", "amod", "nummod") for t in toks[: root.i]):
            return
        objects = [t for t in kids if t.dep == "dobj"]
        if (
            root.tag in ("VB", "VBZ", "VBP")
            and not objects
            and not any(t.dep in ("ccomp", "xcomp", "prt") for t in kids)
        ):
            lemma = self.noun_lemma(root.text)
            if lemma is not None:
                root.pos, root.tag, root.lemma = "NOUN", "NN", lemma
            return
        if not objects or objects[0].pos not in NOUNS:
            return
        noun = objects[0]
        between = toks[root.i + 1 : noun.i]
        if not all(t.head == noun.i and t.dep in ("amod", "compound", "nummod") for t in between):
            return
        lexical = root.i + 1 == noun.i and (root.text, noun.lemma) in LEXICAL_COMPOUNDS
        if root.tag in ("VBN", "VBD") or lexical:
            self._promote(toks, root, noun, "amod")
            if not lexical:
                root.tag = "VBN"

    @staticmethod
    def _promote(toks, old: _Tok, new: _Tok, dep: str, before: int | None = None) -> None:
        """``new`` takes ``old``'s place in the tree and ``old`` becomes its ``dep``
        dependent; ``old``'s other dependents (with ``before``, those before it) hang on
        ``new``."""
        new.dep, new.head = old.dep, (old.head if old.head != old.i else new.i)
        for t in toks:
            if t.head == old.i and t is not new and (before is None or t.i < before):
                t.head = new.i
        old.dep, old.head = dep, new.i

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
            verb = participle_lemma(t.text, self.verbs)
        elif self.nouns is not None and self.verbs is not None:
            # "watches a band perform": a verb that is no noun at all
            verb = t.lemma if t.lemma in self.verbs and t.lemma not in self.nouns else None
        else:
            verb = None
        if verb is None:
            return
        self._promote(toks, t, noun, "acl", before=noun.i)  # determiners, adjectives, numbers
        t.pos, t.lemma = "VERB", verb

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
