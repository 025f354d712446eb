"""``vse extract regions | grid`` (stages ``regions``, ``grid``): image feature stores.

With ``--dask-workers N`` or ``--dask-address tcp://...`` (or the environment variables
``VSE_DASK_WORKERS`` / ``VSE_DASK_ADDRESS``, which the ``features`` flow sets) the store's
shards are extracted over a Dask cluster (:mod:`flows.distributed`); the store is
byte-identical to a one-process run's, so the choice is not a DVC param.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from flows.commands import command, path_in, path_out, progress
from infra.config import UserError
from infra.files import location

DASK_WORKERS, DASK_ADDRESS = "VSE_DASK_WORKERS", "VSE_DASK_ADDRESS"


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet (vse prepare)")
    path_in(p, "--images", required=True, help="images root of the manifest")
    path_in(
        p,
        "--weights",
        help="checkpoint to load, in place of the stage's `weights` param (the demo's "
        "dvc.yaml passes the detector stage's, so the DAG holds that edge)",
    )
    path_out(p, "--out", help="store to write (a killed run, rerun, resumes)")
    path_out(p, "--errors", help="CSV of images that could not be used")
    path_out(p, "--metrics", help="JSON of counts (a DVC metrics file)")
    p.add_argument(
        "--dask-workers",
        type=int,
        help=f"extract over a local Dask cluster of N processes (default: ${DASK_WORKERS})",
    )
    p.add_argument(
        "--dask-address",
        help=f"... or over a running Dask scheduler, tcp://host:8786 (default: ${DASK_ADDRESS})",
    )


def dask_settings(args) -> tuple[int, str | None]:
    """Workers and address from the flags, else from the environment."""
    workers = args.dask_workers
    if workers is None:
        value = os.environ.get(DASK_WORKERS, "").strip() or "0"
        if not value.isdigit():
            raise UserError(f"{DASK_WORKERS}={value!r}: expected a number of Dask workers")
        workers = int(value)
    if workers < 0:
        raise UserError(f"--dask-workers {workers}: expected 0 (no Dask) or more")
    address = args.dask_address or os.environ.get(DASK_ADDRESS, "").strip() or None
    if workers and address:
        raise UserError("give Dask workers (a local cluster) or an address, not both")
    return workers, address


def run(args, params) -> None:
    from features.images.extract import build_image_extractor, extract_images
    from features.images.report import region_recall, report_bad_images
    from features.ingest.manifest import read_manifest

    stage = args.stage
    cfg = getattr(params, stage)
    if args.weights:
        cfg = cfg.model_copy(update={"weights": args.weights})
    out = location(args.out)  # a store on S3 is written there
    workers, address = dask_settings(args)
    if workers or address:
        from flows.distributed import ExtractJob, run_distributed

        job = ExtractJob.make(stage, args.manifest, args.images, out, cfg, params.store)
        summary = run_distributed(job, workers, address)
        print(f"extract {stage}: over Dask: {summary}")
    else:
        manifest = read_manifest(Path(args.manifest))
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # the random-init warning, every time
            extractor = build_image_extractor(stage, cfg)
        print(f"extract {stage}: {extractor.name} on {extractor.device}, {len(manifest)} images")
        timing = extract_images(
            extractor,
            manifest,
            Path(args.images),
            out,
            cfg,
            params.store,
            progress=progress(stage),
        )
        print(f"extract {stage}: {timing.summary()}")
    coverage = None
    if stage == "regions":  # recall of ground-truth boxes, when the manifest has some
        coverage = region_recall(out, read_manifest(Path(args.manifest)))
        if coverage:
            c = coverage["all"]
            print(
                f"extract regions: {c['regions_per_image']:.2f} regions per image; "
                f"{c['gt_recall']:.1%} of {c['gt_boxes']} ground-truth boxes found (IoU >= 0.5)"
            )
    extra = {"ground_truth": coverage} if coverage else None
    report_bad_images(out, Path(args.errors), Path(args.metrics), cfg.max_error_fraction, extra)


for stage, text in (
    ("regions", "Faster R-CNN region features, bottom-up-attention style (params: regions)"),
    ("grid", "ResNet conv5 grid features and their pooled mean (params: grid)"),
):
    command(
        f"extract {stage}",
        help=text,
        description=text,
        arguments=lambda p, stage=stage: (arguments(p), p.set_defaults(stage=stage)),
        sections=(stage, "store"),
    )(run)
