"""``vse stats sbert`` (stage ``sbert_stats``): Sentence-BERT similarity of the captions
of each image (MV-VSE Fig. 2)."""

from __future__ import annotations

from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet")
    path_out(p, "--metrics", help="JSON of summary metrics per split")
    path_out(p, "--histogram", help="JSON histogram (a DVC plot)")
    path_out(p, "--png", help="PNG of the histogram")
    path_out(p, "--examples", help="JSON of most/least consistent images")


@command(
    "stats sbert",
    help="Sentence-BERT similarity of captions of the same image (params: sbert)",
    description="Per image, the cosine similarity of every pair of its captions (MV-VSE "
    "Fig. 2): metrics per split, a histogram (DVC plot and PNG), extreme images.",
    arguments=arguments,
    sections=("sbert",),
)
def run(args, params) -> None:
    from features.ingest.manifest import read_manifest
    from features.text.sbert_stats import caption_statistics, sbert_encoder, write_statistics

    cfg = params.sbert
    manifest = read_manifest(Path(args.manifest))
    embed = sbert_encoder(cfg, progress("sbert", unit="caption"))
    result = caption_statistics(manifest, embed, cfg)
    write_statistics(result, args.metrics, args.histogram, args.png, args.examples)
    for split, m in result["metrics"].items():
        print(
            f"sbert: {split}: {m['pairs']} pairs, mean {m.get('mean', 0):.3f}, median "
            f"{m.get('median', 0):.3f}, below 0: {m.get('fraction_below_0', 0):.1%}"
        )
    print(f"sbert: plot {args.png}, most/least consistent images {args.examples}")
