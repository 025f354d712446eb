"""params.yaml validation: unknown keys, wrong types and broken files fail by key path."""

import pytest
from pydantic import BaseModel, ValidationError

from features.config import ConfigError, Section, format_errors
from flows.cli import main
from flows.params import load_params, params_model


def test_repo_params_are_valid_and_match_the_paper_free_defaults(repo_root):
    params = load_params(repo_root / "params.yaml")
    assert params.demo.n_train == 600 and params.demo.image_size == 128
    assert params.prepare.format == "demo"


def load_text(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return load_params(path)


def test_unknown_key_names_the_path_and_suggests_the_closest_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_text(tmp_path, "prepare:\n  max_eror_fraction: 0.1\n")
    assert "prepare.max_eror_fraction: unknown key, did you mean max_error_fraction" in str(
        err.value
    )


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"prepar: unknown key, did you mean prepare"):
        load_text(tmp_path, "prepar: {}\n")


def test_wrong_type_is_not_coerced(tmp_path):
    with pytest.raises(ConfigError, match=r"demo\.n_train: .*integer.*got '600'"):
        load_text(tmp_path, "demo:\n  n_train: '600'\n")


def test_bad_choice_and_range(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_text(tmp_path, "prepare:\n  format: coco\n  max_error_fraction: 2\n")
    message = str(err.value)
    assert "prepare.format:" in message and "'karpathy'" in message
    assert "prepare.max_error_fraction:" in message  # every problem is reported at once


def test_broken_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_text(tmp_path, "demo: [unclosed\n")
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_text(tmp_path, "- demo\n")


def test_missing_sections_take_defaults(tmp_path):
    assert load_text(tmp_path, "") == params_model().model_validate({})


def test_nested_model_sections_get_did_you_mean():
    """The message format later model sections rely on: models.mvvse.lamda -> lambda_."""

    class MVVSE(Section):
        lambda_: float = 0.7

    class Models(Section):
        mvvse: MVVSE = MVVSE()

    class Root(BaseModel):
        models: Models = Models()

    with pytest.raises(ValidationError) as err:
        Root.model_validate({"models": {"mvvse": {"lamda": 0.5}}})
    assert format_errors(err.value, Root, "params.yaml") == (
        "params.yaml: models.mvvse.lamda: unknown key, did you mean lambda_"
    )


def test_cli_fails_before_any_work(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("demo:\n  n_trian: 5\n")
    out = tmp_path / "demo"
    code = main(["--params", str(params), "demo-data", "--out", str(out)])
    assert code == 2
    assert "demo.n_trian: unknown key, did you mean n_train" in capsys.readouterr().err
    assert not out.exists()


def test_a_missing_extra_is_named(monkeypatch):
    """Optional features say which extra installs them (sys.modules None: not installed)."""
    import sys

    from features.config import UserError, require_extra

    monkeypatch.setitem(sys.modules, "prefect_dask", None)
    with pytest.raises(UserError, match=r"extraction over Dask needs the \[dask\] extra: pip"):
        require_extra("prefect_dask", "dask", "extraction over Dask")
    monkeypatch.setitem(sys.modules, "s3fs", None)
    from features.store import Store

    with pytest.raises(UserError, match=r"reading s3://b/r.zarr needs the \[s3\] extra"):
        Store.open("s3://b/r.zarr")
