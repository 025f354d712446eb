"""Predicate choices learned from FACTUAL's training graphs (Li et al. 2023; 37k Visual Genome
region captions, ``../shared/data/factual/random_train.csv``), where a rule cannot see the
choice: "a man in a red shirt" is (man, wear, shirt), "a woman with glasses" (woman, wear,
glasses), while "a cat in a box" stays (cat, in, box).

The model is a table (preposition, object head) -> predicate, mined by :func:`mine`: the
stage's parser runs over the training captions; each of its relations whose predicate is a
bare preposition is aligned with the gold relation of the same (subject, object) pair; a
(preposition, object) key whose aligned gold predicate is another one -- and another one in
the convention-neutral matching too, so that "on" is never turned into "sit on" -- in at
least ``share`` of at least ``min_count`` aligned cases is kept. The table is written as the
Python module :mod:`features.scenegraph.learned_predicates` (it ships with the package, and
the DAG's code dependencies see it), with the training file's SHA-256. Reproduce:

    python -m features.scenegraph.learned [--train ../shared/data/factual/random_train.csv]

:func:`relabel` applies it to a graph: the lemma changes, the surface form stays the
caption's words (adversarial captions replace words of the caption).
"""

from __future__ import annotations

import argparse
import hashlib
from collections import Counter, defaultdict
from pathlib import Path

from features.scenegraph.builder import SceneGraph
from features.scenegraph.learned_predicates import ATTACHMENT, PREDICATES

OUT = Path(__file__).resolve().parent / "learned_predicates.py"


def relabel(graph: SceneGraph, table: dict[tuple[str, str], str] = PREDICATES) -> SceneGraph:
    """``graph`` with the learned predicate of every relation whose (predicate lemma, object
    head lemma) the table holds (in place; returned for chaining)."""
    if not table:
        return graph
    seen = set()
    kept = []
    for r in graph.relations:
        head = graph.objects[r["object"]]["lemma"].split()[-1]
        learned = table.get((r["lemma"], head))
        if learned is not None:
            r = {**r, "lemma": learned}
        key = (r["subject"], r["lemma"], r["object"])
        if key not in seen:  # "in a shirt" and "wearing a shirt" are one relation
            seen.add(key)
            kept.append(r)
    graph.relations = kept
    return graph


def _backoff(noun: bool, v: str, n1: str, p: str, n2: str) -> list[list[tuple]]:
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
    for level in _backoff(noun, v, n1, p, n2):
        nouns = verbs = 0
        for key in level:
            n, vb = table.get(key, (0, 0))
            nouns, verbs = nouns + n, verbs + vb
        if nouns != verbs:
            return nouns > verbs
        if nouns:
            return None  # a tie: the parse's choice stands
    return None


def attachment_counts(records, gold_pairs, lemma, min_count: int = 2) -> dict[tuple, tuple]:
    """(noun, verb) counts of every backed-off key from the decision points of the parser
    (``Parser(doc, record=...)``) of each caption and the caption's gold (subject head,
    object head) pairs: a point is a noun attachment where the gold relates the noun and
    the phrase's object but not the verb's subject and it, a verb attachment the other way
    round, else no evidence. Keys seen fewer than ``min_count`` times are dropped, except
    the preposition-only level."""

    def head(name: str) -> str:
        return lemma(name.split()[-1], "NOUN")

    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for points, pairs in zip(records, gold_pairs, strict=True):
        for key, noun, subjects, n1, targets in points:
            labels = set()
            for t in targets:
                to_noun = (head(n1), head(t)) in pairs
                to_verb = any((head(s), head(t)) in pairs for s in subjects)
                if to_noun != to_verb:
                    labels.add(to_noun)
            if len(labels) != 1:
                continue
            label = labels.pop()
            for level in _backoff(noun, *key):
                for k in level:
                    counts[k][0 if label else 1] += 1
    return {
        k: tuple(c)
        for k, c in sorted(counts.items())
        if sum(c) >= min_count or (k[1], k[2], k[4]) == ("", "", "")
    }


def mine(
    pairs, lemma, min_count: int = 8, share: float = 0.6
) -> tuple[dict[tuple[str, str], str], dict]:
    """The table from (predicted Raw graph, gold Raw graph) pairs
    (:mod:`features.scenegraph.factual`), and the evidence of each kept key (counts of the
    aligned gold predicates)."""
    from features.scenegraph.factual import PREPOSITIONS, neutral_predicate, tuples

    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for predicted, gold in pairs:
        got, want = tuples(predicted, lemma), tuples(gold, lemma)
        by_pair = defaultdict(set)
        for s, p, o in want["relations"]:
            by_pair[s, o].add(p)
        for s, p, o in got["relations"]:
            if p not in PREPOSITIONS or (s, o) not in by_pair:
                continue
            golds = by_pair[s, o]
            counts[p, o][p if p in golds else sorted(golds)[0]] += 1
    table, evidence = {}, {}
    for key, c in sorted(counts.items()):
        best, n = c.most_common(1)[0]
        total = sum(c.values())
        if best == key[0] or total < min_count or n < share * total:
            continue
        if neutral_predicate(best.split()) == neutral_predicate([key[0]]):
            continue  # a convention ("sit on" for "on"), not a choice
        table[key] = best
        evidence[key] = dict(c.most_common(3))
    return table, evidence


def main() -> None:
    from features.scenegraph.factual import Lemmas, data_folder, predicted_raw, read_factual, tuples
    from features.scenegraph.lexicon import normalise_case
    from features.scenegraph.parser import Parser
    from features.scenegraph.stage import load_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=data_folder() / "random_train.csv")
    parser.add_argument("--min-count", type=int, default=8)
    parser.add_argument("--share", type=float, default=0.6)
    parser.add_argument("--model", default="en_core_web_sm")
    args = parser.parse_args()
    rows = read_factual(args.train)
    digest = hashlib.sha256(args.train.read_bytes()).hexdigest()
    nlp, provenance = load_pipeline(args.model)
    captions = [c for c, _ in rows]
    # mined with the tables off: what the rules alone say
    PREDICATES.clear()
    ATTACHMENT.clear()
    rules = Parser.for_pipeline(nlp)
    lemma = Lemmas(nlp)
    graphs, records = [], []
    for doc in nlp.pipe(map(normalise_case, captions), batch_size=256):
        records.append([])
        graphs.append(rules(doc, record=records[-1]).to_json())
    pairs = [(predicted_raw(g, "lemma"), gold) for g, (_, gold) in zip(graphs, rows, strict=True)]
    table, evidence = mine(pairs, lemma, args.min_count, args.share)
    gold_pairs = [tuples(gold, lemma)["pairs"] for _, gold in rows]
    attachment = attachment_counts(records, gold_pairs, lemma)
    points = sum(map(len, records))
    body = "".join(f"    ({s!r}, {o!r}): {p!r},\n" for (s, o), p in sorted(table.items()))
    body = body.replace("'", '"')
    counts = "".join(f"    {k!r}: {v!r},\n" for k, v in attachment.items()).replace("'", '"')
    OUT.write_text(
        '"""Generated by ``python -m features.scenegraph.learned`` (do not edit): predicate\n'
        "choices learned from FACTUAL's training graphs (see features/scenegraph/learned.py).\n\n"
        f"training file: {args.train.name}, {len(rows)} captions, sha256\n{digest}\n"
        f"spaCy: {provenance['package']} {provenance['version']}; "
        f"min_count {args.min_count}, share {args.share}\n"
        '"""\n\n'
        f"PREDICATES: dict[tuple[str, str], str] = {{\n{body}}}\n\n"
        f"# (parse's choice, verb, noun, preposition, noun) -> (noun, verb) attachments; "
        f"{points} decision points\n"
        f"ATTACHMENT: dict[tuple, tuple[int, int]] = {{\n{counts}}}\n"
    )
    for key, c in evidence.items():
        print(key, "->", table[key], c)
    print(f"{len(table)} keys from {len(rows)} captions (sha256 {digest[:12]}) -> {OUT}")


if __name__ == "__main__":
    main()
