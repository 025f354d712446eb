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

import yaml
from tqdm import tqdm

from features.config import ConfigError
from features.ingest import IngestError
from flows.params import Params, load_params


def _progress(desc: str, unit: str = "img"):
    """A tqdm wrapper that shows items/s; quiet enough for CI logs."""
    return lambda items: tqdm(items, desc=desc, unit=unit, mininterval=1.0, dynamic_ncols=True)


def cmd_params(args: argparse.Namespace, params: Params) -> int:
    """Print the validated params, defaults filled in."""
    print(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False), end="")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = load_params(args.params)
        return args.func(args, params)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except IngestError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
