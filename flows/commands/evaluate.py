"""``vse evaluate MODEL`` (stage ``evaluate@MODEL``): retrieval metrics of a checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

from flows.commands import command, path_in, path_out
from flows.commands.train import feature_arguments, feature_paths, store_location
from models.registry import MODEL_NAMES


def evaluate_arguments(p) -> None:
    p.add_argument("model", choices=MODEL_NAMES)
    p.add_argument(
        "--name",
        help="the results' row in the report (default: the model), e.g. a run of models.ablations",
    )
    path_in(p, "--checkpoint", required=True, help="best.pt written by vse train")
    feature_arguments(p)
    path_in(p, "--adversarial", help="text store of the adversarial captions")
    path_in(p, "--adversarial-captions", help="parquet of the adversarial captions")
    path_out(p, "--out", help="JSON of the metrics (a DVC metrics file)")
    path_out(
        p,
        "--gallery",
        required=False,
        help="JSON of what the model retrieves for a few queries (vse report draws it)",
    )


@command(
    "evaluate",
    help="retrieval metrics of a trained model (params: evaluate)",
    description="R@1/5/10, medr, meanr and rsum both ways on the whole split, COCO-1K "
    "style folds when the split has two or more, robustness to adversarial captions, "
    "and classification metrics for models that classify.",
    arguments=evaluate_arguments,
    sections=("evaluate",),
)
def run_evaluate(args, params) -> None:
    """The checkpoint's model on ``evaluate.split`` (standardised with the train statistics
    it was trained with): metrics JSON, and the gallery's data when asked."""
    from infra.device import resolve_device
    from infra.files import write_json
    from models.data.pairs import PairData
    from models.evaluate import embed, evaluate_model
    from models.registry import model_inputs, model_stores
    from models.train import load_checkpoint

    start = time.perf_counter()
    cfg = params.evaluate
    device = resolve_device(cfg.device)
    model, info = load_checkpoint(Path(args.checkpoint), device)
    data = PairData(feature_paths(args), cfg.split, model_inputs(args.model, model.cfg))
    if info.feature_stats:
        data.standardize(info.feature_stats)
    adversarial = None
    if args.adversarial_captions:
        store = store_location(args.adversarial)
        adversarial = data.with_adversarial(store, Path(args.adversarial_captions))
    embeddings = embed(model, data, cfg, device)
    kind = model_stores(args.model)[0]  # its image store: --global/--graph_rise, --regions, --grid
    image_store = getattr(args, "global_" if kind == "global" else kind)
    report = {
        "model": args.model,
        "name": args.name or args.model,
        "image_store": image_store.rstrip("/").rsplit("/", 1)[-1],
        **evaluate_model(model, data, cfg, device, adversarial, embeddings=embeddings),
    }
    write_json(Path(args.out), report)
    if args.gallery:
        from models.report.gallery import gallery_data

        gallery = gallery_data(model, data, *embeddings, device)
        write_json(Path(args.gallery), {"model": args.model, **gallery})
    full, folds = report["full"], report.get("folds")
    attacked = ", ".join(f"{a} {m['i2t_r1']:.1f}" for a, m in report.get("adversarial", {}).items())
    print(
        f"evaluate {report['name']} on {report['split']} ({report['images']} images, "
        f"{report['captions']} captions) in {time.perf_counter() - start:.1f} s: i2t R@1/5/10 "
        f"{full['i2t_r1']:.1f}/{full['i2t_r5']:.1f}/{full['i2t_r10']:.1f}, t2i "
        f"{full['t2i_r1']:.1f}/{full['t2i_r5']:.1f}/{full['t2i_r10']:.1f}, rsum {full['rsum']:.1f}"
        + (f"; with adversarial captions i2t R@1: {attacked}" if attacked else "")
        + (
            f"; {folds['n_folds']} folds of {folds['fold_size']} images rsum {folds['rsum']:.1f} "
            f"({folds['left_out']} images left out)"
            if folds
            else ""
        )
        + f" -> {args.out}"
    )
