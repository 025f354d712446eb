"""The installed `vse` console script: --help works on every (sub)command."""

import argparse
import subprocess

from flows.cli import build_parser


def command_paths(parser: argparse.ArgumentParser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from command_paths(sub, prefix + (name,))


def test_every_subcommand_has_help():
    paths = list(command_paths(build_parser()))
    assert {("demo-data",), ("prepare",), ("params",)} <= set(paths)
    for path in [(), *paths]:
        result = subprocess.run(["vse", *path, "--help"], capture_output=True, text=True)
        assert result.returncode == 0, (path, result.stderr)
        assert "usage: vse" in result.stdout


def test_params_command_prints_effective_config(repo_root):
    result = subprocess.run(
        ["vse", "params"], capture_output=True, text=True, cwd=repo_root, check=True
    )
    assert "max_error_fraction: 0.01" in result.stdout


def test_exp_show_keeps_the_params_that_differ_and_the_rsums():
    from flows.commands.experiments import table

    def row(name, margin, rsum):
        return {
            "rev": name,
            "name": name,
            "data": {
                "params": {
                    "params.yaml": {
                        "data": {"models": {"vsepp": {"margin": margin}}, "train": {"lr": 0.001}}
                    }
                },
                "metrics": {"metrics/evaluate/vsepp.json": {"data": {"full": {"rsum": rsum}}}},
            },
        }

    shown = [
        row("workspace", 0.2, 300.0),
        {
            **row("main", 0.2, 300.0),
            "experiments": [
                {"revs": [{**row("abc1234", 0.3, 310.5), "name": "train-vsepp-1a2b3c4d"}]}
            ],
        },
    ]
    lines = table(shown).splitlines()
    assert lines[0].split() == ["experiment", "models.vsepp.margin", "vsepp", "rsum"]
    assert lines[-1].split() == ["train-vsepp-1a2b3c4d", "0.3", "310.5"]
    assert all(len(line) < 80 for line in lines)  # train.lr is the same everywhere: left out


def test_file_system_errors_are_one_line(tmp_path, capsys):
    from flows.cli import main

    (tmp_path / "a-file").write_text("x")
    args = ["--annotations", str(tmp_path / "none.json"), "--images", str(tmp_path)]
    out = ["--out", str(tmp_path / "a-file" / "m.parquet"), "--errors", str(tmp_path / "e.csv")]
    params = tmp_path / "params.yaml"
    params.write_text("prepare:\n  format: karpathy\n")
    (tmp_path / "none.json").write_text('{"images": []}')
    code = main(["--params", str(params), "prepare", *args, *out, "--metrics", str(tmp_path / "j")])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "record/s" not in x]
    assert code == 1 and len(err) == 1 and err[0].startswith("error: "), err  # no traceback
    assert "a-file: File exists" in err[0] or "a-file: Not a directory" in err[0]


def test_malformed_command_line_items_are_one_line_errors():
    import pytest

    from flows.commands.flow import parse_overrides
    from flows.commands.shards import _named_paths
    from infra.config import UserError

    assert parse_overrides(["train.lr=0.1", "grid.weights=null", "text.model=bert-base"]) == {
        "train.lr": 0.1,  # values are JSON, else strings
        "grid.weights": None,
        "text.model": "bert-base",
    }
    assert parse_overrides(['adversarial.splits=["val", "test"]', 'x.y="a,b"']) == {
        "adversarial.splits": ["val", "test"],
        "x.y": "a,b",  # a comma is no sweep
    }
    with pytest.raises(UserError, match="-S 'train.lr': expected KEY=VALUE"):
        parse_overrides(["train.lr"])
    with pytest.raises(UserError, match="--store 'regions': expected NAME=PATH"):
        _named_paths(["regions"], "--store")


def test_broken_result_and_manifest_files_are_one_line_errors(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flows.cli import main

    (tmp_path / "r.json").write_text('{"model": "vsepp", "split"')
    (tmp_path / "s.json").write_text('{"split": "test"}')
    for bad in ("r.json", "s.json"):
        out = ["--out", str(tmp_path / "m.md"), "--plot", str(tmp_path / "p.png")]
        assert main(["report", str(tmp_path / bad), *out]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / bad}: ") and err.count("\n") == 1, err
    table = pa.table({"key": ["a"]}).replace_schema_metadata({"vse": "{not json"})
    pq.write_table(table, tmp_path / "m.parquet")
    args = ["--manifest", str(tmp_path / "m.parquet"), "--split", "test", "--out", str(tmp_path)]
    assert main(["store", "export-precomp", str(tmp_path / "x.zarr"), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'm.parquet'}: ") and err.count("\n") == 1, err


def test_flow_of_a_model_not_enabled_is_a_one_line_error(repo_root, tmp_path):
    """``vse flow`` reads ``models.enabled``: a model left out of it has no training flow."""
    import yaml

    params = yaml.safe_load((repo_root / "params.yaml").read_text())
    del params["models"]["enabled"]["huse"]
    params["models"]["ablations"] = {}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    result = subprocess.run(
        ["vse", "flow", "train-huse"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr
    assert "huse is not in models.enabled of params.yaml" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
