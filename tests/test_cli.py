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
