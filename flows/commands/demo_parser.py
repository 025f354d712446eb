"""``vse demo-parser``: a spaCy tagger/parser/lemmatizer trained on the demo's gold trees."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flows.commands import Command, path_in, path_out


def arguments(p) -> None:
    path_in(p, "--dataset", required=True, help="demo dataset.json (with gold trees)")
    path_out(p, "--out", help="folder for the spaCy pipeline")
    path_out(p, "--metrics", help="JSON of held-out accuracies")


def run(args, params) -> int:
    from features import demo_parser
    from features.files import atomic_path, write_json

    dataset = json.loads(Path(args.dataset).read_text(encoding="utf-8"))
    start = time.perf_counter()
    nlp = demo_parser.train(dataset, params.parser)
    with atomic_path(args.out, directory=True) as tmp:
        nlp.to_disk(tmp)
    scores = demo_parser.evaluate(nlp, dataset, "test")
    write_json(args.metrics, scores)
    g = scores["scene_graph"]
    print(
        f"parser: trained in {time.perf_counter() - start:.0f} s -> {args.out}; held-out "
        f"{scores['captions']} captions: POS {scores['pos_acc']:.3f}, UAS "
        f"{scores['dep_uas']:.3f}, LAS {scores['dep_las']:.3f}, lemma {scores['lemma_acc']:.3f}; "
        f"scene-graph F1 objects {g['objects']['f1']:.3f}, attributes "
        f"{g['attributes']['f1']:.3f}, relations {g['relations']['f1']:.3f}, exact graphs "
        f"{g['exact_graphs']:.3f}"
    )
    return 0


COMMANDS = [
    Command(
        "demo-parser",
        help="train a spaCy tagger/parser/lemmatizer on the demo's gold trees (params: parser)",
        description="Trains on train-split captions, scores POS, UAS/LAS, lemmas and scene "
        "graphs on test-split captions, and saves the pipeline.",
        arguments=arguments,
        run=run,
        sections=("parser",),
    )
]
