"""``vse train detector`` (stage ``detector``): the bottom-up detector, Faster R-CNN with
an attribute head (Anderson et al. 2018), whose checkpoint ``regions`` and ``grid`` load;
the box readers are in :mod:`features.detector.data`, training in :mod:`features.detector.train`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def arguments(p) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    path_in(source, "--manifest", help="manifest with boxes and box names (the demo)")
    path_in(source, "--coco", help="COCO instances JSON (train)")
    path_in(source, "--vg-objects", help="Visual Genome objects.json")
    path_in(p, "--coco-val", help="COCO instances JSON (val); else a hold-out of train")
    path_in(p, "--vg-attributes", help="Visual Genome attributes.json")
    path_in(p, "--images", required=True, help="images root")
    path_out(p, "--out", help="folder for detector.pt (the weights) and last.pt (resume)")
    path_out(p, "--metrics", help="JSON of the val metrics (a DVC metrics file)")
    path_out(p, "--plot", help="PNG of the per-class AP on val")
    p.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")


@command(
    "train detector",
    help="train the bottom-up detector: Faster R-CNN + attribute head (params: detector)",
    description="Trains on the train split, reports mAP@0.5, recall and attribute "
    "accuracy on val (metrics, per-class AP plot), writes OUT/detector.pt for "
    "regions.weights and grid.weights; OUT/last.pt every epoch (--resume).",
    arguments=arguments,
    sections=("detector",),
)
def run(args, params) -> None:
    from features.detector import data as dd
    from features.detector.metrics import plot_ap, write_metrics
    from features.detector.train import train_detector
    from features.ingest.manifest import read_manifest

    cfg = params.detector
    images = Path(args.images)
    if args.manifest:
        dataset = dd.read_manifest_boxes(read_manifest(Path(args.manifest)), cfg)
    elif args.coco:
        dataset = dd.read_coco(Path(args.coco), Path(args.coco_val) if args.coco_val else None, cfg)
    else:
        attributes = Path(args.vg_attributes) if args.vg_attributes else None
        dataset = dd.read_visual_genome(Path(args.vg_objects), attributes, cfg, images)
    print(f"train detector: {json.dumps(dataset.summary())}")
    errors = Path(args.out) / "errors.csv"
    dd.report_problems(dataset, cfg, errors)
    if dataset.problems:
        print(
            f"train detector: {len(dataset.problems)} malformed annotations dropped "
            f"({', '.join(sorted({p.reason for p in dataset.problems}))}); see {errors}"
        )
    start = time.perf_counter()
    metrics = train_detector(
        dataset,
        images,
        cfg,
        Path(args.out),
        resume=args.resume,
        log=print,
        progress=progress("detector"),
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
