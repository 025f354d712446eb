"""``vse train``, ``vse evaluate``, ``vse report`` and ``vse extract adversarial``: thin
entry points over ``models/`` (torch is imported only when one of them runs)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flows.params import Params

MODEL_NAMES = ("vsepp", "mvvse", "camera", "huse", "univse")


def _paths(args: argparse.Namespace):
    from models.data import FeaturePaths

    def path(value):
        return Path(value) if value else None

    return FeaturePaths(
        manifest=Path(args.manifest),
        global_=path(args.global_),
        regions=path(args.regions),
        grid=path(args.grid),
        text=path(args.text),
        vocab=path(args.vocab),
        scenegraphs=path(args.scenegraphs),
        negatives=path(args.negatives),
    )


def _class_embedder(params: Params):
    """Sentence-BERT embeddings of class names (HUSE's semantic graph), offline."""

    def embed(names: list[str]):
        from sentence_transformers import SentenceTransformer

        from features.text_models import resolve_model

        model = SentenceTransformer(str(resolve_model(params.sbert.model)), device="cpu")
        return model.encode(names, convert_to_numpy=True)

    return embed


def _model_section(params: Params, name: str) -> dict:
    return getattr(params.models, name).model_dump()


def cmd_train(args: argparse.Namespace, params: Params) -> int:
    from models import model_inputs
    from models.data import PairData
    from models.train import train, write_history

    config = _model_section(params, args.model)
    inputs = model_inputs(args.model, config)
    paths = _paths(args)
    embedder = _class_embedder(params) if "labels" in inputs else None
    start = time.perf_counter()
    train_data = PairData(paths, "train", inputs, class_embedder=embedder)
    val_data = PairData(paths, "val", inputs)
    print(
        f"train {args.model}: {len(train_data)} train captions ({train_data.n_images} images), "
        f"{len(val_data)} val captions; inputs {', '.join(sorted(inputs))}"
    )
    glove = config.get("glove")

    def prepare(model):
        if glove and hasattr(model, "init_basic_embeddings"):
            from models.univse import load_glove

            words = list(train_data.word_index)
            model.init_basic_embeddings(load_glove(Path(glove), words))
            print(f"train {args.model}: word embeddings initialised from {glove}")

    metrics, plot = Path(args.metrics), Path(args.plots)
    result = train(
        args.model,
        config,
        params.train,
        train_data,
        val_data,
        Path(args.out),
        resume=args.resume,
        on_epoch=lambda history: write_history(history, metrics, plot),
        prepare_model=prepare,
    )
    print(
        f"train {args.model}: best val rsum {result['best_rsum']:.1f} after "
        f"{len(result['history'])} epochs in {time.perf_counter() - start:.0f} s -> {args.out}"
    )
    return 0


def cmd_evaluate(args: argparse.Namespace, params: Params) -> int:
    from models import model_inputs
    from models.data import PairData
    from models.evaluate import evaluate_model
    from models.train import load_checkpoint, resolve_device

    cfg = params.evaluate
    device = resolve_device(cfg.device)
    model, info = load_checkpoint(args.checkpoint, device)
    inputs = model_inputs(args.model, model.cfg.model_dump())
    data = PairData(_paths(args), cfg.split, inputs)
    if info.feature_stats:
        data.standardize(info.feature_stats)
    adversarial = None
    if args.adversarial_captions:
        adversarial = data.with_adversarial(
            Path(args.adversarial) if args.adversarial else None, Path(args.adversarial_captions)
        )
    start = time.perf_counter()
    report = evaluate_model(model, data, cfg, device, adversarial)
    report["model"] = args.model
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    full = report["full"]
    adv = report.get("adversarial", {})
    attacked = ", ".join(f"{a} {m['i2t_r1']:.1f}" for a, m in adv.items())
    print(
        f"evaluate {args.model} on {cfg.split} ({data.n_images} images, {len(data)} captions) "
        f"in {time.perf_counter() - start:.1f} s: i2t R@1/5/10 {full['i2t_r1']:.1f}/"
        f"{full['i2t_r5']:.1f}/{full['i2t_r10']:.1f}, t2i {full['t2i_r1']:.1f}/"
        f"{full['t2i_r5']:.1f}/{full['t2i_r10']:.1f}, rsum {full['rsum']:.1f}"
        + (f"; with adversarial captions i2t R@1: {attacked}" if attacked else "")
        + f" -> {out}"
    )
    return 0


def cmd_report(args: argparse.Namespace, params: Params) -> int:
    from models.report import markdown_table, plot_rsum

    results = {}
    for path in map(Path, args.results):
        if not path.exists():
            raise FileNotFoundError(f"{path}: no evaluation results; run `vse evaluate` first")
        result = json.loads(path.read_text())
        results[result["model"]] = result
    splits = {r["split"] for r in results.values()}
    if len(splits) > 1:
        raise ValueError(f"results come from different splits ({sorted(splits)}): not comparable")
    table = markdown_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# Model comparison\n\n" + table + f"\n![rsum per model]({args.plot})\n")
    plot_rsum(results, Path(args.plot))
    print(table)
    print(f"report -> {out}, {args.plot}")
    return 0


def cmd_extract_adversarial(args: argparse.Namespace, params: Params) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from features.adversarial import adversarial_captions
    from features.ingest import read_manifest
    from features.text import load_bert_texts, write_text_store

    cfg = params.adversarial
    manifest = read_manifest(Path(args.manifest))
    table = manifest.table.to_pylist()
    image_of = {f"{r['key']}#{i}": r["key"] for r in table for i in range(len(r["captions"]))}
    split_of = {r["key"]: r["split"] for r in table}
    graphs = pq.read_table(args.scenegraphs).to_pylist()
    rows = [g for g in graphs if split_of.get(image_of.get(g["key"])) in cfg.splits]
    vocab = json.loads(Path(args.negatives).read_text())
    fakes = adversarial_captions(rows, [image_of[g["key"]] for g in rows], vocab, cfg)
    Path(args.captions).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(fakes), args.captions)

    text_cfg = params.text
    encoder, weights = load_bert_texts(text_cfg)
    start = time.perf_counter()
    write_text_store(
        [f["key"] for f in fakes],
        [f["caption"] for f in fakes],
        json.loads(Path(args.vocab).read_text()),
        encoder,
        text_cfg,
        weights,
        manifest.digest,
        Path(args.out),
        params.store,
        kind="adversarial",
        progress=lambda total: tqdm(total=total, desc="adversarial", unit="caption", mininterval=1),
    )
    counts = {a: sum(f["attack"] == a for f in fakes) for a in ("object", "attribute", "relation")}
    print(
        f"adversarial: {len(fakes)} fake captions for {len(rows)} captions of "
        f"{', '.join(cfg.splits)} ({counts}) encoded in {time.perf_counter() - start:.0f} s "
        f"-> {args.captions}, {args.out}"
    )
    return 0


