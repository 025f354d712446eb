"""params.yaml validation: unknown keys, wrong types and broken files fail by key path."""

import pytest
from pydantic import BaseModel, ValidationError

from flows.cli import main
from flows.params import load_params, params_model
from infra.config import ConfigError, Section, format_errors


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

    from infra.config import UserError, require_extra

    monkeypatch.setitem(sys.modules, "prefect_dask", None)
    with pytest.raises(UserError, match=r"extraction over Dask needs the \[dask\] extra: pip"):
        require_extra("prefect_dask", "dask", "extraction over Dask")
    monkeypatch.setitem(sys.modules, "s3fs", None)
    from features.store.reader import Store

    with pytest.raises(UserError, match=r"reading s3://b/r.zarr needs the \[s3\] extra"):
        Store.open("s3://b/r.zarr")


# --------------------------------------------------------------------------- bounds

# Fields of files other branches are rewriting, whose bounds are asked for there; each
# must still fail here (strict xfail), so this list is emptied once they are in.
PENDING: set[str] = set()


def numeric_fields(model, prefix=()):
    """``(key path, type, bounds, in a list)`` of every int or float field of ``model``,
    recursively through its sections (the models' own sections included)."""
    import types
    import typing

    import annotated_types as at

    for name, field in model.model_fields.items():
        key = (*prefix, field.alias or name)
        annotation, metadata, in_list = field.annotation, list(field.metadata), False
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from numeric_fields(annotation, key)
            continue
        if typing.get_origin(annotation) is list:
            annotation, in_list = typing.get_args(annotation)[0], True
        if typing.get_origin(annotation) is typing.Annotated:
            annotation, *extra = typing.get_args(annotation)
            metadata += extra
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = options[0] if len(options) == 1 else annotation
        if annotation not in (int, float):
            continue
        bounds = {}
        for item in metadata:
            for kind in ("ge", "gt", "le", "lt"):
                if isinstance(item, getattr(at, kind.capitalize())):
                    bounds[kind] = getattr(item, kind)
        yield ".".join(key), annotation, bounds, in_list


def outside(kind_of: type, bounds: dict) -> list:
    """Values just outside each bound, and non-finite ones for floats."""
    step = 1 if kind_of is int else 1e-9
    values = []
    if "ge" in bounds:
        values.append(bounds["ge"] - step)
    if "gt" in bounds:
        values.append(bounds["gt"])
    if "le" in bounds:
        values.append(bounds["le"] + step)
    if "lt" in bounds:
        values.append(bounds["lt"])
    if kind_of is float:
        values += [float("inf"), -float("inf"), float("nan")]
    return [kind_of(v) if kind_of is int else v for v in values]


def nested(path: str, value) -> dict:
    data = value
    for part in reversed(path.split(".")):
        data = {part: data}
    return data


FIELDS = list(numeric_fields(params_model()))


@pytest.mark.parametrize(
    "path, kind_of, bounds, in_list",
    [
        pytest.param(*f, marks=pytest.mark.xfail(strict=True)) if f[0] in PENDING else f
        for f in FIELDS
    ],
    ids=[f[0] for f in FIELDS],
)
def test_every_numeric_field_is_bounded_and_rejects_values_outside(path, kind_of, bounds, in_list):
    assert "ge" in bounds or "gt" in bounds, f"{path}: no lower bound"
    model = params_model()
    for value in outside(kind_of, bounds):
        data = nested(path, [value] if in_list else value)
        with pytest.raises(ValidationError) as err:
            model.model_validate(data)
        message = format_errors(err.value, model, "params.yaml")
        assert f"params.yaml: {path}" in message, (value, message)


def test_the_walk_finds_every_section_and_the_models():
    paths = {f[0] for f in FIELDS}
    assert {"train.lr", "shards.samples_per_shard", "models.mvvse.lambda_"} <= paths
    assert {"models.camera.kernels", "regions.nms_iou", "evaluate.fold_size"} <= paths
    assert len(paths) > 90


def test_nonsense_values_from_the_issue_are_refused(tmp_path):
    text = (
        "train:\n  warmup_steps: -5\n  lr: .inf\n  device: banana\n"
        "shards:\n  samples_per_shard: -3\n"
    )
    with pytest.raises(ConfigError) as err:
        load_text(tmp_path, text)
    for key in ("train.warmup_steps", "train.lr", "train.device", "shards.samples_per_shard"):
        assert f"params.yaml: {key}:" in str(err.value)
    with pytest.raises(ConfigError, match="shards.samples_per_shard"):
        load_text(tmp_path, "shards:\n  samples_per_shard: 0\n")
    with pytest.raises(ConfigError, match="demo: .*min_objects .* max_objects"):
        load_text(tmp_path, "demo:\n  min_objects: 4\n  max_objects: 3\n")


def test_a_models_own_train_settings_override_the_shared_ones(tmp_path):
    """train.per_model: CAMERA's 1e-4 over the shared 2e-4, the others untouched; a key
    that is no train setting, or a bad value, is an error naming it."""
    from flows.params import load_params
    from infra.config import ConfigError

    path = tmp_path / "params.yaml"
    path.write_text("train:\n  lr: 2.0e-4\n  per_model:\n    camera: {lr: 1.0e-4, epochs: 40}\n")
    train = load_params(path).train
    assert (train.for_model("camera").lr, train.for_model("camera").epochs) == (1e-4, 40)
    assert (train.for_model("vsepp").lr, train.for_model("vsepp").epochs) == (2e-4, 30)
    for bad, message in (
        ("{lrr: 1}", "per_model.camera: lrr: not a train setting"),
        ("{lr: -1}", "per_model.camera.lr: Input should be greater than 0"),
    ):
        path.write_text(f"train:\n  per_model:\n    camera: {bad}\n")
        with pytest.raises(ConfigError, match=message):
            load_params(path)


def test_the_sections_table_names_every_section_the_commands_read():
    from flows.commands import discover
    from flows.params import SECTIONS, section_class

    read = {s for c in discover() for s in (c.sections or ())}
    assert read == set(SECTIONS), (
        f"read by commands, not in SECTIONS: {read - set(SECTIONS)}; "
        f"in SECTIONS, read by no command: {set(SECTIONS) - read}"
    )
    for name in SECTIONS:
        assert issubclass(section_class(name), Section), name
