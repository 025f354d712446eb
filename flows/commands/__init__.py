"""The ``vse`` commands, one module each: its arguments and its handler together.

A command module defines ``COMMANDS``, a list of :class:`Command`: the words that call it
(``"extract text"``), its help, a function adding its arguments and the handler
``run(args, params)``. The handler reads its inputs, calls the stage's pure core (in
``features/`` or ``models/``) and reports; the stage's logic lives in the core. Heavy
imports (torch, zarr, spaCy) happen inside handlers, so ``vse --help`` starts fast.

:func:`discover` finds every module of this package, so adding a command means adding a
module (and, for a DVC stage, its core function and its ``dvc.yaml`` entry); nothing else
lists the commands.

Paths are declared with :func:`path_in` / :func:`path_out`, which mark the argument as an
input or an output of the stage: ``tests/test_dag.py`` parses every ``dvc.yaml`` command
with them and checks that inputs are deps and outputs are outs.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm


@dataclass(frozen=True)
class Command:
    """One ``vse`` command.

    ``sections`` are the params.yaml sections the handler reads (every command that reads
    params validates the whole file first); ``None``: the command reads no params.
    """

    name: str  # words after `vse`, e.g. "extract text"
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Any], int]
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


def discover() -> list[Command]:
    """Every command of every module in this package, by name."""
    commands = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        commands.extend(getattr(module, "COMMANDS", []))
    return sorted(commands, key=lambda c: c.name)


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

    def bar(items=None, total=None):
        return tqdm(items, total=total, desc=desc, unit=unit, mininterval=1.0, dynamic_ncols=True)

    return bar
