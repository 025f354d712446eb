"""Training of the tables :mod:`features.scenegraph.learned` applies, from FACTUAL's
training graphs (a reproducible script; its output, the generated module
:mod:`features.scenegraph.learned_predicates`, records the training file's SHA-256):

    python -m features.scenegraph.train_learned [--train FILE.csv] [--min-count 8]

The captions are parsed as the stage parses them (:func:`features.scenegraph.learned.caption_text`,
with the noun starts mined first: they depend on the gold graphs alone).
"""

from __future__ import annotations

import argparse
import hashlib
import textwrap
from collections import Counter, defaultdict
from pathlib import Path

from features.scenegraph.factual import (
    PREPOSITIONS,
    Lemmas,
    data_folder,
    neutral_predicate,
    predicted_raw,
    read_factual,
    tuples,
)
from features.scenegraph.learned import backoff, caption_text
from features.scenegraph.learned_predicates import ATTACHMENT, PREDICATES
from features.scenegraph.parser import Parser
from features.scenegraph.stage import load_pipeline
from infra.config import UserError

OUT = Path(__file__).resolve().parent / "learned_predicates.py"


def attachment_counts(records, gold_pairs, lemma, min_count: int = 3) -> dict[tuple, tuple]:
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
            for level in backoff(noun, *key):
                for k in level:
                    counts[k][0 if label else 1] += 1
    return {
        k: tuple(c)
        for k, c in sorted(counts.items())
        if sum(c) >= min_count or (k[1], k[2], k[4]) == ("", "", "")
    }


def noun_starts(rows, lemma, min_count: int = 5, share: float = 0.8) -> dict[str, tuple]:
    """The words that begin a caption and are an object of its gold graph (the head of a
    gold object's name has the word's noun lemma) in at least ``share`` of at least
    ``min_count`` captions that begin with them, with their (object, total) counts:
    "surfboard" (in "surfboard in the sand"), not "white" or "riding"."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for caption, gold in rows:
        words = caption.split(maxsplit=1)
        word = words[0].lower() if words else ""
        if not word.isalpha():
            continue
        heads = {lemma(o.split()[-1], "NOUN") for o in gold.objects if o.split()}
        counts[word][0] += lemma(word, "NOUN") in heads or word in heads
        counts[word][1] += 1
    return {
        w: tuple(c) for w, c in sorted(counts.items()) if c[1] >= min_count and c[0] >= share * c[1]
    }


def mine(
    pairs, lemma, min_count: int = 8, share: float = 0.6
) -> tuple[dict[tuple[str, str], str], dict]:
    """The table (preposition, object head) -> predicate from (predicted Raw graph, gold Raw
    graph) pairs (:mod:`features.scenegraph.factual`), and the evidence of each kept key
    (counts of the aligned gold predicates): each predicted relation whose predicate is a
    bare preposition is aligned with the gold relations of its (subject, object) pair; a key
    is kept whose most frequent aligned gold predicate is another one in at least ``share``
    of at least ``min_count`` cases, and another one in the convention-neutral reading too
    (so "on" is never turned into "sit on")."""
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=data_folder() / "random_train.csv")
    parser.add_argument("--min-count", type=int, default=8)
    parser.add_argument("--share", type=float, default=0.6)
    parser.add_argument("--min-attachment", type=int, default=3, help="rarer keys dropped")
    parser.add_argument("--min-start", type=int, default=5, help="rarer first words dropped")
    parser.add_argument("--model", default="en_core_web_sm")
    args = parser.parse_args()
    rows = read_factual(args.train)
    digest = hashlib.sha256(args.train.read_bytes()).hexdigest()
    nlp, provenance = load_pipeline(args.model)
    # mined with the tables off: what the rules alone say
    PREDICATES.clear()
    ATTACHMENT.clear()
    rules = Parser.for_pipeline(nlp, "off")
    lemma = Lemmas(nlp)
    starts = noun_starts(rows, lemma, args.min_start)
    texts = (caption_text(c, frozenset(starts)) for c, _ in rows)
    graphs, records = [], []
    for doc in nlp.pipe(texts, batch_size=256):
        records.append([])
        graphs.append(rules(doc, record=records[-1]).to_json())
    pairs = [(predicted_raw(g, "lemma"), gold) for g, (_, gold) in zip(graphs, rows, strict=True)]
    table, evidence = mine(pairs, lemma, args.min_count, args.share)
    gold_pairs = [tuples(gold, lemma)["pairs"] for _, gold in rows]
    attachment = attachment_counts(records, gold_pairs, lemma, args.min_attachment)
    points = sum(map(len, records))
    body = "".join(f"    {k!r}: {p!r},\n" for k, p in sorted(table.items())).replace("'", '"')
    counts = "".join(f"    {k!r}: {v!r},\n" for k, v in attachment.items()).replace("'", '"')
    words = textwrap.fill(" ".join(starts), 88)
    OUT.write_text(
        '"""Generated by ``python -m features.scenegraph.train_learned`` (do not edit): the\n'
        "tables learned from FACTUAL's training graphs (see features/scenegraph/learned.py).\n\n"
        f"training file: {args.train.name}, {len(rows)} captions, sha256\n{digest}\n"
        f"spaCy: {provenance['package']} {provenance['version']}; "
        f"min_count {args.min_count}, share {args.share}, min_attachment {args.min_attachment}, "
        f"min_start {args.min_start}\n"
        '"""\n\n'
        f"PREDICATES: dict[tuple[str, str], str] = {{\n{body}}}\n\n"
        f"# (parse's choice, verb, noun, preposition, noun) -> (noun, verb) attachments; "
        f"{points} decision points\n"
        f"ATTACHMENT: dict[tuple, tuple[int, int]] = {{\n{counts}}}\n\n"
        f"# first words of captions that are an object of the gold graph in >= 80% of the >= "
        f"{args.min_start}\n# captions that begin with them: caption_text puts an article "
        "before them\n"
        f'NOUN_STARTS = frozenset(\n    """\n{words}\n""".split()\n)\n'
    )
    for key, c in evidence.items():
        print(key, "->", table[key], c)
    print(f"{len(starts)} noun starts")
    print(f"{len(table)} keys from {len(rows)} captions (sha256 {digest[:12]}) -> {OUT}")


if __name__ == "__main__":
    try:
        main()
    except UserError as err:  # one line: the file and what to do
        raise SystemExit(str(err)) from None
