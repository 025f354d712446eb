"""The scene-graph stage's parser scored on FACTUAL's human-annotated graphs (Visual Genome
region captions; ``../shared/data/factual/``), strict and convention-neutral (the matching
and the conventions: :mod:`features.scenegraph.factual`), with SceneGraphParser's row when
the ``sng_parser`` package is importable, and the largest error classes.

    python benchmarks/scenegraph_factual.py [FILE.csv ...] [--errors 12] [--limit N]
        [--unseen] [--edges project|factual|off]

Without files: the random-split dev set and the length-split dev set. ``--unseen`` drops
the captions that occur verbatim in the training file the learned parts were trained on
(929 of length dev's 1000 do); ``--edges``: the learned edge model's mode
(:mod:`features.scenegraph.edges`; ``off``: the rules alone, the "before" row).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from features.scenegraph.factual import (
    KINDS,
    Lemmas,
    data_folder,
    predicted_raw,
    read_factual,
    score,
)
from features.scenegraph.parser import Parser
from features.scenegraph.stage import ScenegraphConfig, load_pipeline, parse_captions
from infra.config import UserError

DEFAULT = ("random_dev.csv", "length_dev.csv")


def sng_graphs(captions: list[str], nlp) -> list | None:
    """SceneGraphParser 0.1's graphs with the same spaCy pipeline, as Raw graphs; None when
    the package is not installed."""
    if importlib.util.find_spec("sng_parser") is None:
        return None
    import sng_parser

    from features.scenegraph.factual import Raw

    parser = sng_parser.Parser("spacy", model=nlp)
    out = []
    for text in captions:
        g = parser.parse(text)
        names = [e["lemma_head"].lower() for e in g["entities"]]
        out.append(
            Raw(
                frozenset(names),
                frozenset(
                    (names[i], m["lemma_span"].lower())
                    for i, e in enumerate(g["entities"])
                    for m in e["modifiers"]
                    if m["dep"] in ("amod", "nummod", "compound") and m["dep"] != "det"
                ),
                frozenset(
                    (names[r["subject"]], r["lemma_relation"].lower(), names[r["object"]])
                    for r in g["relations"]
                ),
            )
        )
    return out


def table(name: str, rows: dict[str, dict]) -> None:
    print(f"\n{name}: F1 (precision / recall)")
    print(f"{'':34s}" + "".join(f"{k:>22s}" for k in KINDS))
    for label, scores in rows.items():
        cells = "".join(
            f"{s['f1']:8.3f} ({s['precision']:.3f}/{s['recall']:.3f})"
            for s in (scores[k] for k in KINDS)
        )
        print(f"{label:34s}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="FACTUAL CSVs (default: dev sets)")
    parser.add_argument("--errors", type=int, default=12, help="error classes to list")
    parser.add_argument("--limit", type=int, default=0, help="first N captions only")
    parser.add_argument("--model", default=ScenegraphConfig().spacy_model)
    parser.add_argument("--unseen", action="store_true", help="drop captions seen in training")
    parser.add_argument("--edges", choices=("project", "factual", "off"), default="project")
    args = parser.parse_args()
    files = args.files or [data_folder() / f for f in DEFAULT]
    nlp, provenance = load_pipeline(args.model)
    lemma = Lemmas(nlp)
    edges = Parser.for_pipeline(nlp, args.edges).edges
    print(
        f"model {provenance['package']} {provenance['version']}; learned edge model: "
        + (f"{args.edges}, gates {edges.confidence}, margins {edges.threshold}" if edges else "off")
    )
    seen = set()
    if args.unseen:
        seen = {c.strip().lower() for c, _ in read_factual(data_folder() / "random_train.csv")}
    for path in files:
        rows = read_factual(path)[: args.limit or None]
        if seen:
            before = len(rows)
            rows = [(c, g) for c, g in rows if c.strip().lower() not in seen]
            print(f"{path.name}: {before - len(rows)} captions seen in random_train.csv dropped")
        captions = [c for c, _ in rows]
        gold = [g for _, g in rows]
        ours = [
            predicted_raw(r)
            for r in parse_captions(
                nlp, list(map(str, range(len(rows)))), captions, edges=args.edges
            )[0]
        ]
        sng = sng_graphs(captions, nlp)
        results, errors = {}, {}
        for neutral in (False, True):
            mode = "neutral" if neutral else "strict"
            results[f"this project, {mode}"], errors[mode] = score(ours, gold, lemma, neutral)
            if sng is not None:
                results[f"SceneGraphParser, {mode}"] = score(sng, gold, lemma, neutral)[0]
        table(f"{path.name} ({len(rows)} captions)", results)
        if sng is None:
            print(
                "SceneGraphParser (vacancy/SceneGraphParser): not importable here; issue 28's "
                "row on random dev, strict: 0.930 / 0.644 / 0.490 / 0.714 / 0.762"
            )
        for mode in ("strict", "neutral"):
            for side, label in (("fn", "missed"), ("fp", "spurious")):
                top = errors[mode][side].most_common(args.errors)
                print(f"  {mode} {label}: " + "; ".join(f"{k} {n}" for k, n in top))


if __name__ == "__main__":
    try:
        main()
    except UserError as err:  # one line: the file and what to do
        raise SystemExit(str(err)) from None
