"""Checkpoints as people have them (features/detector/weights.py): each format made by torchvision's
own constructors (random init, the real key layout), loaded by `grid` and `regions`."""

import warnings

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models import detection

from features.detector.weights import WeightsError, guess_resnet, weights_digest
from features.images.config import GridConfig, RegionsConfig
from features.images.grid import build_trunk
from features.images.regions import build_detector
from infra.config import UserError

pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM")


def save(obj, path):
    torch.save(obj, path)
    return str(path)


def frozen_bn_layout(state: dict) -> dict:
    """The published detection weights come from FrozenBatchNorm2d models: no
    ``num_batches_tracked`` buffers, and a plain dict (no version metadata)."""
    return {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}


def conv5(resnet: torchvision.models.ResNet, x: torch.Tensor) -> torch.Tensor:
    return nn.Sequential(*list(resnet.children())[:-2]).eval()(x)


@pytest.mark.parametrize("depth", [18, 50, 101, 152])
def test_grid_loads_torchvision_classification_state_dicts(tmp_path, depth):
    torch.manual_seed(depth)
    resnet = getattr(torchvision.models, f"resnet{depth}")(weights=None)
    path = save(resnet.state_dict(), tmp_path / "resnet.pt")  # fc.* included, ignored
    trunk = build_trunk(GridConfig(architecture=f"resnet{depth}", weights=path))
    assert trunk.dim == (512 if depth == 18 else 2048)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(trunk(x), conv5(resnet, x))


def test_grid_takes_the_trunk_of_detection_state_dicts(tmp_path):
    torch.manual_seed(0)
    model = detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None)
    path = save(frozen_bn_layout(model.state_dict()), tmp_path / "frcnn.pt")
    trunk = build_trunk(GridConfig(architecture="resnet50", weights=path))
    for name, value in trunk.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            assert torch.equal(value, model.backbone.body.state_dict()[name]), name


def test_a_file_that_does_not_fit_is_one_line_naming_param_and_architecture(tmp_path):
    path = save(torchvision.models.resnet50().state_dict(), tmp_path / "r50.pt")
    with pytest.raises(WeightsError) as err:
        build_trunk(GridConfig(weights=path))  # default architecture: resnet152
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("grid.weights: ")
    assert "resnet50 classification state dict" in message and "(resnet152)" in message
    assert "510 missing keys (layer3.* " in message and "e.g. layer2.4." in message

    junk = save({"encoder.weight": torch.zeros(3)}, tmp_path / "junk.pt")
    with pytest.raises(WeightsError, match=r"^grid\.weights: .*unknown layout.*encoder\.weight"):
        build_trunk(GridConfig(weights=junk))
    with pytest.raises(WeightsError, match=r"^regions\.weights: .*no such file"):
        build_detector(RegionsConfig(weights=str(tmp_path / "nope.pt")))


def test_pickles_are_refused_weights_only(tmp_path):
    path = tmp_path / "pickled.pt"
    torch.save({"state_dict": torch.nn.Linear(2, 2)}, path)  # a module, not tensors
    with pytest.raises(WeightsError, match=r"^grid\.weights: .*not a weights-only"):
        build_trunk(GridConfig(weights=str(path)))


@pytest.mark.parametrize("arch", ["resnet50_fpn", "resnet50_fpn_v2"])
def test_regions_loads_torchvision_detection_state_dicts(tmp_path, arch):
    torch.manual_seed(0)
    model = getattr(detection, f"fasterrcnn_{arch}")(weights=None, weights_backbone=None)
    path = save(frozen_bn_layout(model.state_dict()), tmp_path / "frcnn.pt")
    loaded = build_detector(RegionsConfig(architecture=arch, weights=path))  # 91 classes, from it
    assert loaded.roi_heads.box_predictor.cls_score.out_features == 91
    ours = loaded.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(ours[name], value), name
    with pytest.raises(WeightsError, match=r"^regions\.num_classes is 1601 but .* says 91"):
        build_detector(RegionsConfig(architecture=arch, num_classes=1601, weights=path))
    other = "resnet50_fpn" if arch.endswith("v2") else "resnet50_fpn_v2"
    with pytest.raises(WeightsError) as err:
        build_detector(RegionsConfig(architecture=other, weights=path))
    assert "\n" not in str(err.value) and f"({other})" in str(err.value)
    expected = "FPN_v2 detection" if arch.endswith("v2") else "FPN detection"
    assert f"resnet50 {expected}" in str(err.value)


