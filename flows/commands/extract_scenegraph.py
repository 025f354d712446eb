"""``vse extract scenegraph`` (stage ``scenegraph``): the scene graph of every caption and
UniVSE's negative-sampling vocabularies."""

from __future__ import annotations

import time
from pathlib import Path

from flows.commands import Command, path_in, path_out, progress


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet")
    path_out(
        p,
        "--out",
        help="folder of the scene graphs (graphs.parquet, one row per caption) and UniVSE's "
        "negative-sampling vocabularies (negatives.json: train nouns, adjectives, relations)",
    )
    path_out(p, "--metrics", help="JSON of counts")


def run(args, params) -> int:
    # TODO(issue 14): the stage's logic moves into features.scenegraph with the real parser

    from features.files import write_json
    from features.ingest import IngestError, read_manifest
    from features.scenegraph import load_spacy, negative_vocab, parse_captions
    from features.scenegraph_files import write_scene_graphs

    cfg = params.scenegraph
    manifest = read_manifest(Path(args.manifest))
    try:
        nlp = load_spacy(cfg.spacy_model)
    except RuntimeError as err:
        raise IngestError(str(err)) from None
    keys, texts, splits = manifest.caption_rows()
    start = time.perf_counter()
    bar = progress("scenegraph", unit="caption")
    rows = parse_captions(
        nlp, keys, texts, cfg.batch_size, progress=lambda docs: bar(docs, total=len(texts))
    )
    seconds = time.perf_counter() - start
    vocab = negative_vocab(rows, splits)
    write_scene_graphs(args.out, rows, vocab)
    counts = {
        k: round(sum(len(r[k]) for r in rows) / max(len(rows), 1), 3)
        for k in ("objects", "attributes", "relations")
    }
    write_json(args.metrics, {"captions": len(rows), "per_caption": counts})
    print(
        f"scenegraph: negative-sampling vocabularies (train): {len(vocab['nouns'])} nouns, "
        f"{len(vocab['adjectives'])} adjectives, {len(vocab['relations'])} relations "
        f"-> {args.out}"
    )
    print(
        f"scenegraph: {len(rows)} captions with {cfg.spacy_model} in {seconds:.1f} s "
        f"({len(rows) / max(seconds, 1e-9):.0f} captions/s); per caption {counts['objects']} "
        f"objects, {counts['attributes']} attributes, {counts['relations']} relations "
        f"-> {args.out}"
    )
    return 0


COMMANDS = [
    Command(
        "extract scenegraph",
        help="scene graphs of every caption from a spaCy parse (params: scenegraph)",
        description="Objects, attribute-object pairs and relation triples per caption, by "
        "rules over a dependency parse (Schuster et al. 2015), to parquet.",
        arguments=arguments,
        run=run,
        sections=("scenegraph",),
    )
]
