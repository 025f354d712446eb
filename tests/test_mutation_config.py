"""``make mutation``'s configuration covers what it claims: every module named by
``tools/mutation.py``'s ``TARGETS`` is mutated (``only_mutate``), and every test file that
imports one of them (directly or through a helper module of ``tests/``) is in mutmut's
test selection, so no target module is scored without the tests that reach it."""

from __future__ import annotations

import ast
import tomllib

from dag_deps import REPO, module_file
from mutation import TARGETS

CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]
TESTS = REPO / "tests"


def target_files() -> set[str]:
    """The files of ``TARGETS``' modules (a package's pattern, every module inside it),
    relative to the repository."""
    out = set()
    for pattern in TARGETS:
        module = pattern.split(".x_")[0].split(".xǁ")[0].removesuffix(".*")
        path = module_file(module)
        assert path is not None, f"TARGETS: {pattern!r} names no module of the project"
        files = path.parent.glob("*.py") if path.name == "__init__.py" else [path]
        out |= {str(p.relative_to(REPO)) for p in files if p.name != "__init__.py"}
    return out


def imported(path) -> set[str]:
    """Project modules and ``tests/`` helper modules that ``path`` imports anywhere."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def reached_files(test_file, seen=None) -> set[str]:
    """The project files ``test_file`` imports, through ``tests/`` helpers too."""
    seen = set() if seen is None else seen
    out = set()
    for name in imported(test_file):
        if (found := module_file(name)) is not None:
            out.add(str(found.relative_to(REPO)))
        else:
            for folder in (TESTS, TESTS / "jobs", REPO / "tools"):
                if (helper := folder / f"{name}.py").is_file() and helper not in seen:
                    seen.add(helper)
                    out |= reached_files(helper, seen)
    return out


def test_every_target_module_is_mutated():
    missing = sorted(target_files() - set(CONFIG["only_mutate"]))
    assert not missing, f"pyproject.toml [tool.mutmut] only_mutate lacks {missing}"


def test_every_test_that_imports_a_target_is_selected():
    targets = target_files()
    selected = set(CONFIG["pytest_add_cli_args_test_selection"])
    missing = {
        f"tests/{p.name}": sorted(hit)
        for p in sorted(TESTS.glob("test_*.py"))
        if (hit := reached_files(p) & targets) and f"tests/{p.name}" not in selected
    }
    assert not missing, (
        f"pyproject.toml [tool.mutmut] pytest_add_cli_args_test_selection lacks test files "
        f"that import target modules: {missing}"
    )


def test_the_check_sees_a_test_importing_a_target(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text("from features.exchange.milvlg_npz import read_npz\nimport model_data\n")
    assert "features/exchange/milvlg_npz.py" in reached_files(test)
    assert "features/exchange/milvlg_npz.py" in target_files()


def test_the_report_scores_unreached_mutants_and_checks_each_pin(tmp_path, monkeypatch):
    import mutation

    listed = tmp_path / "equivalent.txt"
    listed.write_text(
        "m.x_f__mutmut_1  aaa  # same\n"  # pinned, the same mutant: set aside
        "m.x_f__mutmut_2  bbb  # the function changed since\n"
        "m.x_f__mutmut_3  ccc  # gone\n"
        "m.x_f__mutmut_4  ddd  # a test kills it\n"
        "m.x_f__mutmut_5  # never pinned\n"
    )
    monkeypatch.setattr(mutation, "EQUIVALENT", listed)
    pins = {"m.x_f__mutmut_1": "aaa", "m.x_f__mutmut_2": "new", "m.x_f__mutmut_4": "ddd"}
    pins["m.x_f__mutmut_5"] = "eee"
    statuses = {f"m.x_f__mutmut_{i}": "survived" for i in (1, 2, 5)} | {
        "m.x_f__mutmut_4": "killed",
        "m.x_f__mutmut_6": "killed",
        "m.x_f__mutmut_7": "no tests",
        "m.x_f__mutmut_8": "not checked",
    }
    lines = []
    written = tmp_path / "scores.json"
    code = mutation.report(statuses, ["m.*"], 0.0, pin=pins.get, out=lines.append, write=written)
    import json

    table = json.loads(written.read_text())
    assert (
        table["m"]
        == table["all"]
        == {
            "mutants": 7,
            "killed": 2,
            "equivalent": 3,
            "survived": 2,
            "unreached": 2,
            "score": 50.0,
        }
    )
    text = "\n".join(lines)
    assert code == 1
    # killed 4, 6; survivors 7 and 8 (unreached); 1, 2 and 5 set aside as listed (2 and 5
    # fail the run below): 2 of 4 scored mutants killed
    assert lines[1].split() == ["m", "7", "2", "3", "2", "2", "50.0%"]
    assert "changed: m.x_f__mutmut_2" in text and "stale: m.x_f__mutmut_3" in text
    assert "killed: m.x_f__mutmut_4" in text and "unpinned: m.x_f__mutmut_5" in text
    assert "no tests: m.x_f__mutmut_7" in text and "not checked: m.x_f__mutmut_8" in text
    assert mutation.read_equivalent(listed)["m.x_f__mutmut_1"] == ("aaa", "same")
    assert mutation.write_pins({"m.x_f__mutmut_5": "eee", "m.x_f__mutmut_2": "zzz"}, listed) == 1
    assert mutation.read_equivalent(listed)["m.x_f__mutmut_5"].pin == "eee"
    assert mutation.read_equivalent(listed)["m.x_f__mutmut_2"].pin == "bbb"  # left for review


def test_every_test_left_out_of_mutation_runs_exists_and_is_selected():
    """``tools/mutation_slow_tests.txt`` names tests of the selection that exist: a renamed
    or deleted test would otherwise silently return to the runs, or a stale name linger."""
    from mutation_speed import slow_tests

    selected = set(CONFIG["pytest_add_cli_args_test_selection"])
    for nodeid in sorted(slow_tests(REPO)):
        file, name = nodeid.split("::", 1)
        assert file in selected, f"{nodeid}: its file is not in mutmut's selection"
        function = name.split("[", 1)[0]
        assert f"def {function}(" in (REPO / file).read_text(), f"{nodeid}: no such test"
