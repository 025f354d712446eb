"""``vse prepare`` (stage ``prepare``): a raw dataset -> the validated manifest."""

from __future__ import annotations

from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def arguments(p) -> None:
    path_in(
        p,
        "--annotations",
        required=True,
        help="Karpathy/demo dataset JSON, or a Food-101 texts CSV or folder of CSVs",
    )
    path_in(p, "--images", required=True, help="images root; manifest paths are relative")
    path_out(p, "--out", help="manifest parquet to write")
    path_out(p, "--errors", help="CSV of every problem: key, reason, detail")
    path_out(p, "--metrics", help="JSON of counts (a DVC metrics file)")


@command(
    "prepare",
    help="validate a raw dataset into the canonical manifest (params: prepare)",
    description="Read Karpathy JSON, UPMC Food-101 or the demo dataset, validate every "
    "record and write the manifest parquet, an errors CSV and a metrics JSON.",
    arguments=arguments,
    sections=("prepare",),
)
def run(args, params) -> None:
    from features.ingest.prepare import prepare

    prepare(
        Path(args.annotations),
        Path(args.images),
        params.prepare,
        Path(args.out),
        Path(args.errors),
        Path(args.metrics),
        progress=progress("prepare", unit="record"),
    )
