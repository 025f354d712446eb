"""``vse report`` (stage ``report``): all models side by side."""

from __future__ import annotations

from pathlib import Path

from flows.commands import Command, path_in, path_out


def report_arguments(p) -> None:
    path_in(p, "results", nargs="+", help="evaluation JSON files (vse evaluate --out)")
    path_out(p, "--out", help="markdown report to write")
    path_out(p, "--plot", help="PNG bar plot to write")


def run_report(args, params) -> int:
    from models.report import write_report

    print(write_report([Path(r) for r in args.results], Path(args.out), Path(args.plot)))
    print(f"report -> {args.out}, {args.plot}")
    return 0


COMMANDS = [
    Command(
        "report",
        help="one table of all models on the same split, with the papers' numbers",
        arguments=report_arguments,
        run=run_report,
        sections=None,
    ),
]
