"""``vse extract text`` (stage ``text``): BERT token and HUSE document features, word ids,
TF-IDF, in one caption-level store, with vocabularies fitted on train."""

from __future__ import annotations

import time
from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet")
    path_out(p, "--out", help="text store to write (a killed run, rerun, resumes)")
    path_out(p, "--vocab", help="JSON of the word and TF-IDF vocabularies")


@command(
    "extract text",
    help="BERT token and HUSE document features, word and TF-IDF vocabularies (params: text)",
    description="A caption-level store: last-layer token features, WordPiece ids, HUSE "
    "document features, word ids and sparse TF-IDF, with vocabularies fitted on train.",
    arguments=arguments,
    sections=("text", "store"),
)
def run(args, params) -> None:
    from features.ingest.manifest import read_manifest
    from features.text.stage import extract_text, load_bert_texts

    cfg = params.text
    manifest = read_manifest(Path(args.manifest))
    encoder, weights = load_bert_texts(cfg)
    start = time.perf_counter()
    vocab = extract_text(
        manifest,
        encoder,
        cfg,
        weights,
        Path(args.out),
        Path(args.vocab),
        params.store,
        progress=progress("text", unit="caption"),
    )
    seconds = time.perf_counter() - start
    n = sum(len(c) for c in manifest.table["captions"].to_pylist())
    print(
        f"extract text: {n} captions with {cfg.model} ({encoder.hidden}-d) on {encoder.device} "
        f"in {seconds:.1f} s ({n / seconds:.0f} captions/s); {len(vocab['words'])} words, "
        f"{len(vocab['tfidf_terms'])} TF-IDF terms -> {args.out}, {args.vocab}"
    )
