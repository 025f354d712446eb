"""The layout holds: imports point down the layers (flows -> models -> features -> infra),
no module or folder imports itself back through others, no file over 600 lines."""

from __future__ import annotations

import ast
import re

from dag_deps import PACKAGES, REPO, module_file

LAYERS = ("infra", "features", "models", "flows")  # each imports only those before it
MAX_LINES = 600


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names, relative ones resolved against ``package``
    (the importing module's package): in ``features.store.writer``, ``from . import locks``
    -> ``features.store`` (and ``features.store.locks`` among the names),
    ``from ..shards import x`` -> ``features.shards``."""
    if not node.level:
        return node.module
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _modules() -> dict[str, set[str]]:
    """Every project module and the project modules it imports (inside functions too)."""
    graph = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
            targets = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = _absolute(node, package)
                    names = [base] + [f"{base}.{a.name}" for a in node.names]
                else:
                    continue
                targets |= {n for n in names if module_file(n) is not None}
            graph[name] = targets - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of folders (packages): an edge where a module of one imports one of the
    other. A module's parent packages are not its folder's imports."""

    def folder(module: str) -> str:
        return module.rsplit(".", 1)[0] if module_file(module).name != "__init__.py" else module

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = folder(module)
        out.setdefault(here, set()).update(
            f for t in targets if (f := folder(t)) != here and not here.startswith(f + ".")
        )
    return out


def test_no_module_imports_itself_back():
    cycle = _cycle(_modules())
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_no_folder_imports_itself_back():
    cycle = _cycle(_folders(_modules()))
    assert cycle is None, f"folders in a circle: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_relative_imports_resolve_to_the_module_they_name():
    def absolute(code: str, package: str) -> str:
        return _absolute(ast.parse(code).body[0], package)

    assert absolute("from . import locks", "features.store") == "features.store"
    assert absolute("from .locks import flock", "features.store") == "features.store.locks"
    assert absolute("from ..shards import x", "features.store") == "features.shards"
    assert absolute("from ... import y", "features.store.sub") == "features"
    assert absolute("from models import z", "features.store") == "models"


def test_imports_point_down_the_layers():
    wrong = []
    for module, targets in _modules().items():
        layer = LAYERS.index(module.split(".")[0])
        wrong += [f"{module} -> {t}" for t in targets if LAYERS.index(t.split(".")[0]) > layer]
    assert not wrong, f"imports against the layers: {wrong}"


def test_no_file_over_600_lines():
    long = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long[str(path.relative_to(REPO))] = n
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_features_top_level_is_folders_and_a_few_modules():
    modules = sorted(p.name for p in (REPO / "features").glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 3, f"features/ holds modules that belong in a folder: {modules}"


HISTORY = re.compile(r"\b(?:[Ii]ssue|[Rr]ound) \d|\.\./shared\b|\b(?:RECIPES|DESIGN)\.md\b")


def test_the_code_states_behaviour_not_history():
    """No issue numbers or rounds (a clone cannot follow them), no paths outside the
    repository, in the package's code and comments and in pyproject.toml."""
    found = []
    files = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))]
    for path in [*files, REPO / "pyproject.toml"]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "history or outside paths in the code:\n" + "\n".join(found)
