"""``vse report`` (stage ``report``): all models side by side."""

from __future__ import annotations

from pathlib import Path

from flows.commands import Command, path_in, path_out


def report_arguments(p) -> None:
    path_in(p, "results", nargs="+", help="evaluation JSON files (vse evaluate --out)")
    path_out(p, "--out", help="markdown report to write")
    path_out(p, "--plot", help="PNG bar plot to write")
    path_in(
        p, "--histories", nargs="+", help="per-epoch JSON rows of each model (vse train --plots)"
    )
    path_out(p, "--curves", required=False, help="PNG of every model's training curves")


def run_report(args, params) -> int:
    from models.report import write_report

    histories = [Path(h) for h in args.histories or []]
    if histories and not args.curves:
        from features.config import UserError

        raise UserError("--histories needs --curves PNG, where the training curves go")
    curves = Path(args.curves) if args.curves else None
    print(
        write_report(
            [Path(r) for r in args.results], Path(args.out), Path(args.plot), histories, curves
        )
    )
    print(f"report -> {args.out}, {args.plot}" + (f", {curves}" if curves else ""))
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
