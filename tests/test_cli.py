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