def test_imagenet_weights_initialise_the_c4_trunk_and_res5_head(tmp_path):
    torch.manual_seed(1)
    resnet = torchvision.models.resnet101(weights=None)
    path = save(resnet.state_dict(), tmp_path / "r101.pt")
    with pytest.warns(UserWarning, match="RPN and the box predictor are RANDOM"):
        model = build_detector(RegionsConfig(architecture="resnet101_c4", weights=path))
    assert torch.equal(model.backbone.body.layer3[22].conv3.weight, resnet.layer3[22].conv3.weight)
    assert torch.equal(model.roi_heads.box_head.layer4[2].bn3.bias, resnet.layer4[2].bn3.bias)
    assert model.roi_heads.box_predictor.cls_score.out_features == 1601
    # the project's C4 detector, saved, loads back as a detection state dict
    again = save(model.state_dict(), tmp_path / "c4.pt")
    reloaded = build_detector(RegionsConfig(architecture="resnet101_c4", weights=again))
    assert torch.equal(reloaded.rpn.head.cls_logits.weight, model.rpn.head.cls_logits.weight)
    # and its trunk (body + res5 head) is a grid trunk
    trunk = build_trunk(GridConfig(architecture="resnet101", weights=again))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(trunk(x), conv5(resnet, x))


def training_checkpoint(state: dict, model: nn.Module) -> dict:
    """What training scripts save: the weights beside the optimiser's state and the epoch."""
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"epoch": 3, "model": state, "optimizer": optimiser.state_dict()}


WRAPPERS = {
    "model": lambda state, model: {"model": state},
    "state_dict": lambda state, model: {"state_dict": state},
    "training checkpoint": training_checkpoint,
    "model, then state_dict": lambda state, model: {"model": {"state_dict": state}},
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapped_state_dicts_load_as_the_state_dict_they_hold(tmp_path, wrapper):
    wrap = WRAPPERS[wrapper]
    torch.manual_seed(5)
    resnet = torchvision.models.resnet18(weights=None).eval()
    path = save(wrap(resnet.state_dict(), resnet), tmp_path / "resnet.pt")
    trunk = build_trunk(GridConfig(architecture="resnet18", weights=path))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(trunk(x), conv5(resnet, x))
    # regions: the same file initialises a detector's trunk; a wrapped detection state
    # dict loads whole, its class count read through the wrapper
    with pytest.warns(UserWarning, match="RPN and the box predictor are RANDOM"):
        model = build_detector(RegionsConfig(architecture="resnet18_fpn", weights=path))
    assert torch.equal(model.backbone.body.layer4[1].conv2.weight, resnet.layer4[1].conv2.weight)
    torch.manual_seed(6)
    frcnn = detection.FasterRCNN(
        detection.backbone_utils.resnet_fpn_backbone(
            backbone_name="resnet18", weights=None, trainable_layers=5
        ),
        num_classes=7,
    )
    path = save(wrap(frcnn.state_dict(), frcnn), tmp_path / "frcnn.pt")
    loaded = build_detector(RegionsConfig(architecture="resnet18_fpn", weights=path))
    assert loaded.roi_heads.box_predictor.cls_score.out_features == 7
    ours = loaded.state_dict()
    for name, value in frcnn.state_dict().items():
        assert torch.equal(ours[name], value), name


def test_torchvision_entries_resolve_from_the_local_hub_cache_only(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    entry = "torchvision:ResNet18_Weights.IMAGENET1K_V1"
    with pytest.raises(WeightsError) as err:
        build_trunk(GridConfig(architecture="resnet18", weights=entry))
    message = str(err.value)
    assert "\n" not in message and "nothing is downloaded" in message
    assert str(tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in message
    resnet = torchvision.models.resnet18(weights=None)
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    file = save(resnet.state_dict(), tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    trunk = build_trunk(GridConfig(architecture="resnet18", weights=entry))
    assert torch.equal(trunk.layer4[1].conv2.weight, resnet.layer4[1].conv2.weight)
    assert weights_digest(entry, 0) == weights_digest(file, 0)
    with pytest.raises(WeightsError, match="not a torchvision weights entry"):
        build_trunk(GridConfig(weights="torchvision:ResNet18_Weights.NOPE"))


def test_resnet_guess():
    for depth in (18, 34, 50, 101, 152):
        keys = getattr(torchvision.models, f"resnet{depth}")().state_dict()
        assert guess_resnet(keys) == f"resnet{depth}"


def test_random_init_still_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_trunk(GridConfig(architecture="resnet18"))
    assert any("RANDOM initialisation" in str(w.message) for w in caught)


def test_detectron2_pickle_weights_need_an_opt_in(tmp_path):
    """A detectron2 .pkl checkpoint is a pickle: refused before anything loads it, unless
    regions.allow_pickle_weights says its source is trusted."""
    from features.images.config import RegionsConfig
    from features.images.detectron2_backend import build_detectron2_extractor

    (tmp_path / "model.pkl").write_bytes(b"not loaded")
    cfg = RegionsConfig(
        backend="detectron2", detectron2_config="c.yaml", weights=str(tmp_path / "model.pkl")
    )
    with pytest.raises(UserError, match=r"model.pkl: a \.pkl checkpoint is a pickle"):
        build_detectron2_extractor(cfg, torch.device("cpu"))
    trusted = cfg.model_copy(update={"allow_pickle_weights": True})
    try:
        import detectron2  # noqa: F401
    except ImportError:  # past the guard, the next check is the import
        with pytest.raises(UserError, match="detectron2 is not installed"):
            build_detectron2_extractor(trusted, torch.device("cpu"))
