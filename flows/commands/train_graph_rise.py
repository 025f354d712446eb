"""``vse train graph-rise`` (stage ``graph_rise``): a Graph-RISE-style image embedding
(scene-graph labels, a caption kNN graph, a head with the Neural Graph Machines
regulariser) written as a ``global``-kind store that HUSE reads."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet")
    path_in(p, "--global", dest="global_", required=True, help="global store: pooled features")
    path_in(p, "--regions", help="regions store: the head's input (graph_rise.input: regions)")
    path_in(p, "--text", required=True, help="text store (caption sentence embeddings)")
    path_in(p, "--scenegraphs", required=True, help="scene-graph folder (vse extract scenegraph)")
    path_out(p, "--out", help="global-kind store of the embedding to write")
    path_out(p, "--model", help="folder for head.pt and last.pt (resume)")
    path_out(p, "--labels", help="JSON of the label vocabulary")
    path_out(p, "--graph", help="parquet of the kNN graph: src, dst, weight")
    path_out(p, "--metrics", help="JSON of the graph statistics and kNN label precision")
    p.add_argument("--resume", action="store_true", help="continue from MODEL/last.pt")


@command(
    "train graph-rise",
    help="Graph-RISE-style image embedding for HUSE (params: graph_rise)",
    description="Labels from scene graphs, a caption kNN graph over train images, a 64-d "
    "head trained with the Neural Graph Machines regulariser; writes a global-kind store.",
    arguments=arguments,
    sections=("graph_rise", "store", "sbert"),
)
def run(args, params) -> None:
    from features.images.graph_rise.stage import train_graph_rise
    from features.ingest.manifest import read_manifest
    from infra.files import write_json

    cfg = params.graph_rise
    sbert = None
    if cfg.caption_embedding == "sbert":
        from features.text.sbert_stats import sbert_encoder

        sbert = sbert_encoder(params.sbert, progress("sbert", unit="caption"))
    start = time.perf_counter()
    metrics = train_graph_rise(
        read_manifest(Path(args.manifest)),
        Path(args.global_),
        Path(args.regions) if args.regions else None,
        Path(args.text),
        Path(args.scenegraphs),
        cfg,
        Path(args.out),
        Path(args.model),
        Path(args.labels),
        Path(args.graph),
        params.store,
        sbert_embed=sbert,
        resume=args.resume,
    )
    write_json(Path(args.metrics), metrics, digits=4)  # precisions over ~100 images
    g = metrics["graph"]
    print(
        f"graph-rise: {metrics['labels']['vocabulary']} labels; graph {g['edges']} edges, "
        f"in-degree {g['in_degree']}, neighbours with the same labels "
        f"{g['neighbours_same_labels']:.1%} (random pairs {g['random_pairs_same_labels']:.1%})"
    )
    for key in (k for k in metrics if "_label_precision_at_" in k):  # val, test
        print(f"graph-rise: {key} {json.dumps({k: round(v, 4) for k, v in metrics[key].items()})}")
    print(f"graph-rise: {time.perf_counter() - start:.1f} s -> {args.out}, {args.metrics}")
