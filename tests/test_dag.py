"""dvc.yaml tells the truth: each stage depends on exactly the project code its command
runs and on every path it reads, declares every path it writes, names each path once, and
keeps its run-cache entry (no `persist`)."""

import ast
import re
import shlex
from pathlib import Path

import pytest
import yaml
from dag_deps import REPO, command_of, module_file, stage_code_deps, stages

from flows.commands import stage_paths

STAGES = stages()
RAW = yaml.safe_load((REPO / "dvc.yaml").read_text())


def _paths(outs) -> set[str]:
    return {str(out.def_path) for out in outs}


def _inside(path: str, folders: set[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


@pytest.mark.parametrize("name", list(STAGES))
def test_code_deps_are_exactly_the_modules_the_command_runs(name):
    stage = STAGES[name]
    listed = {p for p in _paths(stage.deps) if p.endswith(".py")}
    derived = stage_code_deps(stage)
    assert not derived - listed, f"{name}: dvc.yaml misses code deps {sorted(derived - listed)}"
    assert not listed - derived, f"{name}: deps on code it never runs {sorted(listed - derived)}"


@pytest.mark.parametrize("name", list(STAGES))
def test_paths_the_command_reads_are_deps_and_those_it_writes_are_outs(name):
    stage = STAGES[name]
    args = command_of(shlex.split(stage.cmd))
    paths = stage_paths(args.command_parser, args)
    deps = {p for p in _paths(stage.deps) if not p.endswith(".py")}
    outs = _paths(stage.outs)
    missing = [p for p in paths["in"] if not _inside(p, deps)]
    assert not missing, f"{name} reads {missing}, which are not among its deps"
    undeclared = [p for p in paths["out"] if p not in outs]
    assert not undeclared, f"{name} writes {undeclared}, which are not its outs"
    sections = args.command_spec.sections or ()
    params = [key for d in stage.deps if getattr(d, "params", None) for key in d.params]
    unread = [s for s in sections if not any(k.split(".")[0] == s for k in params)]
    assert not unread, f"{name} reads params sections {unread} that dvc.yaml does not list"


def test_every_stage_that_touches_a_store_depends_on_the_store_code():
    """Editing features/store/spec.py reruns every stage that writes or reads a store."""
    for name, stage in STAGES.items():
        paths = _paths(stage.deps) | _paths(stage.outs)
        if any(".zarr" in p for p in paths):
            assert "features/store/spec.py" in stage_code_deps(stage), name


def test_no_stage_persists_its_outputs():
    """DVC keeps no run-cache entry for a stage with a `persist` output."""
    for name, stage in STAGES.items():
        assert not [o for o in stage.outs if o.persist], name


def test_each_path_is_written_once():
    """Data paths are written in `vars` only; params.yaml holds none of them."""
    text = (REPO / "dvc.yaml").read_text()
    literals = re.findall(r"(?<![\w$}/.-])((?:data|metrics|plots|reports)/[\w./-]+)", text)
    repeated = {p for p in literals if literals.count(p) > 1}
    assert not repeated, f"paths written more than once in dvc.yaml: {sorted(repeated)}"
    declared = {v for var in RAW["vars"] for group in var.values() for v in group.values()}
    params = yaml.safe_load((REPO / "params.yaml").read_text())

    def values(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from values(v)
        elif isinstance(node, list):
            for v in node:
                yield from values(v)
        else:
            yield node

    shared = [v for v in values(params) if isinstance(v, str) and v in declared]
    assert not shared, f"params.yaml holds paths that dvc.yaml holds: {shared}"


def _import_graph(package: str) -> dict[str, set[str]]:
    graph = {}
    for path in sorted((REPO / package).rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for module in found:
                target = module_file(module)
                if target is not None and target != path:
                    rel = target.relative_to(REPO).with_suffix("")
                    edges.add(".".join(rel.parts).removesuffix(".__init__"))
        graph[name] = edges
    return graph


def test_flows_has_no_import_circle():
    graph = _import_graph("flows")
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import circle: {' -> '.join([*trail, node, nxt])}")
            if nxt in graph and not state.get(nxt):
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in graph:
        if not state.get(node):
            visit(node, [])


def test_features_and_models_never_import_flows():
    for package in ("features", "models"):
        for name, edges in _import_graph(package).items():
            assert not [e for e in edges if e.startswith("flows")], name


def test_the_readme_shows_the_current_dag():
    import subprocess

    mermaid = subprocess.run(
        ["dvc", "dag", "--mermaid"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    readme = (REPO / "README.md").read_text()
    assert f"```mermaid\n{mermaid}\n```" in readme, "README: paste the output of dvc dag --mermaid"


# the image store each model reads, from the papers: VSE++ and HUSE a global vector,
# MV-VSE and CAMERA bottom-up regions, UniVSE a grid
PAPER_STORES = {"vsepp": "global", "mvvse": "regions", "camera": "regions", "huse": "graph_rise"}
PAPER_STORES["univse"] = "grid"


def test_the_models_of_the_dag_are_one_list_in_params(tmp_path):
    """Deleting HUSE's line of `models.enabled` removes it from every place: DVC's own
    parsed stages (train@, evaluate@), the report's inputs; the others read their store."""
    from dvc.repo import Repo

    from flows.commands.report import model_files

    params = (REPO / "params.yaml").read_text()
    assert yaml.safe_load(params)["models"]["enabled"] == PAPER_STORES
    line = "    huse: graph_rise       # or global (the pooled trunk feature)\n"
    ablation = "  ablations:               # more rows for the report ({} for none)"
    assert params.count(line) == params.count(ablation) == 1
    params = re.sub(re.escape(ablation) + r".*\n.*\n", "  ablations: {}\n", params)
    (tmp_path / "params.yaml").write_text(params.replace(line, ""))
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    Repo.init(str(tmp_path), no_scm=True).close()
    with Repo(str(tmp_path)) as repo:
        stages = {s.name: s for s in repo.index.stages}
    kept = [m for m in PAPER_STORES if m != "huse"]
    assert sorted(n for n in stages if "@" in n) == sorted(
        f"{stage}@{m}" for stage in ("train", "evaluate") for m in kept
    )
    for m in kept:
        for stage in ("train", "evaluate"):
            argv = shlex.split(stages[f"{stage}@{m}"].cmd)
            store = f"data/features/{PAPER_STORES[m]}.zarr"
            assert argv[argv.index(f"--{PAPER_STORES[m]}") + 1] == store
            assert store in _paths(stages[f"{stage}@{m}"].deps)
    report = shlex.split(stages["report"].cmd)
    folders = [report[2], report[report.index("--histories") + 1]]
    folders.append(report[report.index("--galleries") + 1])
    for folder in folders:
        (tmp_path / folder).mkdir(parents=True)
        for m in PAPER_STORES:  # a stale huse.json from an earlier run is left out
            (tmp_path / folder / f"{m}.json").write_text("{}")
        got = model_files([str(tmp_path / folder)], kept)
        assert got == [tmp_path / folder / f"{m}.json" for m in kept]
        assert folder in _paths(stages["report"].deps)
    assert "models.enabled" in stages["report"].deps[-1].params


def test_an_ablation_is_trained_and_evaluated_on_its_store_and_reported(tmp_path, monkeypatch):
    """`models.ablations` of params.yaml (the demo: huse-pooled, HUSE on the global
    store): DVC's parsed stages train and evaluate the run's model on the run's store into
    files named after the run, which the report reads beside the enabled models'."""
    from dvc.repo import Repo

    from flows.commands.report import run_report
    from flows.params import load_params

    assert load_params(REPO / "params.yaml").models.ablations["huse-pooled"].model_dump() == {
        "model": "huse",
        "store": "global",
    }
    with Repo(str(REPO)) as repo:
        stages = {s.addressing: s for s in repo.index.stages}
    train = shlex.split(stages["train-ablation@huse-pooled"].cmd)
    evaluate = shlex.split(stages["evaluate-ablation@huse-pooled"].cmd)
    assert train[2] == evaluate[2] == "huse"
    for argv in (train, evaluate):
        assert argv[argv.index("--global") + 1] == "data/features/global.zarr"
        assert "--graph_rise" not in argv
    assert train[train.index("--out") + 1] == "data/models/huse-pooled"
    assert evaluate[evaluate.index("--checkpoint") + 1] == "data/models/huse-pooled/best.pt"
    assert evaluate[evaluate.index("--name") + 1] == "huse-pooled"
    out = evaluate[evaluate.index("--out") + 1]
    assert Path(out).parent == Path(shlex.split(stages["report"].cmd)[2])
    assert "models/huse.py" in _paths(stages["train-ablation@huse-pooled"].deps)
    assert "data/features/global.zarr" in _paths(stages["evaluate-ablation@huse-pooled"].deps)
    assert "models.huse" in stages["train-ablation@huse-pooled"].deps[-1].params
    assert "models.ablations" in stages["report"].deps[-1].params
    seen = {}

    def write_report(results, out, plot, histories, curves):
        seen.update(results=results, histories=histories)
        return ""

    args = type("Args", (), {"galleries": None, "out": "o.md", "plot": "p.png"})()
    args.curves = "c.png"
    args.results, args.histories = [str(tmp_path / "r")], [str(tmp_path / "h")]
    for folder in (*args.results, *args.histories):
        Path(folder).mkdir()
    monkeypatch.setattr("models.report.table.write_report", write_report)
    run_report(args, load_params(REPO / "params.yaml"))
    names = [*PAPER_STORES, "huse-pooled"]
    assert seen["results"] == [tmp_path / "r" / f"{n}.json" for n in names]
    assert seen["histories"] == [tmp_path / "h" / f"{n}.json" for n in names]


@pytest.mark.parametrize(
    "ablations, message",
    [
        (
            {"huse-pooled": {"model": "huse", "store": "grid"}},
            "huse reads the global or graph_rise",
        ),
        ({"huse": {"model": "huse", "store": "global"}}, "huse is a model of models.enabled"),
        ({"h": {"model": "huse", "store": "graph_rise"}}, "huse already reads graph_rise"),
        ({"H P": {"model": "huse", "store": "global"}}, "name a run with a-z"),
        ({"v": {"model": "vsep", "store": "global"}}, "vsep is not in models.enabled"),
    ],
)
def test_models_ablations_are_checked(tmp_path, ablations, message):
    from flows.params import load_params
    from infra.config import ConfigError

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"models": {"ablations": ablations}}))
    with pytest.raises(ConfigError, match="models: ablations") as err:
        load_params(tmp_path / "params.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "enabled, message",
    [
        ({"vsepp": "grid"}, "vsepp reads the global or graph_rise store, not 'grid'"),
        ({"vsep": "global"}, "unknown model 'vsep'"),
        ({}, "no model enabled"),
    ],
)
def test_models_enabled_is_checked(tmp_path, enabled, message):
    from flows.params import load_params
    from infra.config import ConfigError

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"models": {"enabled": enabled}}))
    with pytest.raises(ConfigError, match="models.enabled") as err:
        load_params(tmp_path / "params.yaml")
    assert message in str(err.value)
