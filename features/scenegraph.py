"""Rule-based scene graphs from a dependency parse (Schuster et al. 2015, as the
SceneGraphParser package does it), over spaCy ``Doc`` objects.

- Objects: nouns (NOUN, PROPN) that are not compound modifiers; compounds fold into their
  head ("dirt road"); pronouns are never objects, so relations to them are dropped; nor
  are the nouns of phrasal prepositions ("front" of "in front of") and frame nouns ("a
  picture of ...": the picture is not in the picture).
- Attributes: adjectival modifiers (amod), numerals (nummod), adjectival complements of a
  copula ("the cat is black": acomp), and adjectives conjoined with any of these.
- Relations (subject, predicate, object):
  * verb with subject and direct object: "a man rides a horse" -> (man, ride, horse);
    also participles modifying a noun: "a man riding a horse";
  * prepositions on a noun or a verb: "a cat on a mat" -> (cat, on, mat); with the verb
    and its particle folded in: "a man sitting on a bench" -> (man, sit on, bench);
  * phrasal prepositions: "in front of", "on top of", "to the left of", "next to";
  * copula: "the cat is on the mat" -> (cat, on, mat);
  * passive: "the piano is played by a woman" -> (woman, play, piano);
  * conjunctions fan out on both sides: "a man and a woman sit on a bench" -> two.
Every name is kept as its surface form and its lemma.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from features.config import Section

NOUNS = ("NOUN", "PROPN")
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
FRAME_NOUNS = {"image", "picture", "photo", "photograph", "view", "shot", "scene"}
OBJECTS = ("dobj", "obj", "attr", "oprd")


class ScenegraphConfig(Section):
    """``scenegraph`` section of params.yaml."""

    spacy_model: str = "en_core_web_sm"  # a spaCy package name or a pipeline folder
    batch_size: int = Field(256, ge=1)


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


def _lemma(token) -> str:
    return (token.lemma_ or token.text).lower()


def _conjuncts(token) -> list:
    """The token and every token conjoined with it (a chain: A, B and C)."""
    out, todo = [], [token]
    while todo:
        t = todo.pop()
        out.append(t)
        todo.extend(c for c in t.children if c.dep_ == "conj")
    return sorted(out, key=lambda t: t.i)


def _not_an_object(token) -> bool:
    """Nouns that name no object: the noun of a phrasal preposition ("front" in "in front
    of", "left" in "to the left of") and a frame noun ("a picture of a dog")."""
    has_of = any(c.dep_ == "prep" and c.text.lower() == "of" for c in token.children)
    name = token.text.lower()
    return has_of and (
        (name in RELATIONAL_NOUNS and token.dep_ == "pobj")
        or (_lemma(token) in FRAME_NOUNS and token.dep_ == "ROOT")
    )


class Parser:
    """Builds one scene graph per ``Doc``; stateless apart from the graph being built."""

    def __call__(self, doc) -> SceneGraph:
        graph = SceneGraph()
        index: dict[int, int] = {}
        for token in doc:
            if token.pos_ in NOUNS and token.dep_ != "compound" and not _not_an_object(token):
                compounds = [c for c in token.lefts if c.dep_ == "compound"]
                words = [*compounds, token]
                index[token.i] = len(graph.objects)
                graph.objects.append(
                    {
                        "span": " ".join(w.text.lower() for w in words),
                        "head": token.text.lower(),
                        "lemma": " ".join(_lemma(w) for w in words),
                    }
                )
        for token in doc:
            if token.i in index:
                self._attributes(token, index[token.i], graph)
        for token in doc:
            self._relations(token, index, graph)
        return graph

    # -- attributes

    def _attributes(self, noun, obj: int, graph: SceneGraph) -> None:
        modifiers = [c for c in noun.children if c.dep_ in ("amod", "nummod")]
        # copula: "the cat is black (and white)"
        if noun.dep_ in ("nsubj",) and _lemma(noun.head) == "be":
            modifiers += [c for c in noun.head.children if c.dep_ == "acomp"]
        # a subject conjoined with others shares the copula's complements
        if noun.dep_ == "conj":
            first = noun
            while first.dep_ == "conj":
                first = first.head
            if first.dep_ == "nsubj" and _lemma(first.head) == "be":
                modifiers += [c for c in first.head.children if c.dep_ == "acomp"]
        seen = set()
        for modifier in modifiers:
            for adjective in _conjuncts(modifier):
                if adjective.i in seen or adjective.pos_ in NOUNS:
                    continue
                seen.add(adjective.i)
                graph.attributes.append(
                    {"object": obj, "attribute": adjective.text.lower(), "lemma": _lemma(adjective)}
                )

    # -- relations

    def _relations(self, token, index: dict[int, int], graph: SceneGraph) -> None:
        if token.dep_ == "prep" or (token.dep_ == "agent"):
            self._prepositional(token, index, graph)
        if token.pos_ in ("VERB", "AUX"):
            objects = [c for c in token.children if c.dep_ in OBJECTS]
            if objects and _lemma(token) != "be":
                for subj in self._subjects(token, index):
                    for obj in (o for c in objects for o in _conjuncts(c)):
                        particles = [c for c in token.children if c.dep_ == "prt"]
                        self._add(graph, subj, [token, *particles], obj, index)

    def _subjects(self, verb, index) -> list:
        """Who does ``verb``: its subject(s), or the noun a participle modifies, or, for a
        verb conjoined with another, the first verb's subjects."""
        subjects = [c for c in verb.children if c.dep_ in ("nsubj", "csubj")]
        if not subjects and verb.dep_ in ("acl", "relcl") and verb.head.i in index:
            subjects = [verb.head]
        if not subjects and verb.dep_ == "conj" and verb.head.pos_ in ("VERB", "AUX"):
            return self._subjects(verb.head, index)
        return [s for c in subjects for s in _conjuncts(c)]

    def _prepositional(self, prep, index, graph) -> None:
        pobjs = [c for c in prep.children if c.dep_ == "pobj"]
        if not pobjs:
            return
        words = [prep]
        head = prep.head
        if head.dep_ in ("advmod",) and head.pos_ == "ADV":  # "next to", "close to"
            words.insert(0, head)
            head = head.head
        if (
            head.dep_ == "pobj"
            and head.text.lower() in RELATIONAL_NOUNS
            and head.head.dep_ == "prep"
        ):
            return  # "of" in "in front of": the outer preposition builds the relation
        targets = []
        for pobj in pobjs:
            for target in _conjuncts(pobj):
                inner = [c for c in target.children if c.dep_ == "prep"]
                if target.text.lower() in RELATIONAL_NOUNS and inner:
                    # "in front of the house", "to the left of a square"
                    dets = [c for c in target.lefts if c.dep_ == "det"]
                    phrase = [*words, *dets, target, inner[0]]
                    targets += [
                        (phrase, t)
                        for p in inner[:1]
                        for c in p.children
                        if c.dep_ == "pobj"
                        for t in _conjuncts(c)
                    ]
                else:
                    targets.append((words, target))
        if head.i in index:  # on a noun: "a cat on a mat"
            subjects = _conjuncts(head) if head.dep_ != "conj" else [head]
            verb = []
        elif head.pos_ in ("VERB", "AUX"):  # on a verb or a copula
            if prep.dep_ == "agent":  # passive: "played by a woman"
                patients = [c for c in head.children if c.dep_ == "nsubjpass"]
                for patient in (p for c in patients for p in _conjuncts(c)):
                    for _phrase, agent in targets:
                        self._add(graph, agent, [head], patient, index)
                return
            subjects = self._subjects(head, index)
            if not subjects:
                subjects = [c for c in head.children if c.dep_ == "nsubjpass"]
            verb = [] if _lemma(head) == "be" else [head]
            verb += [c for c in head.children if c.dep_ == "prt"]
        else:
            return
        for subj in subjects:
            for phrase, obj in targets:
                self._add(graph, subj, [*verb, *phrase], obj, index)

    @staticmethod
    def _add(graph, subj, words, obj, index) -> None:
        if subj.i not in index or obj.i not in index or subj.i == obj.i:
            return  # pronouns and other non-objects take no part
        words = sorted(words, key=lambda t: t.i)
        relation = {
            "subject": index[subj.i],
            "relation": " ".join(w.text.lower() for w in words),
            "lemma": " ".join(_lemma(w) for w in words),
            "object": index[obj.i],
        }
        if relation not in graph.relations:
            graph.relations.append(relation)


# --------------------------------------------------------------------------- stage


def load_spacy(name_or_path: str):
    """A spaCy pipeline by package name or folder; a missing one says how to get it."""
    import spacy

    try:
        return spacy.load(name_or_path)
    except OSError:
        raise RuntimeError(
            f"spaCy pipeline {name_or_path!r} is not installed. Install it where there is "
            f"network (`python -m spacy download {name_or_path}`, or pip install its wheel "
            "from the spaCy models releases), or set scenegraph.spacy_model to a local "
            "pipeline folder (the demo trains one: stage `parser`)."
        ) from None


def parse_captions(
    nlp, keys: list[str], texts: list[str], batch_size: int = 256, progress=None
) -> list[dict]:
    """One row per caption: key, caption and its scene graph (surface forms and lemmas)."""
    parser = Parser()
    rows = []
    docs = nlp.pipe(texts, batch_size=batch_size)
    for key, text, doc in zip(keys, texts, progress(docs) if progress else docs, strict=True):
        rows.append({"key": key, "caption": text, **parser(doc).to_json()})
    return rows


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
    from collections import Counter

    counts = {"nouns": Counter(), "adjectives": Counter(), "relations": Counter()}
    for row, split in zip(rows, splits, strict=True):
        if split != "train":
            continue
        counts["nouns"].update(o["lemma"] for o in row["objects"])
        counts["adjectives"].update(a["lemma"] for a in row["attributes"])
        counts["relations"].update(r["lemma"] for r in row["relations"])
    return {k: dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) for k, c in counts.items()}