def cmd_train_detector(args: argparse.Namespace, params: Params) -> int:
    """``vse train-detector``: the bottom-up detector (temporary entry point, to become
    ``vse train detector``). One of --manifest (boxes in the manifest: the demo), --coco
    (COCO instances JSON, optional --coco-val) or --vg-objects (Visual Genome, optional
    --vg-attributes) gives the boxes."""
    from tqdm import tqdm

    from features import detection_data as dd
    from features.detector_train import plot_ap, train_detector, write_metrics
    from features.ingest import read_manifest

    cfg = params.detector
    images = Path(args.images)
    if args.manifest:
        dataset = dd.read_manifest_boxes(read_manifest(Path(args.manifest)), cfg)
    elif args.coco:
        dataset = dd.read_coco(Path(args.coco), Path(args.coco_val) if args.coco_val else None, cfg)
    else:
        attributes = Path(args.vg_attributes) if args.vg_attributes else None
        dataset = dd.read_visual_genome(Path(args.vg_objects), attributes, cfg, images)
    summary = dataset.summary()
    print(f"train detector: {json.dumps(summary)}")
    start = time.perf_counter()
    metrics = train_detector(
        dataset,
        images,
        cfg,
        Path(args.out),
        resume=args.resume,
        log=print,
        progress=lambda total: tqdm(
            total=total, desc="detector", unit="img", mininterval=1.0, dynamic_ncols=True
        ),
    )
    write_metrics(metrics, Path(args.metrics))
    plot_ap(metrics, Path(args.plot))
    attr = metrics.get("attribute_accuracy")
    print(
        f"train detector: mAP@0.5 {metrics['map50']:.3f}, recall {metrics['recall']:.3f} "
        f"(proposals {metrics['proposal_recall']:.3f}), class accuracy "
        f"{metrics['class_accuracy']:.3f}"
        + (f", attribute accuracy {attr:.3f}" if attr is not None else "")
        + f" on {metrics['val_images']} val images; {time.perf_counter() - start:.0f} s -> "
        f"{args.out}, {args.metrics}, {args.plot}"
    )
    return 0


