"""Evaluation refuses non-finite embeddings and similarities, naming the item."""

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
