"""``vse extract scenegraph`` (stage ``scenegraph``): the scene graph of every caption and
UniVSE's negative-sampling vocabularies."""

from __future__ import annotations

from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet")
    path_out(
        p,
        "--out",
        help="folder of the scene graphs (graphs.parquet, one row per caption) and UniVSE's "
        "negative-sampling vocabularies (negatives.json: train nouns, adjectives, relations)",
    )
    path_out(p, "--metrics", help="JSON of counts (a DVC metrics file)")


@command(
    "extract scenegraph",
    help="scene graphs of every caption from a spaCy parse (params: scenegraph)",
    description="Objects, attribute-object pairs and relation triples per caption, by "
    "rules over a dependency parse (Schuster et al. 2015), to a folder of parquet and JSON.",
    arguments=arguments,
    sections=("scenegraph",),
)
def run(args, params) -> None:
    from features.ingest.manifest import read_manifest
    from features.scenegraph.files import write_scene_graphs
    from features.scenegraph.stage import extract_scene_graphs, load_pipeline
    from infra.files import write_json

    cfg = params.scenegraph
    manifest = read_manifest(Path(args.manifest))
    nlp, model = load_pipeline(cfg.spacy_model)
    print(
        f"scenegraph: spaCy pipeline {model['name']} -> {model['package']} {model['version']} "
        f"({', '.join(nlp.pipe_names)})"
    )
    total = sum(len(c) for c in manifest.table["captions"].to_pylist())
    bar = progress("scenegraph", unit="caption")
    result = extract_scene_graphs(manifest, nlp, cfg, progress=lambda docs: bar(docs, total=total))
    write_scene_graphs(args.out, result.graphs, result.vocab)
    write_json(args.metrics, {**result.summary, "model": model})
    counts, speed = result.summary["per_caption"], result.timings
    print(
        f"scenegraph: {speed['captions']} captions in {speed['seconds']:.1f} s "
        f"({speed['captions_per_s']:.0f} captions/s, {speed['rules_seconds']:.1f} s in the "
        f"rules); per caption {counts['objects']} objects, {counts['attributes']} attributes, "
        f"{counts['relations']} relations; negative vocabularies (train): "
        f"{result.summary['negative_vocab']} -> {args.out}"
    )