def _feature_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True, help="manifest parquet (vse prepare)")
    p.add_argument("--global", dest="global_", help="global image store (vse extract global)")
    p.add_argument("--regions", help="region store (vse extract regions)")
    p.add_argument("--grid", help="grid store (vse extract grid)")
    p.add_argument("--text", help="caption-level text store (vse extract text)")
    p.add_argument("--vocab", help="word and TF-IDF vocabularies (vse extract text)")
    p.add_argument("--scenegraphs", help="scene-graph parquet (vse extract scenegraph)")
    p.add_argument("--negatives", help="negative-sampling vocabularies (vse extract scenegraph)")


def add_commands(commands, extract_commands) -> None:
    """Register train, evaluate, report and extract adversarial on the ``vse`` parser."""
    p = commands.add_parser(
        "train",
        help="train one model from the feature stores (params: train, models.MODEL)",
        description="Reads only the stores the model needs; checkpoints every epoch "
        "(last.pt, resumable with --resume) and keeps the best on validation rsum (best.pt). "
        "Under torchrun it trains with DDP.",
    )
    p.add_argument("model", choices=MODEL_NAMES)
    _feature_args(p)
    p.add_argument("--out", required=True, help="folder for last.pt and best.pt")
    p.add_argument("--metrics", required=True, help="JSON of the last and best epochs")
    p.add_argument("--plots", required=True, help="JSON rows per epoch (a DVC plot)")
    p.add_argument(
        "--resume", action="store_true", help="continue from OUT/last.pt (same params and data)"
    )
    p.set_defaults(func=cmd_train)

    p = commands.add_parser(
        "train-detector",
        help="train the bottom-up detector: Faster R-CNN + attribute head (params: detector)",
        description="Trains on the train split, reports mAP@0.5, recall and attribute "
        "accuracy on val (metrics, per-class AP plot), writes OUT/detector.pt for "
        "regions.weights and grid.weights; OUT/last.pt every epoch (--resume).",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifest", help="manifest with boxes (the demo)")
    source.add_argument("--coco", help="COCO instances JSON (train)")
    source.add_argument("--vg-objects", help="Visual Genome objects.json")
    p.add_argument("--coco-val", help="COCO instances JSON (val); else a hold-out of train")
    p.add_argument("--vg-attributes", help="Visual Genome attributes.json")
    p.add_argument("--images", required=True, help="images root")
    p.add_argument("--out", required=True, help="folder for detector.pt and last.pt")
    p.add_argument("--metrics", required=True, help="JSON of the val metrics (DVC metrics)")
    p.add_argument("--plot", required=True, help="PNG of the per-class AP")
    p.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    p.set_defaults(func=cmd_train_detector)

    p = commands.add_parser(
        "evaluate",
        help="retrieval metrics of a trained model (params: evaluate)",
        description="R@1/5/10, medr, meanr and rsum both ways on the whole split, COCO-1K "
        "style folds when the split has two or more, robustness to adversarial captions, "
        "and classification metrics for models that classify.",
    )
    p.add_argument("model", choices=MODEL_NAMES)
    p.add_argument("--checkpoint", required=True, help="best.pt written by vse train")
    _feature_args(p)
    p.add_argument("--adversarial", help="text store of the adversarial captions")
    p.add_argument("--adversarial-captions", help="parquet of the adversarial captions")
    p.add_argument("--out", required=True, help="JSON of the metrics (a DVC metrics file)")
    p.set_defaults(func=cmd_evaluate)

    p = commands.add_parser(
        "report",
        help="one table of all models on the same split, with the papers' numbers",
    )
    p.add_argument("results", nargs="+", help="evaluation JSON files (vse evaluate --out)")
    p.add_argument("--out", required=True, help="markdown report to write")
    p.add_argument("--plot", required=True, help="PNG bar plot to write")
    p.set_defaults(func=cmd_report)

    p = extract_commands.add_parser(
        "adversarial",
        help="text-domain adversarial captions and their text features (params: adversarial)",
        description="UniVSE 4.2: object, attribute and relation attacks made by editing each "
        "caption's scene graph; encoded with the text stage's model and vocabularies.",
    )
    p.add_argument("--manifest", required=True, help="manifest parquet")
    p.add_argument("--scenegraphs", required=True, help="scene-graph parquet")
    p.add_argument("--negatives", required=True, help="negative-sampling vocabularies JSON")
    p.add_argument("--vocab", required=True, help="text vocabularies (vse extract text)")
    p.add_argument("--captions", required=True, help="parquet of the fake captions to write")
    p.add_argument("--out", required=True, help="text store of the fake captions to write")
    p.set_defaults(func=cmd_extract_adversarial)
