"""``vse demo-data`` (stage ``demo-data``): the synthetic demo dataset."""

from __future__ import annotations

import time
from pathlib import Path

from flows.commands import command, path_out, progress


def arguments(p) -> None:
    path_out(p, "--out", help="output folder, e.g. data/demo")


@command(
    "demo-data",
    help="generate the synthetic demo dataset (params: demo)",
    description="Write images/*.png and a Karpathy-style dataset.json with labels, boxes, "
    "gold dependency trees and scene graphs.",
    arguments=arguments,
    sections=("demo",),
)
def run(args, params) -> None:
    from features.demo import build_dataset

    cfg = params.demo
    start = time.perf_counter()
    n = build_dataset(cfg, Path(args.out), progress=progress("demo-data"))
    seconds = time.perf_counter() - start
    print(
        f"demo-data: wrote {n} images ({cfg.n_train} train / {cfg.n_val} val / {cfg.n_test} "
        f"test, {cfg.image_size}px) and {n * cfg.captions_per_image} captions to {args.out} "
        f"in {seconds:.1f} s ({n / seconds:.0f} img/s)"
    )
