"""Evaluation refuses non-finite embeddings and similarities, naming the item."""

from pathlib import Path

import numpy as np
import pytest
import torch
from model_data import TinyPairs

from features.finite import NonFiniteError
from models.evaluate import EvaluateConfig, evaluate_model
from models.train import build_model
from models.vsepp import VSEPPConfig

CFG = EvaluateConfig(batch_size=8, fold_size=4, device="cpu")


@pytest.fixture
def data():
    pairs = TinyPairs(n_images=8)
    pairs.split = "test"
    return pairs


def model_for(data):
    torch.manual_seed(0)
    return build_model("vsepp", VSEPPConfig(embed_size=16, word_dim=8), data.info)


def test_finite_inputs_give_metrics(data):
    report = evaluate_model(model_for(data), data, CFG, torch.device("cpu"))
    assert 0 <= report["full"]["rsum"] <= 600 and report["folds"]["n_folds"] == 2


def test_an_image_with_nan_features_is_refused_by_key(data):
    """One NaN image used to rank first everywhere and *raise* rsum; now it is an error."""
    data.image[3, 5] = float("nan")
    with pytest.raises(NonFiniteError, match="image 3 .*NaN or infinite"):
        evaluate_model(model_for(data), data, CFG, torch.device("cpu"))
    data.image_keys = [f"img{i:02d}" for i in range(data.n_images)]
    with pytest.raises(NonFiniteError, match="image 'img03'"):
        evaluate_model(model_for(data), data, CFG, torch.device("cpu"))


def test_a_model_with_infinite_weights_is_refused(data):
    model = model_for(data)
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        evaluate_model(model, data, CFG, torch.device("cpu"))


def not_checkpoints(tmp_path, data):
    """Files that are not checkpoints, each in its own way."""
    import pickle

    state = model_for(data).state_dict()
    good = {"model": "vsepp", "config": {"embed_size": 16, "word_dim": 8}, "state_dict": state}
    good["info"] = data.info.to_dict() if hasattr(data.info, "to_dict") else vars(data.info)
    files = {
        "random.pt": lambda p: p.write_bytes(np.random.default_rng(0).bytes(300)),
        "empty.pt": lambda p: p.write_bytes(b""),
        "text.pt": lambda p: p.write_text("not a checkpoint\n"),
        "list.pt": lambda p: torch.save([1, 2, 3], p),
        "missing.pt": lambda p: torch.save({"model": "vsepp"}, p),
        "unknown.pt": lambda p: torch.save({**good, "model": "nope"}, p),
        "config.pt": lambda p: torch.save({**good, "config": {"embed_size": -1}}, p),
        "weights.pt": lambda p: torch.save({**good, "state_dict": {"x": torch.zeros(1)}}, p),
        "info.pt": lambda p: torch.save({**good, "info": {"bogus": 1}}, p),
        "pickle.pt": lambda p: p.write_bytes(pickle.dumps(Path("/"))),
        "truncated.pt": lambda p: (torch.save(good, p), p.write_bytes(p.read_bytes()[:200])),
        "folder.pt": lambda p: p.mkdir(),
    }
    for name, make in files.items():
        make(tmp_path / name)
    return [tmp_path / name for name in files], good


def test_files_that_are_not_checkpoints_are_one_line_errors(tmp_path, data, repo_root, capsys):
    from flows.cli import main
    from models.train import TrainingError, load_checkpoint

    paths, good = not_checkpoints(tmp_path, data)
    torch.save(good, tmp_path / "good.pt")
    model, _ = load_checkpoint(tmp_path / "good.pt")  # the reference loads
    for path in paths:
        with pytest.raises(TrainingError) as err:
            load_checkpoint(path)
        message = str(err.value)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
    argv = ["--params", str(repo_root / "params.yaml"), "evaluate", "vsepp", "--checkpoint"]
    rest = ["--manifest", str(tmp_path / "m.parquet"), "--out", str(tmp_path / "o.json")]
    assert main([*argv, str(tmp_path / "random.pt"), *rest]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'random.pt'}: ") and err.count("\n") == 1
    assert not (tmp_path / "o.json").exists()
