"""``vse train MODEL`` (stage ``train@MODEL``): one model trained from the feature stores,
and the store arguments that ``vse evaluate`` shares."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from flows.commands import command, path_in, path_out
from infra.files import location
from models.registry import MODEL_NAMES


def feature_arguments(p) -> None:
    """The stores and files a model may read; each model reads only what it needs. A store
    may be an fsspec URL (``s3://bucket/regions.zarr``, credentials and endpoint from the
    environment: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``)."""
    path_in(p, "--manifest", required=True, help="manifest parquet (vse prepare)")
    path_in(p, "--global", dest="global_", help="global image store (vse extract global)")
    path_in(
        p,
        "--graph_rise",
        dest="global_",
        help="... or the Graph-RISE embedding store in its place (vse train graph-rise)",
    )
    path_in(p, "--regions", help="region store (vse extract regions)")
    path_in(p, "--grid", help="grid store (vse extract grid)")
    path_in(p, "--text", help="caption-level text store (vse extract text)")
    path_in(p, "--vocab", help="word and TF-IDF vocabularies (vse extract text)")
    path_in(
        p,
        "--scenegraphs",
        help="scene graphs and negative vocabularies folder (vse extract scenegraph)",
    )


def feature_paths(args):
    """The :class:`models.data.info.FeaturePaths` of :func:`feature_arguments`' paths; the
    stores given as URLs stay ``str``."""
    from models.data.info import FeaturePaths

    stores = {k: store_location(getattr(args, k)) for k in ("global_", "regions", "grid", "text")}
    files = {
        k: Path(getattr(args, k)) if getattr(args, k) else None for k in ("vocab", "scenegraphs")
    }
    return FeaturePaths(manifest=Path(args.manifest), **stores, **files)


def store_location(value: str | None) -> Path | str | None:
    """A store argument (:func:`infra.files.location`), or None if not given."""
    return location(value) if value else None


def train_arguments(p) -> None:
    feature_arguments(p)
    path_out(p, "--out", help="folder for last.pt and best.pt")
    path_out(p, "--metrics", help="JSON of the last and best epochs")
    path_out(p, "--plots", help="JSON rows per epoch (a DVC plot)")
    p.add_argument(
        "--resume", action="store_true", help="continue from OUT/last.pt (same params and data)"
    )


def run_train(args, params) -> None:
    from models.train import train_stage

    start = time.perf_counter()
    resume, aside = args.resume, os.environ.get("VSE_TRAIN_RESUME_FROM")
    if not resume and aside and Path(aside).is_file():  # a rerun flow of a preempted run
        Path(args.out).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(aside, Path(args.out) / "last.pt")  # dvc repro removed the outputs
        print(f"train {args.model}: resuming the preempted run ({aside})")
        resume = True
    result = train_stage(
        args.model,
        getattr(params.models, args.model),
        params.train.for_model(args.model),
        params.sbert,
        feature_paths(args),
        Path(args.out),
        Path(args.metrics),
        Path(args.plots),
        resume=resume,
    )
    print(
        f"train {args.model}: best val rsum {result['best_rsum']:.1f} after "
        f"{len(result['history'])} epochs in {time.perf_counter() - start:.0f} s -> {args.out}"
    )


for model in MODEL_NAMES:
    command(
        f"train {model}",
        help=f"train {model} from the feature stores (params: train, models.{model})",
        description="Reads only the stores the model needs; checkpoints every epoch "
        "(last.pt, resumable with --resume) and keeps the best on validation rsum (best.pt). "
        "Under torchrun it trains with DDP.",
        arguments=lambda p, model=model: (train_arguments(p), p.set_defaults(model=model)),
        sections=("train", "models", "sbert"),
    )(run_train)
