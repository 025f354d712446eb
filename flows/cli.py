"""The ``vse`` command line: the commands of :mod:`flows.commands`, one module each.

Every command that reads params validates the whole ``params.yaml`` before doing anything,
so a broken config fails fast, and hands its handler the typed sections. Paths come from
the command line (written once, in ``dvc.yaml``). A failure the user can fix prints one
``error: ...`` line and exits non-zero.
"""

from __future__ import annotations

import argparse
import sys

from flows.commands import GROUPS, discover
from infra import kernels
from infra.config import ConfigError, UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vse",
        description="Feature pipeline and store for visual-semantic embedding research.",
    )
    parser.add_argument(
        "--params", default="params.yaml", help="config file (default: %(default)s)"
    )
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in discover():
        *group, name = command.name.split()
        where = top
        if group:
            (word,) = group
            if word not in groups:
                sub = top.add_parser(word, help=GROUPS.get(word), description=GROUPS.get(word))
                groups[word] = sub.add_subparsers(
                    dest=f"{word}_command", required=True, metavar="COMMAND"
                )
            where = groups[word]
        p = where.add_parser(name, help=command.help, description=command.description)
        command.arguments(p)
        p.set_defaults(command_spec=command, command_parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv``. Run as ``vse`` (no ``argv``), the process's CPU kernels and
    thread counts are pinned first (:func:`infra.kernels.pin`), so its outputs are the same
    bytes on every x86-64 machine; given a list (tests, other Python code), the calling
    process's environment is left as it is."""
    args = build_parser().parse_args(argv)
    command = args.command_spec
    try:
        if argv is None:
            kernels.pin()  # before numpy or torch loads: the same floats on every machine
        params = None
        if command.sections is not None:
            from flows.params import load_params

            params = load_params(args.params)
        return command.run(args, params) or 0
    except (ConfigError, UserError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else getattr(err, "exit_code", 1)  # Preempted: 75
    except OSError as err:  # a file the user named is missing, unwritable, a folder ...
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
