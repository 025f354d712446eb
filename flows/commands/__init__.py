"""The ``vse`` commands, one module each: its arguments and its handler together.

A handler ``run(args, params)``, registered by :func:`command`, reads its inputs, calls the
stage's pure core (in ``features/`` or ``models/``) and reports; what it returns is the
exit status, None for 0. Heavy imports (torch, zarr, spaCy) happen inside handlers, so
``vse --help`` starts fast. :func:`discover` imports every module of this package: nothing
else lists the commands.

:func:`path_in` / :func:`path_out` mark a path argument as an input or an output of the
stage; ``tests/test_dag.py`` checks them against ``dvc.yaml``'s deps and outs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm


@dataclass(frozen=True)
class Command:
    """One ``vse`` command. ``sections``: the params.yaml sections the handler reads (the
    whole file is validated first); ``None``: the command reads no params."""

    name: str  # words after `vse`, e.g. "extract text"
    help: str
    run: Callable[[argparse.Namespace, Any], int | None]
    arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
    sections: tuple[str, ...] | None = ()
    description: str | None = None


# The help of command groups (the first word of multi-word commands).
GROUPS = {
    "extract": "extract features into feature stores",
    "stats": "dataset statistics",
    "shards": "WebDataset training shards",
    "store": "list, inspect, verify, import and export feature stores",
    "prefect": "Prefect deployments of the flows",
    "exp": "DVC experiments (runs with overridden params)",
    "train": "train a retrieval model, or the bottom-up detector",
}
_COMMANDS: list[Command] = []  # filled by @command as discover() imports the modules


def command(name: str, **fields) -> Callable:
    """Register the decorated handler as the :class:`Command` ``vse <name>``; ``fields``:
    its other fields (``help``, ``arguments``, ``sections``, ``description``)."""

    def register(run: Callable) -> Callable:
        _COMMANDS.append(Command(name, run=run, **fields))
        return run

    return register


def discover() -> list[Command]:
    """Every command of every module in this package, by name."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return sorted(_COMMANDS, key=lambda c: c.name)


def path_in(parser: argparse.ArgumentParser, flag: str, help: str, **kwargs) -> argparse.Action:
    """A path the command reads (a DVC dep when the command is a stage)."""
    action = parser.add_argument(flag, help=help, **kwargs)
    action.role = "in"
    return action


def path_out(parser: argparse.ArgumentParser, flag: str, help: str, **kwargs) -> argparse.Action:
    """A path the command writes (a DVC out, metric or plot when it is a stage)."""
    kwargs.setdefault("required", True)
    action = parser.add_argument(flag, help=help, **kwargs)
    action.role = "out"
    return action


def stage_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, list]:
    """The input and output paths of parsed ``args``, by the roles their arguments carry."""
    paths: dict[str, list] = {"in": [], "out": []}
    for action in parser._actions:
        role = getattr(action, "role", None)
        value = getattr(args, action.dest, None)
        if role and value:
            paths[role] += value if isinstance(value, list) else [value]
    return paths


def progress(desc: str, unit: str = "img") -> Callable:
    """A progress bar factory showing items/s: ``progress(total=n)`` or ``progress(items)``."""
    return functools.partial(tqdm, desc=desc, unit=unit, mininterval=1.0, dynamic_ncols=True)


def text_table(header: Sequence, rows: Iterable[Sequence]) -> str:
    """``header`` and ``rows`` (sequences of cells, turned to text) as lines of columns
    padded to their widest cell, two spaces apart, trailing spaces dropped."""
    table = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(c) for c in col) for col in zip(*table, strict=True)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )
