"""What each DVC stage runs, derived from the code: the project modules its command
imports (transitively, imports inside functions included) and the paths it reads and
writes. ``tests/test_dag.py`` checks ``dvc.yaml`` against it; ``python tools/dag_deps.py``
prints each stage's code deps, ``python tools/dag_deps.py --write`` puts them in
``dvc.yaml`` (the other deps, comments and order stay)."""

from __future__ import annotations

import ast
import shlex
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("infra", "features", "models", "flows")
sys.path.insert(0, str(REPO))


def module_file(name: str) -> Path | None:
    """The file of project module ``name`` (a package's ``__init__.py``), or None."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path) -> set[str]:
    """Module names imported anywhere in ``path`` (``from a.b import c`` gives ``a.b`` and,
    when ``a.b.c`` is a module, ``a.b.c``), with their parent packages."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
    return names | parents


@cache
def closure(path: Path) -> frozenset[Path]:
    """``path`` and every project file it imports, transitively (``__init__.py`` files
    that hold only a docstring run nothing and are left out)."""
    seen: set[Path] = set()
    todo = [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in _imports(current):
            found = module_file(name)
            if found is not None and found not in seen:
                todo.append(found)
    return frozenset(p for p in seen if _runs_code(p))


def _runs_code(path: Path) -> bool:
    """Whether a file holds more than a docstring (an empty ``__init__.py`` runs nothing)."""
    body = ast.parse(path.read_text()).body
    return any(
        not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body
    )


def command_of(argv: list[str]):
    """The parsed args of a ``vse ...`` command line (the leaf parser is in the args)."""
    from flows.cli import build_parser

    if argv[:1] != ["vse"]:
        raise ValueError(f"{shlex.join(argv)}: not a `vse` command")
    return build_parser().parse_args(argv[1:])


def code_deps(args, sections: list[str]) -> set[str]:
    """Project files stage command ``args`` runs: the CLI, its command's module, the
    modules of the params sections it reads (whose defaults can change its outputs) and
    the file of the model it names (``vse train MODEL``, ``vse evaluate MODEL``)."""
    from flows.params import section_module
    from models.registry import MODELS, model_module

    command_module = sys.modules[args.command_spec.run.__module__].__file__
    roots = [REPO / "flows/cli.py", REPO / "flows/params.py", Path(command_module)]
    roots += [module_file(section_module(key)) for key in sections]
    if getattr(args, "model", None) in MODELS:
        roots.append(module_file(model_module(args.model)))
    files = set().union(*(closure(r) for r in roots))
    return {str(p.relative_to(REPO)) for p in files}


def stages() -> dict:
    """Every stage of ``dvc.yaml``, resolved (vars, foreach), by name."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        return {s.addressing: s for s in repo.index.stages}


def stage_code_deps(stage) -> set[str]:
    argv = shlex.split(stage.cmd)
    params = [key for p in stage.deps if getattr(p, "params", None) for key in p.params]
    return code_deps(command_of(argv), params)


def write_code_deps(path: Path = REPO / "dvc.yaml") -> None:
    """Replace the ``.py`` deps of each stage of ``path`` by the derived ones; a ``foreach``
    stage lists what its items share, with ``${key}`` (or ``${item.model}``, where the
    item names its model) for the one file of the item's model."""
    derived: dict[str, set[str]] = {}
    for name, stage in stages().items():
        base, _, key = name.partition("@")
        model = getattr(command_of(shlex.split(stage.cmd)), "model", None)
        deps = stage_code_deps(stage)
        if key and model:
            item = "${key}" if model == key else "${item.model}"
            deps = {p.replace(f"models/{model}.py", f"models/{item}.py") for p in deps}
        if base in derived and derived[base] != deps:
            sys.exit(f"stage {base}: its items run different code: {derived[base] ^ deps}")
        derived[base] = deps
    lines = path.read_text().splitlines(keepends=True)
    out, stage, in_stages = [], None, False
    for i, line in enumerate(lines):
        if line.startswith("stages:"):
            in_stages = True
        elif in_stages and line.startswith("  ") and not line.startswith("   ") and ":" in line:
            stage = line.strip().rstrip(":")
        code = line.strip().startswith("- ") and line.strip()[2:].endswith(".py")
        if not (in_stages and code):
            out.append(line)
            continue
        previous_code = lines[i - 1].strip().startswith("- ") and lines[i - 1].strip()[2:].endswith(
            ".py"
        )
        if not previous_code:  # the first code dep of a list: write all of them here
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(f"{indent}- {p}\n" for p in sorted(derived.pop(stage)))
    if derived:
        sys.exit(f"stages without code deps in {path}: {sorted(derived)}")
    path.write_text("".join(out))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_code_deps()
    else:
        for name, stage in stages().items():
            print(f"{name}:")
            for path in sorted(stage_code_deps(stage)):
                print(f"      - {path}")
