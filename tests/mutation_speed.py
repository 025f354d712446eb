"""Mutation runs only (mutmut runs the suite from its copy of the tree, ``mutants/``): the
tests that reach a mutant run fastest first, and the slow ones listed in
``tools/mutation_slow_tests.txt`` are left out.

mutmut hands pytest every test that reaches a mutated function, in file order, and a
surviving mutant costs all of them. About fifty end-to-end tests (kill-anywhere, torchrun,
Dask) take over 90% of the suite's time; with them, a mutant of the training history would
cost minutes and a full run days on 2 cores. Without them each mutant meets the unit
tests, which check the numbers; a mutant that only an end-to-end test reaches is then
unreached, and ``tools/mutation.py`` counts it as a survivor. The order uses the durations
mutmut recorded in its stats run (``mutants/mutmut-stats.json``). Outside ``mutants/``
this plugin does nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TREE = Path(__file__).resolve().parent.parent
SLOW = "tools/mutation_slow_tests.txt"


def slow_tests(tree: Path = TREE) -> set[str]:
    """The node ids listed in ``tools/mutation_slow_tests.txt`` (``# `` starts a comment)."""
    path = tree / SLOW
    if not path.is_file():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    if TREE.name != "mutants":
        return
    slow = slow_tests()
    stats = TREE / "mutmut-stats.json"
    seconds = json.loads(stats.read_text())["duration_by_test"] if stats.is_file() else {}
    left_out = [item for item in items if item.nodeid in slow]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    kept = [item for item in items if item.nodeid not in slow]
    items[:] = sorted(kept, key=lambda item: seconds.get(item.nodeid, 0.0))  # stable
