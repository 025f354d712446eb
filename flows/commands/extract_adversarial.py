"""``vse extract adversarial`` (stage ``adversarial``): UniVSE 4.2 text-domain attacks,
made by editing each caption's scene graph, encoded like the ``text`` stage."""

from __future__ import annotations

import time
from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet")
    path_in(p, "--scenegraphs", required=True, help="scene-graph folder (vse extract scenegraph)")
    path_in(p, "--vocab", required=True, help="text vocabularies (vse extract text)")
    path_out(p, "--captions", help="parquet of the fake captions to write")
    path_out(p, "--out", help="text store of the fake captions to write")


@command(
    "extract adversarial",
    help="text-domain adversarial captions and their text features (params: adversarial)",
    description="UniVSE 4.2: object, attribute and relation attacks made by editing each "
    "caption's scene graph; encoded with the text stage's model and vocabularies.",
    arguments=arguments,
    sections=("adversarial", "text", "store"),
)
def run(args, params) -> None:
    from features.ingest.manifest import read_manifest
    from features.scenegraph.adversarial import adversarial_stage
    from features.text.stage import load_bert_texts

    cfg = params.adversarial
    encoder, weights = load_bert_texts(params.text)
    start = time.perf_counter()
    counts = adversarial_stage(
        read_manifest(Path(args.manifest)),
        Path(args.scenegraphs),
        Path(args.vocab),
        cfg,
        encoder,
        params.text,
        weights,
        Path(args.captions),
        Path(args.out),
        params.store,
        progress=progress("adversarial", unit="caption"),
    )
    print(
        f"adversarial: {sum(counts.values())} fake captions for {', '.join(cfg.splits)} "
        f"({counts}) encoded in {time.perf_counter() - start:.0f} s -> {args.captions}, "
        f"{args.out}"
    )
