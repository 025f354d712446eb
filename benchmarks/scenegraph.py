"""Throughput of the scene-graph stage against spaCy alone, in one run.

(a) spaCy alone: ``nlp.pipe`` over the captions with the components the stage loads;
(b) the stage's core (:func:`features.scenegraph.parse_captions`: case normalisation,
``nlp.pipe``, the rules, one row per caption) on the same captions with the same pipeline.
The captions are the regression set's (``tests/data/captions_gold.jsonl``) recombined into
``--n`` new ones: the head of one caption (up to its first preposition) with the tail of
another, seeded. They run in pairs on the same chunk of captions, alternating which goes
first, so that load from other processes on the machine falls on both alike; the ratio is
given over all captions and as the median of the pairs' ratios (steadier on a shared
machine), in wall-clock and in process CPU time. Target (issue 28, with the parts learned
from FACTUAL; 0.9x for the rules alone in issue 14): (b) >= 0.5x (a).

    python benchmarks/scenegraph.py [--n 10000] [--chunk 500] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from pathlib import Path

from features.scenegraph.stage import ScenegraphConfig, load_pipeline, parse_captions

GOLD = Path(__file__).resolve().parent.parent / "tests" / "data" / "captions_gold.jsonl"
SPLIT = re.compile(r"\s(?=(?:on|in|with|next to|near|at|under|by|over|down|behind)\s)", re.I)


def captions(n: int, seed: int = 0) -> list[str]:
    """``n`` COCO-style captions: the regression set, then recombinations of it."""
    base = [json.loads(line)["caption"] for line in GOLD.read_text().splitlines()]
    heads, tails = [], []
    for text in base:
        parts = SPLIT.split(text, maxsplit=1)
        if len(parts) == 2:
            heads.append(parts[0])
            tails.append(parts[1])
    rng = random.Random(seed)
    out = list(base)
    while len(out) < n:
        out.append(f"{rng.choice(heads)} {rng.choice(tails)}")
    return out[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10000, help="captions")
    parser.add_argument("--chunk", type=int, default=500, help="captions per paired chunk")
    parser.add_argument("--batch-size", type=int, default=ScenegraphConfig().batch_size)
    parser.add_argument("--model", default=ScenegraphConfig().spacy_model)
    args = parser.parse_args()
    nlp, provenance = load_pipeline(args.model)
    texts = captions(args.n)
    keys = [str(i) for i in range(len(texts))]
    print(
        f"model {provenance['package']} {provenance['version']} ({', '.join(nlp.pipe_names)}); "
        f"{len(texts)} captions in paired chunks of {args.chunk}, batch {args.batch_size}"
    )
    list(nlp.pipe(texts[:200], batch_size=args.batch_size))  # warm-up (lemmatizer cache)
    totals = {(k, clock): 0.0 for k in ("spacy", "stage") for clock in ("wall", "cpu")}
    pairs: dict[str, list[float]] = {"wall": [], "cpu": []}
    rules = 0.0  # seconds inside the rules, part of the stage's wall time
    for c, lo in enumerate(range(0, len(texts), args.chunk)):
        chunk, chunk_keys = texts[lo : lo + args.chunk], keys[lo : lo + args.chunk]
        took = {}
        for which in ("spacy", "stage") if c % 2 == 0 else ("stage", "spacy"):  # alternate
            start, start_cpu = time.perf_counter(), time.process_time()
            if which == "spacy":
                for _ in nlp.pipe(chunk, batch_size=args.batch_size):
                    pass
            else:
                rules += parse_captions(nlp, chunk_keys, chunk, args.batch_size)[1]
            took[which, "wall"] = time.perf_counter() - start
            took[which, "cpu"] = time.process_time() - start_cpu
        for key, value in took.items():
            totals[key] += value
        for clock in pairs:
            pairs[clock].append(took["spacy", clock] / took["stage", clock])
    n = len(texts)
    for name, label in (("spacy", "spaCy alone (nlp.pipe)"), ("stage", "scene-graph stage")):
        wall, cpu = totals[name, "wall"], totals[name, "cpu"]
        print(
            f"{label:24s} {n / wall:7.1f} captions/s wall ({wall:.1f} s), "
            f"{n / cpu:7.1f} captions/s of CPU time ({cpu:.1f} s)"
        )
    for clock, label in (("wall", "wall"), ("cpu", "CPU time")):
        ratios = pairs[clock]
        overall = totals["spacy", clock] / totals["stage", clock]
        print(
            f"ratio stage / spaCy ({label}): {overall:.3f}x over all; median of {len(ratios)} "
            f"pairs {statistics.median(ratios):.3f}x (range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    print(
        f"rules and learned edge model: {1e6 * rules / n:.0f} us/caption, "
        f"{rules / totals['stage', 'wall']:.1%} of the stage's wall time"
    )
    print("target >= 0.5x")


if __name__ == "__main__":
    main()
