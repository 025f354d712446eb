"""The ``vse`` command line: thin entry points over the pure cores in ``features/``.

Every command validates the whole ``params.yaml`` before doing anything, so a broken
config fails fast. Paths come from the command line (written once, in ``dvc.yaml``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from tqdm import tqdm

from features.config import ConfigError, UserError
from features.ingest import IngestError
from features.store import StoreError
from features.text_models import TextModelError
from flows import model_cli

if TYPE_CHECKING:  # params import every model (and torch): only commands that need them
    from flows.params import Params


def _progress(desc: str, unit: str = "img"):
    """A tqdm wrapper that shows items/s; quiet enough for CI logs."""
    return lambda items: tqdm(items, desc=desc, unit=unit, mininterval=1.0, dynamic_ncols=True)


def cmd_params(args: argparse.Namespace, params: Params) -> int:
    """Print the validated params, defaults filled in."""
    print(yaml.safe_dump(params.model_dump(mode="json", by_alias=True), sort_keys=False), end="")
    return 0


def cmd_demo_data(args: argparse.Namespace, params: Params) -> int:
    from features.demo import build_dataset

    cfg = params.demo
    start = time.perf_counter()
    dataset = build_dataset(cfg, Path(args.out), progress=_progress("demo-data"))
    seconds = time.perf_counter() - start
    n = len(dataset["images"])
    print(
        f"demo-data: wrote {n} images ({cfg.n_train} train / {cfg.n_val} val / {cfg.n_test} "
        f"test, {cfg.image_size}px) and {n * cfg.captions_per_image} captions to {args.out} "
        f"in {seconds:.1f} s ({n / seconds:.0f} img/s)"
    )
    return 0


def cmd_prepare(args: argparse.Namespace, params: Params) -> int:
    from features import ingest

    cfg = params.prepare
    annotations, images = Path(args.annotations), Path(args.images)
    if not images.is_dir():
        raise IngestError(f"{images}: images root is not a directory")
    dataset = ingest.READERS[cfg.format](annotations, images, cfg)
    records, report = ingest.validate(
        dataset, images, cfg.captions_per_image, progress=_progress("prepare")
    )
    summary = report.summary(ingest.split_counts(records))
    errors_path, metrics_path = Path(args.errors), Path(args.metrics)
    ingest.write_errors(report, errors_path)
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    counts = ", ".join(f"{k} {v}" for k, v in summary["counts"].items() if v) or "none"
    splits = ", ".join(f"{k} {v}" for k, v in summary["splits"].items())
    print(
        f"prepare: {dataset.name}: read {report.records_read} records, kept "
        f"{report.records_kept} ({splits}) with {report.captions_kept} captions\n"
        f"prepare: problems: {counts}\n"
        f"prepare: report: {errors_path} (every problem by key), {metrics_path} (counts)"
    )
    if report.error_fraction > cfg.max_error_fraction:
        raise IngestError(
            f"{report.records_with_errors} of {report.records_read} records "
            f"({report.error_fraction:.2%}) have errors, more than "
            f"prepare.max_error_fraction = {cfg.max_error_fraction:.2%}; see {errors_path}"
        )
    meta = ingest.write_manifest(records, dataset, cfg.captions_per_image, Path(args.out))
    print(f"prepare: wrote {args.out} (digest {meta['digest'][:12]})")
    return 0


def _storage_options(args: argparse.Namespace) -> dict | None:
    if not args.storage_options:
        return None
    try:
        return json.loads(args.storage_options)
    except json.JSONDecodeError as err:
        raise StoreError(f"--storage-options: not a JSON object ({err})") from None


def cmd_store_ls(args: argparse.Namespace, params: Params | None) -> int:
    from features.store import Store, find_stores

    rows = []
    for path in find_stores(args.root):
        store = Store.open(path, require_complete=False)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        state = (
            "complete"
            if store.committed.all()
            else "partial " + store.describe()["committed_shards"]
        )
        rows.append(
            (
                str(path),
                store.kind,
                str(len(store)),
                state,
                store.fingerprint[:12],
                f"{size / 2**20:.1f} MB",
            )
        )
    if not rows:
        print(f"no feature stores under {args.root}")
        return 0
    header = ("path", "kind", "samples", "state", "fingerprint", "size")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_store_info(args: argparse.Namespace, params: Params | None) -> int:
    from features.store import Store

    store = Store.open(args.url, require_complete=False, storage_options=_storage_options(args))
    info = store.describe()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(yaml.safe_dump(info, sort_keys=False), end="")
    return 0


def cmd_store_verify(args: argparse.Namespace, params: Params | None) -> int:
    from features.store import Store

    store = Store.open(args.url, require_complete=False, storage_options=_storage_options(args))
    problems = store.verify()
    for problem in problems:
        print(f"{args.url}: {problem}")
    if problems:
        print(f"verify: {len(problems)} problem(s) in {args.url}", file=sys.stderr)
        return 1
    print(f"verify: {args.url} is intact ({len(store)} samples, all shards committed)")
    return 0


def _named_paths(items: list[str], option: str) -> dict[str, str]:
    named = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise StoreError(f"{option} {item!r}: expected NAME=PATH, e.g. regions=data/x.zarr")
        named[name] = path
    return named


def cmd_shards_build(args: argparse.Namespace, params: Params) -> int:
    from features.ingest import read_manifest
    from features.shards import build_shards
    from features.store import Store

    manifest = read_manifest(Path(args.manifest))
    stores = {
        name: Store.open(path, manifest_digest=manifest.digest)
        for name, path in _named_paths(args.store, "--store").items()
    }
    text = (
        Store.open(args.text, kind="text", manifest_digest=manifest.digest) if args.text else None
    )
    scene_graphs = None
    if args.scenegraphs:
        import pyarrow.parquet as pq

        rows = pq.read_table(args.scenegraphs).to_pylist()
        scene_graphs = {r.pop("key"): {k: v for k, v in r.items() if k != "caption"} for r in rows}
    start = time.perf_counter()
    sizes = build_shards(
        manifest,
        stores,
        Path(args.out),
        params.shards.samples_per_shard,
        progress=_progress("shards", unit="block"),
        text=text,
        scene_graphs=scene_graphs,
    )
    seconds = time.perf_counter() - start
    total = sum(sizes.values())
    packed = ", ".join(stores) or "no feature stores"
    print(
        f"shards: {total} samples in {len(sizes)} shards ({packed}) to {args.out} "
        f"in {seconds:.1f} s ({total / max(seconds, 1e-9):.0f} samples/s)"
    )
    return 0


def cmd_import_precomp(args: argparse.Namespace, params: Params) -> int:
    from features.precomp import import_precomp

    manifest = import_precomp(
        Path(args.folder),
        args.splits,
        Path(args.manifest),
        Path(args.out),
        params.store,
        progress=_progress("import", unit="shard"),
    )
    print(f"import: {len(manifest)} images of {args.splits} -> {args.manifest} and {args.out}")
    return 0


def cmd_import_tsv(args: argparse.Namespace, params: Params) -> int:
    from features.ingest import read_manifest
    from features.precomp import import_butd_tsv

    manifest = read_manifest(Path(args.manifest))
    missing = import_butd_tsv(
        [Path(f) for f in args.tsv],
        manifest,
        Path(args.out),
        params.store,
        args.max_regions,
        progress=_progress("import", unit="shard"),
    )
    print(f"import: {len(manifest) - len(missing)} of {len(manifest)} images -> {args.out}")
    if missing:
        print(
            f"import: {len(missing)} manifest images have no TSV row (stored with 0 regions), "
            f"e.g. {', '.join(missing[:5])}"
        )
    return 0


def cmd_export_precomp(args: argparse.Namespace, params: Params | None) -> int:
    from features.ingest import read_manifest
    from features.precomp import export_precomp
    from features.store import Store

    manifest = read_manifest(Path(args.manifest))
    store = Store.open(args.store, kind="regions", manifest_digest=manifest.digest)
    path = export_precomp(store, manifest, args.split, Path(args.out), n_regions=args.regions)
    print(f"export: {args.split} -> {path} (+ captions and ids)")
    return 0


def _report_bad_images(
    store_path: Path, errors: Path, metrics: Path, n: int, limit: float, extra: dict
) -> None:
    """Errors CSV and metrics JSON of an extraction stage; too many errors fail it."""
    from features.extract import bad_images
    from features.ingest import Report, write_errors

    report = Report(records_read=n, records_kept=n)
    for key, (reason, detail) in sorted(bad_images(store_path).items()):
        report.error(key, reason, detail)
    write_errors(report, errors)
    counts: dict[str, int] = {}
    for issue in report.errors:
        counts[issue.reason] = counts.get(issue.reason, 0) + 1
    summary = {
        "images": n,
        "bad_images": len(report.errors),
        "error_fraction": round(report.error_fraction, 6),
        "counts": counts,
        **extra,
    }
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text(json.dumps(summary, indent=2) + "\n")
    listing = ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"
    print(f"extract: bad images: {listing} (report: {errors})")
    if report.error_fraction > limit:
        raise IngestError(
            f"{len(report.errors)} of {n} images ({report.error_fraction:.2%}) could not be "
            f"used, more than max_error_fraction = {limit:.2%}; see {errors}"
        )


def cmd_extract_images(args: argparse.Namespace, params: Params) -> int:
    import warnings

    from features.extract import build_image_extractor, extract_images
    from features.ingest import read_manifest

    manifest = read_manifest(Path(args.manifest))
    cfg = params.regions if args.command_name == "regions" else params.grid
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the random-init warning, every time
        extractor = build_image_extractor(args.command_name, cfg)
    device = extractor.device
    print(f"extract {args.command_name}: {extractor.name} on {device}, {len(manifest)} images")
    timing = extract_images(
        extractor,
        manifest,
        Path(args.images),
        Path(args.out),
        cfg,
        params.store,
        progress=lambda total: tqdm(
            total=total, desc=args.command_name, unit="img", mininterval=1.0, dynamic_ncols=True
        ),
    )
    print(f"extract {args.command_name}: {timing.summary()}")
    coverage = None
    if args.command_name == "regions":  # recall of ground-truth boxes, when there are some
        from features.extract import region_recall

        coverage = region_recall(Path(args.out), manifest)
        if coverage:
            c = coverage["all"]
            print(
                f"extract regions: {c['regions_per_image']:.2f} regions per image; "
                f"{c['gt_recall']:.1%} of {c['gt_boxes']} ground-truth boxes found (IoU >= 0.5)"
            )
    _report_bad_images(
        Path(args.out),
        Path(args.errors),
        Path(args.metrics),
        len(manifest),
        cfg.max_error_fraction,
        {
            "images_per_s": round(timing.images / max(timing.seconds, 1e-9), 2),
            "seconds": {
                "read": round(timing.read, 2),
                "infer": round(timing.infer, 2),
                "write": round(timing.write, 2),
            },
            **({"ground_truth": coverage} if coverage else {}),
        },
    )
    return 0


def cmd_extract_global(args: argparse.Namespace, params: Params) -> int:
    from features.extract import extract_global
    from features.ingest import read_manifest

    manifest = read_manifest(Path(args.manifest))
    store = extract_global(
        Path(args.grid), manifest, Path(args.out), params.global_.projection_dim, params.store
    )
    dims = ", ".join(f"{k} {v.shape}" for k, v in store.fields.items())
    print(f"extract global: {len(store)} images -> {args.out} ({dims})")
    return 0


def cmd_extract_text(args: argparse.Namespace, params: Params) -> int:
    from features.ingest import read_manifest
    from features.text import extract_text, load_bert_texts

    cfg = params.text
    manifest = read_manifest(Path(args.manifest))
    encoder, weights = load_bert_texts(cfg)
    device = encoder.device
    start = time.perf_counter()
    vocab = extract_text(
        manifest,
        encoder,
        cfg,
        weights,
        Path(args.out),
        params.store,
        progress=lambda total: tqdm(total=total, desc="text", unit="caption", mininterval=1.0),
    )
    Path(args.vocab).parent.mkdir(parents=True, exist_ok=True)
    Path(args.vocab).write_text(json.dumps(vocab) + "\n")
    seconds = time.perf_counter() - start
    n = sum(len(c) for c in manifest.table["captions"].to_pylist())
    print(
        f"extract text: {n} captions with {cfg.model} ({encoder.hidden}-d) on {device} in "
        f"{seconds:.1f} s ({n / seconds:.0f} captions/s); {len(vocab['words'])} words, "
        f"{len(vocab['tfidf_terms'])} TF-IDF terms -> {args.out}, {args.vocab}"
    )
    return 0


def cmd_demo_parser(args: argparse.Namespace, params: Params) -> int:
    from features import demo_parser

    dataset = json.loads(Path(args.dataset).read_text(encoding="utf-8"))
    start = time.perf_counter()
    nlp = demo_parser.train(dataset, params.parser)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    nlp.to_disk(args.out)
    scores = demo_parser.evaluate(nlp, dataset, "test")
    Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
    Path(args.metrics).write_text(json.dumps(scores, indent=2) + "\n")
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


def cmd_extract_scenegraph(args: argparse.Namespace, params: Params) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from features.ingest import read_manifest
    from features.scenegraph import load_spacy, negative_vocab, parse_captions
    from features.text import caption_rows

    cfg = params.scenegraph
    manifest = read_manifest(Path(args.manifest))
    try:
        nlp = load_spacy(cfg.spacy_model)
    except RuntimeError as err:
        raise IngestError(str(err)) from None
    keys, texts, splits = caption_rows(manifest)
    start = time.perf_counter()
    rows = parse_captions(
        nlp,
        keys,
        texts,
        cfg.batch_size,
        progress=lambda docs: tqdm(
            docs, total=len(texts), desc="scenegraph", unit="caption", mininterval=1.0
        ),
    )
    seconds = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.out)
    counts = {
        k: round(sum(len(r[k]) for r in rows) / max(len(rows), 1), 3)
        for k in ("objects", "attributes", "relations")
    }
    summary = {
        "captions": len(rows),
        "per_caption": counts,
        "captions_per_s": round(len(rows) / max(seconds, 1e-9), 1),
    }
    Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
    Path(args.metrics).write_text(json.dumps(summary, indent=2) + "\n")
    vocab = negative_vocab(rows, splits)
    Path(args.vocab).write_text(json.dumps(vocab, indent=1) + "\n")
    print(
        f"scenegraph: negative-sampling vocabularies (train): {len(vocab['nouns'])} nouns, "
        f"{len(vocab['adjectives'])} adjectives, {len(vocab['relations'])} relations "
        f"-> {args.vocab}"
    )
    print(
        f"scenegraph: {len(rows)} captions with {cfg.spacy_model} in {seconds:.1f} s; per "
        f"caption {counts['objects']} objects, {counts['attributes']} attributes, "
        f"{counts['relations']} relations -> {args.out}"
    )
    return 0


def cmd_flow(args: argparse.Namespace, params: Params | None) -> int:
    import os

    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.deploy import TRAINING_FLOWS
    from flows.pipeline import features_flow, pipeline_flow

    overrides = dict(item.split("=", 1) for item in args.set)
    flows = {"features": features_flow, "pipeline": pipeline_flow}
    flows.update({f"train-{name}": f for name, f in TRAINING_FLOWS.items()})
    run = flows[args.name]
    extra = {}
    if args.dask_workers or args.dask_address:
        if args.name != "features":
            raise ConfigError("--dask-workers/--dask-address apply to the features flow only")
        extra = {"dask_workers": args.dask_workers, "dask_address": args.dask_address}
    states = run(
        root=".",
        overrides=overrides or None,
        pull=args.pull,
        push=args.push,
        remote=args.remote,
        **extra,
    )
    print("flow: " + ", ".join(f"{stage} {state}" for stage, state in states.items()))
    return 0


def cmd_prefect_serve(args: argparse.Namespace, params: Params | None) -> int:
    from flows.deploy import serve

    serve(args.root, args.limit)
    return 0


def cmd_stats_sbert(args: argparse.Namespace, params: Params) -> int:
    import numpy as np

    from features.ingest import read_manifest
    from features.sbert_stats import caption_statistics, plot_histogram
    from features.text_models import resolve_model
    from features.visual import resolve_device

    cfg = params.sbert
    manifest = read_manifest(Path(args.manifest))
    folder = resolve_model(cfg.model)
    from sentence_transformers import SentenceTransformer

    device = resolve_device(cfg.device)
    model = SentenceTransformer(str(folder), device=str(device), local_files_only=True)

    def embed(captions: list[str]) -> np.ndarray:
        bar = tqdm(total=len(captions), desc="sbert", unit="caption", mininterval=1.0)
        parts = []
        for i in range(0, len(captions), cfg.batch_size):
            batch = captions[i : i + cfg.batch_size]
            parts.append(model.encode(batch, normalize_embeddings=True, convert_to_numpy=True))
            bar.update(len(batch))
        bar.close()
        return np.concatenate(parts)

    result = caption_statistics(manifest, embed, cfg)
    for path in (args.metrics, args.histogram, args.png, args.examples):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.metrics).write_text(json.dumps(result["metrics"], indent=2) + "\n")
    Path(args.histogram).write_text(json.dumps(result["histogram"], indent=1) + "\n")
    Path(args.examples).write_text(json.dumps(result["extremes"], indent=2) + "\n")
    plot_histogram(result["histogram"], args.png)
    for split, m in result["metrics"].items():
        print(
            f"sbert: {split}: {m['pairs']} pairs, mean {m.get('mean', 0):.3f}, median "
            f"{m.get('median', 0):.3f}, below 0: {m.get('fraction_below_0', 0):.1%}"
        )
    print(f"sbert: plot {args.png}, most/least consistent images {args.examples}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vse",
        description="Feature pipeline and store for visual-semantic embedding research.",
    )
    parser.add_argument(
        "--params", default="params.yaml", help="config file (default: %(default)s)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("params", help="validate params.yaml and print it with defaults")
    p.set_defaults(func=cmd_params)

    p = commands.add_parser(
        "demo-data",
        help="generate the synthetic demo dataset (params: demo)",
        description="Write images/*.png and a Karpathy-style dataset.json with labels, boxes, "
        "gold dependency trees and scene graphs.",
    )
    p.add_argument("--out", required=True, help="output folder, e.g. data/demo")
    p.set_defaults(func=cmd_demo_data)

    p = commands.add_parser(
        "demo-parser",
        help="train a spaCy tagger/parser/lemmatizer on the demo's gold trees (params: parser)",
        description="Trains on train-split captions, scores POS, UAS/LAS, lemmas and scene "
        "graphs on test-split captions, and saves the pipeline.",
    )
    p.add_argument("--dataset", required=True, help="demo dataset.json (with gold trees)")
    p.add_argument("--out", required=True, help="folder for the spaCy pipeline")
    p.add_argument("--metrics", required=True, help="JSON of held-out accuracies")
    p.set_defaults(func=cmd_demo_parser)

    p = commands.add_parser(
        "prepare",
        help="validate a raw dataset into the canonical manifest (params: prepare)",
        description="Read Karpathy JSON, UPMC Food-101 or the demo dataset, validate every "
        "record and write the manifest parquet, an errors CSV and a metrics JSON.",
    )
    p.add_argument(
        "--annotations",
        required=True,
        help="Karpathy/demo dataset JSON, or a Food-101 texts CSV or folder of CSVs",
    )
    p.add_argument("--images", required=True, help="images root; manifest paths are relative")
    p.add_argument("--out", required=True, help="manifest parquet to write")
    p.add_argument("--errors", required=True, help="CSV of every problem: key, reason, detail")
    p.add_argument("--metrics", required=True, help="JSON of counts (a DVC metrics file)")
    p.set_defaults(func=cmd_prepare)

    extract = commands.add_parser("extract", help="extract features into feature stores")
    extract_commands = extract.add_subparsers(
        dest="extract_command", required=True, metavar="COMMAND"
    )
    for name, text in (
        ("regions", "Faster R-CNN region features, bottom-up-attention style (params: regions)"),
        ("grid", "ResNet conv5 grid features and their pooled mean (params: grid)"),
    ):
        p = extract_commands.add_parser(name, help=text, description=text)
        p.add_argument("--manifest", required=True, help="manifest parquet (vse prepare)")
        p.add_argument("--images", required=True, help="images root of the manifest")
        p.add_argument("--out", required=True, help="store to write (resumed if partial)")
        p.add_argument("--errors", required=True, help="CSV of images that could not be used")
        p.add_argument("--metrics", required=True, help="JSON of counts and throughput")
        p.set_defaults(func=cmd_extract_images, command_name=name)
    p = extract_commands.add_parser(
        "text",
        help="BERT token and HUSE document features, word and TF-IDF vocabularies (params: text)",
        description="A caption-level store: last-layer token features, WordPiece ids, HUSE "
        "document features, word ids and sparse TF-IDF, with vocabularies fitted on train.",
    )
    p.add_argument("--manifest", required=True, help="manifest parquet")
    p.add_argument("--out", required=True, help="text store to write (resumed if partial)")
    p.add_argument("--vocab", required=True, help="JSON of the word and TF-IDF vocabularies")
    p.set_defaults(func=cmd_extract_text)
    p = extract_commands.add_parser(
        "scenegraph",
        help="scene graphs of every caption from a spaCy parse (params: scenegraph)",
        description="Objects, attribute-object pairs and relation triples per caption, by "
        "rules over a dependency parse (Schuster et al. 2015), to parquet.",
    )
    p.add_argument("--manifest", required=True, help="manifest parquet")
    p.add_argument("--out", required=True, help="parquet of scene graphs, one row per caption")
    p.add_argument("--metrics", required=True, help="JSON of counts")
    p.add_argument(
        "--vocab",
        required=True,
        help="JSON of UniVSE negative-sampling vocabularies (train nouns, "
        "adjectives, relations with counts)",
    )
    p.set_defaults(func=cmd_extract_scenegraph)
    p = extract_commands.add_parser(
        "global", help="global pooled features + PCA projection fitted on train (params: global)"
    )
    p.add_argument("--grid", required=True, help="grid store (vse extract grid)")
    p.add_argument("--manifest", required=True, help="manifest parquet")
    p.add_argument("--out", required=True, help="global store to write")
    p.set_defaults(func=cmd_extract_global)

    model_cli.add_commands(commands, extract_commands)

    p = commands.add_parser(
        "flow",
        help="run DVC stages as a Prefect flow (one task per stage, DVC's lock and cache)",
        description="features: every feature stage and what it needs; pipeline: the whole "
        "DAG; train-MODEL: one model's training and evaluation. With -S, the run is one DVC "
        "experiment with those params overridden.",
    )
    p.add_argument(
        "name",
        choices=["features", "pipeline", *(f"train-{m}" for m in model_cli.MODEL_NAMES)],
        help="train-MODEL: that model's train@ and evaluate@ stages and what they need",
    )
    p.add_argument(
        "-S",
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a params.yaml key for this run (a DVC experiment)",
    )
    p.add_argument("--pull", action="store_true", help="dvc pull before running")
    p.add_argument("--push", action="store_true", help="dvc push --run-cache after running")
    p.add_argument("--remote", help="DVC remote for --pull/--push (default: the default one)")
    p.add_argument(
        "--dask-workers",
        type=int,
        default=0,
        help="features: fill the image stores over a local Dask cluster of N processes",
    )
    p.add_argument(
        "--dask-address", help="features: ... or over a running Dask scheduler (tcp://host:8786)"
    )
    p.set_defaults(func=cmd_flow, needs_params=False)

    prefect_cmd = commands.add_parser("prefect", help="Prefect deployments of the flows")
    prefect_commands = prefect_cmd.add_subparsers(
        dest="prefect_command", required=True, metavar="COMMAND"
    )
    p = prefect_commands.add_parser(
        "serve",
        help="serve features, pipeline and train-MODEL as deployments <flow>/default",
        description="Registers every flow with the Prefect API (PREFECT_API_URL) and runs "
        "the flow runs it is asked for, e.g. `prefect deployment run train-mvvse/default "
        "-p overrides='{\"models.mvvse.lambda_\": 0.5}' --watch`. Stop with Ctrl-C.",
    )
    p.add_argument("--root", default=".", help="repository root the flows run in")
    p.add_argument("--limit", type=int, default=1, help="flow runs at a time (default 1)")
    p.set_defaults(func=cmd_prefect_serve, needs_params=False)

    stats = commands.add_parser("stats", help="dataset statistics")
    stats_commands = stats.add_subparsers(dest="stats_command", required=True, metavar="COMMAND")
    p = stats_commands.add_parser(
        "sbert",
        help="Sentence-BERT similarity of captions of the same image (params: sbert)",
        description="Per image, the cosine similarity of every pair of its captions (MV-VSE "
        "Fig. 2): metrics per split, a histogram (DVC plot and PNG), extreme images.",
    )
    p.add_argument("--manifest", required=True, help="manifest parquet")
    p.add_argument("--metrics", required=True, help="JSON of summary metrics per split")
    p.add_argument("--histogram", required=True, help="JSON histogram (a DVC plot)")
    p.add_argument("--png", required=True, help="PNG of the histogram")
    p.add_argument("--examples", required=True, help="JSON of most/least consistent images")
    p.set_defaults(func=cmd_stats_sbert)

    shards = commands.add_parser("shards", help="WebDataset training shards")
    shards_commands = shards.add_subparsers(dest="shards_command", required=True, metavar="COMMAND")
    p = shards_commands.add_parser(
        "build",
        help="pack per-split training samples into tar shards (params: shards)",
        description="Pack captions, labels, ground-truth boxes and the fields of the given "
        "stores into {split}-NNNNNN.tar shards with a sizes.json.",
    )
    p.add_argument("--manifest", required=True, help="manifest parquet (vse prepare)")
    p.add_argument("--out", required=True, help="output folder of the shards")
    p.add_argument(
        "--store",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a feature store to pack, e.g. regions=data/features/regions.zarr (repeatable)",
    )
    p.add_argument("--text", help="caption-level text store: pack its token ids per caption")
    p.add_argument("--scenegraphs", help="scene-graph parquet: pack each caption's graph")
    p.set_defaults(func=cmd_shards_build)

    store = commands.add_parser(
        "store",
        help="list, inspect and verify feature stores",
        description="Feature stores are Zarr v3 groups (*.zarr), local or at an fsspec URL.",
    )
    store_commands = store.add_subparsers(dest="store_command", required=True, metavar="COMMAND")
    p = store_commands.add_parser("ls", help="list the stores under a folder")
    p.add_argument("root", nargs="?", default="data", help="folder to search (default: data)")
    p.set_defaults(func=cmd_store_ls, needs_params=False)
    for name, func, text in (
        ("info", cmd_store_info, "show how a store was made: kind, fingerprint, inputs, layout"),
        ("verify", cmd_store_verify, "recompute checksums; name every corrupt or missing shard"),
    ):
        p = store_commands.add_parser(name, help=text, description=text)
        p.add_argument(
            "url", help="store path or URL, e.g. data/features/regions.zarr or s3://b/r.zarr"
        )
        p.add_argument(
            "--storage-options",
            help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
        )
        if name == "info":
            p.add_argument("--json", action="store_true", help="print JSON instead of YAML")
        p.set_defaults(func=func, needs_params=False)

    p = store_commands.add_parser(
        "import-precomp",
        help="import a SCAN/VSE++ precomp folder as a manifest + regions store (params: store)",
        description="Reads {split}_ims.npy, {split}_caps.txt and {split}_ids.txt if present.",
    )
    p.add_argument("folder", help="precomp folder, e.g. data/f30k_precomp")
    p.add_argument(
        "--splits",
        nargs="+",
        default=["train", "dev", "test"],
        help="precomp split names (dev -> val, testall -> test)",
    )
    p.add_argument("--manifest", required=True, help="manifest parquet to write")
    p.add_argument("--out", required=True, help="regions store to write")
    p.set_defaults(func=cmd_import_precomp)

    p = store_commands.add_parser(
        "import-tsv",
        help="import bottom-up-attention TSV features for a manifest's images (params: store)",
    )
    p.add_argument(
        "tsv", nargs="+", help="TSV files (image_id, image_w, image_h, num_boxes, boxes, features)"
    )
    p.add_argument("--manifest", required=True, help="manifest the store is aligned with")
    p.add_argument("--out", required=True, help="regions store to write")
    p.add_argument("--max-regions", type=int, default=36, help="regions kept per image")
    p.set_defaults(func=cmd_import_tsv)

    p = store_commands.add_parser(
        "export-precomp", help="export one split of a regions store to the precomp layout"
    )
    p.add_argument("store", help="regions store")
    p.add_argument("--manifest", required=True, help="the manifest the store was built from")
    p.add_argument("--split", required=True, choices=["train", "val", "test"])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--regions", type=int, default=36, help="regions per image (pad or cut)")
    p.set_defaults(func=cmd_export_precomp, needs_params=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = None
        if getattr(args, "needs_params", True):
            from flows.params import load_params

            params = load_params(args.params)
        return args.func(args, params)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (IngestError, StoreError, TextModelError, UserError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
