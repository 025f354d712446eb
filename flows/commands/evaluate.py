"""``vse evaluate MODEL`` (stage ``evaluate@MODEL``): retrieval metrics of a checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

from flows.commands import Command, path_in, path_out
from flows.commands.train import feature_arguments, feature_paths
from models.registry import MODEL_NAMES


def evaluate_arguments(p) -> None:
    p.add_argument("model", choices=MODEL_NAMES)
    path_in(p, "--checkpoint", required=True, help="best.pt written by vse train")
    feature_arguments(p)
    path_in(p, "--adversarial", help="text store of the adversarial captions")
    path_in(p, "--adversarial-captions", help="parquet of the adversarial captions")
    path_out(p, "--out", help="JSON of the metrics (a DVC metrics file)")


def run_evaluate(args, params) -> int:
    from models.evaluate import evaluate_stage

    start = time.perf_counter()
    report = evaluate_stage(
        args.model,
        Path(args.checkpoint),
        feature_paths(args),
        params.evaluate,
        Path(args.out),
        Path(args.adversarial) if args.adversarial else None,
        Path(args.adversarial_captions) if args.adversarial_captions else None,
    )
    full = report["full"]
    attacked = ", ".join(f"{a} {m['i2t_r1']:.1f}" for a, m in report.get("adversarial", {}).items())
    print(
        f"evaluate {args.model} on {report['split']} ({report['images']} images, "
        f"{report['captions']} captions) in {time.perf_counter() - start:.1f} s: i2t R@1/5/10 "
        f"{full['i2t_r1']:.1f}/{full['i2t_r5']:.1f}/{full['i2t_r10']:.1f}, t2i "
        f"{full['t2i_r1']:.1f}/{full['t2i_r5']:.1f}/{full['t2i_r10']:.1f}, rsum {full['rsum']:.1f}"
        + (f"; with adversarial captions i2t R@1: {attacked}" if attacked else "")
        + f" -> {args.out}"
    )
    return 0


COMMANDS = [
    Command(
        "evaluate",
        help="retrieval metrics of a trained model (params: evaluate)",
        description="R@1/5/10, medr, meanr and rsum both ways on the whole split, COCO-1K "
        "style folds when the split has two or more, robustness to adversarial captions, "
        "and classification metrics for models that classify.",
        arguments=evaluate_arguments,
        run=run_evaluate,
        sections=("evaluate",),
        owns={"evaluate": "models.evaluate:EvaluateConfig"},
    ),
]
