"""The bottom-up detector (features/detector*.py, detection_data.py): readers of the demo
manifest, COCO instances and Visual Genome files made here; the attribute loss; a CPU
training run on a tiny demo; its checkpoint read back by `regions` and `grid`; metrics;
determinism and an exact resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from detector_data import QUIET, TINY, make_demo

from features.detector.config import DetectorConfig
from features.detector.data import (
    DetectionDataError,
    DetectionImage,
    read_coco,
    read_visual_genome,
)
from features.detector.loader import DetectionItems, attribute_targets
from features.detector.metrics import (
    average_precision,
    evaluate_detector,
    plot_ap,
    voc_ap_per_class,
)
from features.detector.model import attribute_loss, build_detector_model
from features.detector.train import DetectorTrainingError, train_detector
from features.detector.weights import WeightsError
from features.images.config import GridConfig, RegionsConfig
from features.images.grid import build_trunk
from features.images.regions import RegionExtractor, build_detector


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A 12/4/2 demo at 64px: its folder, manifest and detection dataset."""
    root = tmp_path_factory.mktemp("demo")
    return root, *make_demo(root)


@pytest.fixture(scope="module")
def trained(demo, tmp_path_factory):
    root, _, data = demo
    out = tmp_path_factory.mktemp("detector")
    metrics = train_detector(data, root / "images", TINY, out, **QUIET)
    return out, metrics


# --------------------------------------------------------------------------- readers


def test_demo_manifest_reader(demo):
    root, manifest, data = demo
    assert data.classes == sorted({n for r in manifest.table.to_pylist() for n in r["box_names"]})
    assert set(data.attributes) <= {"red", "green", "blue", "yellow", "purple", "orange"} | {
        "small",
        "large",
    }
    first = data.images[0]
    raw = json.loads((root / "dataset.json").read_text())["images"][0]
    np.testing.assert_allclose(first.boxes, raw["boxes"], rtol=1e-6)
    assert first.names == raw["box_names"]
    assert first.attributes == [[o["color"], o["size"]] for o in raw["objects"]]
    assert {im.split for im in data.images} == {"train", "val", "test"}


def coco_files(tmp_path, demo_root):
    """COCO instances JSON over the demo's images: train (with a crowd and a degenerate
    box) and val files; category ids are not contiguous, as COCO's are not."""
    raw = json.loads((demo_root / "dataset.json").read_text())["images"]
    names = sorted({n for im in raw for n in im["box_names"]})
    categories = [{"id": 10 + 2 * i, "name": n} for i, n in enumerate(names)]
    cat_id = {c["name"]: c["id"] for c in categories}
    files = {}
    for split in ("train", "val"):
        images, annotations = [], []
        for im in raw:
            if im["split"] != split:
                continue
            image_id = int(im["filename"][-9:-4]) + (0 if split == "train" else 1000)
            images.append({"id": image_id, "file_name": im["filename"], "width": 64})
            for box, name in zip(im["boxes"], im["box_names"], strict=True):
                x1, y1, x2, y2 = box
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": image_id,
                        "bbox": [x1, y1, x2 - x1, y2 - y1],
                        "category_id": cat_id[name],
                        "iscrowd": 0,
                    }
                )
        if split == "train":
            first = images[0]["id"]
            annotations.append(
                {"image_id": first, "bbox": [0, 0, 9, 9], "category_id": 10, "iscrowd": 1}
            )
            annotations.append({"image_id": first, "bbox": [5, 5, 0, 4], "category_id": 10})
        path = tmp_path / f"instances_{split}.json"
        path.write_text(
            json.dumps({"images": images, "annotations": annotations, "categories": categories})
        )
        files[split] = path
    return files, names


def test_coco_reader(tmp_path, demo):
    root, _, data = demo
    files, names = coco_files(tmp_path, root)
    coco = read_coco(files["train"], files["val"], TINY)
    assert coco.classes == names and coco.attributes == []
    assert coco.dropped == {"crowd_boxes": 1, "degenerate_boxes": 1}
    assert len(coco.split("train")) == 12 and len(coco.split("val")) == 4
    by_key = {im.key: im for im in coco.images}
    for im in data.split("train") + data.split("val"):
        np.testing.assert_allclose(by_key[im.key].boxes, im.boxes, atol=1e-4)
        assert by_key[im.key].names == im.names and by_key[im.key].attributes is None
    # without a val file, a seeded hash holds out part of train
    held = read_coco(files["train"], None, TINY.model_copy(update={"val_fraction": 0.5}))
    assert 0 < len(held.split("val")) < 12
    again = read_coco(files["train"], None, TINY.model_copy(update={"val_fraction": 0.5}))
    assert [im.split for im in again.images] == [im.split for im in held.images]
    (tmp_path / "bad.json").write_text('{"images": []}')
    with pytest.raises(DetectionDataError, match=r"bad\.json: expected COCO instances"):
        read_coco(tmp_path / "bad.json", None, TINY)


def test_visual_genome_reader(tmp_path):
    objects = [
        {
            "image_id": 1,
            "objects": [
                {"object_id": 11, "names": ["Man "], "x": 1, "y": 2, "w": 10, "h": 20},
                {"object_id": 12, "names": ["shirt"], "x": 3, "y": 4, "w": 5, "h": 5},
                {"object_id": 13, "names": ["unicorn"], "x": 0, "y": 0, "w": 3, "h": 3},
            ],
        },
        {
            "image_id": 2,
            "objects": [
                {"object_id": 21, "names": ["man"], "x": 0, "y": 0, "w": 8, "h": 8},
                {"object_id": 22, "names": ["shirt"], "x": 0, "y": 0, "w": 0, "h": 8},
            ],
        },
        {
            "image_id": 3,
            "objects": [{"object_id": 31, "names": ["unicorn"], "x": 0, "y": 0, "w": 4, "h": 4}],
        },
    ]
    attributes = [
        {
            "image_id": 1,
            "attributes": [
                {"object_id": 11, "attributes": ["Tall", "smiling"]},
                {"object_id": 12, "attributes": ["red", "striped", "red"]},
            ],
        },
        {"image_id": 2, "attributes": [{"object_id": 21, "attributes": ["tall"]}]},
    ]
    (tmp_path / "objects.json").write_text(json.dumps(objects))
    (tmp_path / "attributes.json").write_text(json.dumps(attributes))
    (tmp_path / "images" / "VG_100K_2").mkdir(parents=True)
    (tmp_path / "images" / "VG_100K_2" / "2.jpg").write_bytes(b"")
    cfg = TINY.model_copy(update={"max_classes": 2, "max_attributes": 3, "val_fraction": 0.0})
    vg = read_visual_genome(
        tmp_path / "objects.json", tmp_path / "attributes.json", cfg, tmp_path / "images"
    )
    # man (2) and shirt (1) beat unicorn (2, but 'unicorn' < 'shirt' loses on... count ties
    # break by name): man 2, unicorn 2, shirt 1 -> man, unicorn
    assert vg.classes == ["man", "unicorn"]
    assert vg.attributes == ["smiling", "tall"]  # tall 2; red, smiling, striped 1 -> by name
    first = vg.images[0]
    assert first.key == "1" and first.path == "1.jpg" and first.names == ["man", "unicorn"]
    assert first.boxes[0] == [1.0, 2.0, 11.0, 22.0]
    assert first.attributes == [["tall", "smiling"], []]
    assert vg.images[1].path == "VG_100K_2/2.jpg" and vg.images[1].attributes == [["tall"]]
    assert vg.dropped == {"degenerate_boxes": 1, "rare_class_boxes": 1}


def test_items_are_resized_flipped_and_drop_what_cannot_train(demo):
    root, _, data = demo
    image = data.images[0]
    odd = DetectionImage(
        image.key,
        image.path,
        "train",
        [[10.0, 10.0, 30.0, 20.0], [70.0, 5.0, 90.0, 9.0], [1.0, 1.0, 5.0, 5.0]],
        [data.classes[0], data.classes[1], "not a class"],
        [["red"], ["blue"], []],
    )
    cfg = TINY.model_copy(update={"min_side": 128, "max_side": 128})  # 64px images, x2
    items = DetectionItems([odd], root / "images", cfg, data.classes, data.attributes)
    plain = items[(0, False)]["target"]
    assert plain["boxes"].tolist() == [[20.0, 20.0, 60.0, 40.0]]  # outside / unknown: gone
    assert plain["labels"].tolist() == [1] and plain["attributes"].shape == (1, 9)
    flipped = items[(0, True)]
    assert flipped["target"]["boxes"].tolist() == [[68.0, 20.0, 108.0, 40.0]]
    assert torch.equal(flipped["image"], items[(0, False)]["image"].flip(2))


# --------------------------------------------------------------------------- model


def test_attribute_loss_is_cross_entropy_with_the_uniform_target():
    logits = torch.randn(3, 5)
    targets = attribute_targets([["a", "c"], [], ["d"]], ["a", "b", "c", "d"])
    assert targets.tolist() == [[0, 0.5, 0, 0.5, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    by_hand = (
        0.5
        * (
            F.cross_entropy(logits[:1], torch.tensor([1]))
            + F.cross_entropy(logits[:1], torch.tensor([3]))
        )
        + F.cross_entropy(logits[1:2], torch.tensor([0]))
        + F.cross_entropy(logits[2:], torch.tensor([4]))
    ) / 3
    torch.testing.assert_close(attribute_loss(logits, targets), by_hand)


def test_training_forward_has_the_attribute_term(demo):
    root, _, data = demo
    torch.manual_seed(0)
    model = build_detector_model(TINY, len(data.classes) + 1, len(data.attributes)).train()
    images = torch.randn(2, 3, 64, 64)
    from torchvision.models.detection.image_list import ImageList

    batch = ImageList(images, [(64, 64)] * 2)
    targets = [
        {
            "boxes": torch.tensor([[4.0, 4.0, 30.0, 30.0]]),
            "labels": torch.tensor([1]),
            "attributes": attribute_targets([["red", "small"]], data.attributes),
        }
    ] * 2
    features = model.backbone(images)
    assert list(features) == ["0", "1", "2"]  # P2..P4
    proposals, rpn_losses = model.rpn(batch, features, targets)
    _, losses = model.roi_heads(features, proposals, batch.image_sizes, targets)
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_attribute"}
    assert set(rpn_losses) == {"loss_objectness", "loss_rpn_box_reg"}
    assert torch.isfinite(losses["loss_attribute"])


def test_image_head_learns_class_cover_and_attributes(demo):
    """The demo's stand-in for ImageNet pretraining, on pooled conv5: softmax
    cross-entropy against the area-weighted class distribution, BCE on attributes."""
    from features.detector.train import _losses

    root, _, data = demo
    cfg = TINY.model_copy(update={"image_loss_weight": 1.0})
    torch.manual_seed(0)
    model = build_detector_model(cfg, len(data.classes) + 1, len(data.attributes)).train()
    items = DetectionItems(data.split("train"), root / "images", cfg, data.classes, data.attributes)
    batch = [items[(i, False)] for i in range(2)]
    losses = _losses(model, [b["image"] for b in batch], [b["target"] for b in batch])
    conv5 = model.backbone.body(torch.stack([b["image"] for b in batch]))["3"]
    logits = model.image_head(conv5)  # (2, classes + attributes)
    n = len(data.classes)
    cover, present = torch.zeros(2, n), torch.zeros(2, len(data.attributes))
    for i, record in enumerate(data.split("train")[:2]):
        for box, name, attrs in zip(record.boxes, record.names, record.attributes, strict=True):
            cover[i, data.classes.index(name)] += (box[2] - box[0]) * (box[3] - box[1])
            for a in attrs:
                present[i, data.attributes.index(a)] = 1
    cover /= cover.sum(dim=1, keepdim=True)
    expected = -(cover * F.log_softmax(logits[:, :n], dim=1)).sum(1).mean()
    expected = expected + F.binary_cross_entropy_with_logits(logits[:, n:], present)
    torch.testing.assert_close(losses["loss_image"], expected)
    with pytest.raises(ValueError, match="image_loss_weight needs an FPN"):
        DetectorConfig(architecture="resnet18_c4", image_loss_weight=1.0)


# --------------------------------------------------------------------------- training


def test_checkpoint_is_plain_data_and_regions_and_grid_load_it(demo, trained):
    root, manifest, data = demo
    out, metrics = trained
    ckpt = torch.load(out / "detector.pt", weights_only=True)
    assert ckpt["format"] == "vse-detector" and ckpt["version"] == 1
    assert ckpt["classes"] == data.classes and ckpt["attributes"] == data.attributes
    assert ckpt["config"]["architecture"] == "resnet18_fpn"
    assert any(k.startswith("roi_heads.attribute_head.") for k in ckpt["state_dict"])
    # regions: architecture, classes and the attribute head come from the checkpoint
    cfg = RegionsConfig(
        weights=str(out / "detector.pt"),
        min_side=64,
        max_side=64,
        proposals=20,
        min_boxes=1,
        max_boxes=5,
        num_workers=0,
    )
    model = build_detector(cfg)
    assert model.roi_heads.box_predictor.cls_score.out_features == len(data.classes) + 1
    assert model.rpn.post_nms_top_n() == 20  # regions.proposals overrides the checkpoint
    for key, value in ckpt["state_dict"].items():
        assert torch.equal(model.state_dict()[key], value), key
    extractor = RegionExtractor(model, cfg, torch.device("cpu"))
    row = manifest.table.to_pylist()[0]
    from PIL import Image

    image = Image.open(root / "images" / row["path"]).convert("RGB")
    out_row = extractor([extractor.prepare(image, row)])[0]
    assert out_row["features"].shape == (5, 32) and 1 <= out_row["n_regions"] <= 5
    with pytest.raises(WeightsError) as err:
        build_detector(cfg.model_copy(update={"architecture": "resnet50_c4"}))
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("regions.architecture is 'resnet50_c4' but ")
    with pytest.raises(WeightsError, match=r"^regions\.num_classes is 5 but .* says 7"):
        build_detector(cfg.model_copy(update={"num_classes": 5}))
    # grid: the detector's trunk, resnet18 at full depth (512-d conv5)
    trunk = build_trunk(GridConfig(weights=str(out / "detector.pt")))
    assert trunk.architecture == "resnet18" and trunk.dim == 512
    assert torch.equal(trunk.layer4[1].conv2.weight, model.backbone.body.layer4[1].conv2.weight)
    with pytest.raises(WeightsError, match=r"^grid\.architecture is 'resnet50' but .*resnet18"):
        build_trunk(GridConfig(architecture="resnet50", weights=str(out / "detector.pt")))


def test_metrics_are_plain_deterministic_data(trained, demo, tmp_path):
    root, _, data = demo
    out, metrics = trained
    assert metrics["val_images"] == 4 and metrics["train_images"] == 12
    for key in ("map50", "recall", "proposal_recall", "class_accuracy", "attribute_accuracy"):
        assert 0.0 <= metrics[key] <= 1.0, key
    assert set(metrics["ap50"]) <= set(data.classes)
    text = json.dumps(metrics)
    assert "second" not in text and "/s" not in text  # no timings
    plot_ap(metrics, tmp_path / "a.png")
    plot_ap(metrics, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_voc_ap_by_hand():
    assert average_precision(np.array([0.5, 1.0]), np.array([1.0, 0.5])) == pytest.approx(0.75)
    box = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    truths = [
        {"boxes": box, "labels": torch.tensor([1])},
        {"boxes": box, "labels": torch.tensor([1])},
    ]
    detections = [
        {
            "boxes": torch.cat([box, box]),
            "labels": torch.tensor([1, 1]),
            "scores": torch.tensor([0.9, 0.8]),
        },  # the duplicate is a false positive
        {"boxes": box + 50, "labels": torch.tensor([1]), "scores": torch.tensor([0.95])},
    ]
    # ranked: miss (0.95), hit (0.9), duplicate (0.8): precision 0, 1/2, 1/3; recall 0, .5, .5
    assert voc_ap_per_class(detections, truths, 3, 0.5) == {1: pytest.approx(0.25)}


def test_average_precision_is_the_area_under_the_precision_envelope():
    # TP, FP, TP, TP of 3 ground truths: recall 1/3, 1/3, 2/3, 1; precision 1, 1/2, 2/3, 3/4;
    # the envelope raises 2/3 to 3/4: 1/3 x 1 + 1/3 x 3/4 + 1/3 x 3/4
    recall = np.array([1, 1, 2, 3]) / 3
    precision = np.array([1, 1 / 2, 2 / 3, 3 / 4])
    assert average_precision(recall, precision) == pytest.approx(5 / 6, abs=1e-12)
    # recall that stops short of 1 adds nothing past its last point
    assert average_precision(np.array([0.5]), np.array([1.0])) == pytest.approx(0.5)
    assert average_precision(np.array([0.0, 0.5]), np.array([0.0, 0.5])) == pytest.approx(0.25)


class FakeDetector:
    """A stand-in for the detector whose outputs the test sets: per image (in order) its
    proposals and detections, and per ground-truth box (looked up by its coordinates) the
    class logits and attribute probabilities of the box head."""

    def __init__(self, proposals, detections, logits, attribute_probs, with_attributes=True):
        self.proposals, self.detections = list(proposals), list(detections)
        self.logits, self.attribute_probs = logits, attribute_probs
        self.backbone = lambda x: x  # a plain map: evaluate_detector wraps it as {"0": x}
        self.roi_heads = self
        self.box_roi_pool = lambda features, boxes, sizes: torch.cat(boxes)  # (G, 4)
        self.box_head = lambda pooled: pooled
        self.box_predictor = self
        self.attribute_head = object() if with_attributes else None
        self.labels_seen = []

    def eval(self):
        return self

    def rpn(self, images, features):
        assert list(features) == ["0"]
        return [self.proposals.pop(0) for _ in images.image_sizes], {}

    def __call__(self, features, proposals, sizes):  # the RoI heads
        return [self.detections.pop(0) for _ in proposals], {}

    def cls_score(self, pooled):
        return torch.tensor([self.logits[tuple(b.tolist())] for b in pooled])

    def attributes(self, pooled, labels):
        self.labels_seen += labels.tolist()
        return torch.tensor([self.attribute_probs[tuple(b.tolist())] for b in pooled])


def detections(*rows):
    """(label, score, box) rows -> a torchvision detection dict."""
    return {
        "boxes": torch.tensor([r[2] for r in rows], dtype=torch.float32).reshape(-1, 4),
        "labels": torch.tensor([r[0] for r in rows], dtype=torch.long),
        "scores": torch.tensor([r[1] for r in rows], dtype=torch.float32),
    }


def test_detector_metrics_by_hand(tmp_path):
    """Every metric of evaluate_detector on a case worked out by hand (VOC matching as in
    the devkit's VOCevaldet.m: IoU >= 0.5 with the best-overlapping ground truth of the
    class, each ground truth matched once; all-points AP)."""
    from PIL import Image

    classes, attributes = ["cat", "dog", "cow"], ["red", "big"]
    for k in range(5):
        Image.new("RGB", (64, 64), (40 * k, 90, 200)).save(tmp_path / f"im{k}.png")
    (tmp_path / "im3.png").write_bytes(b"not an image")  # skipped, like a bad image
    A, B, C = [0, 0, 10, 10], [30, 0, 40, 10], [20, 20, 30, 30]
    D, F_ = [40, 40, 60, 60], [0, 40, 20, 60]
    images = [
        DetectionImage("0", "im0.png", "val", [A], ["cat"], [["red"]]),
        DetectionImage("1", "im1.png", "val", [B, C], ["cat", "cat"], [["red", "big"], []]),
        DetectionImage(  # the unicorn is no class: not evaluated
            "2",
            "im2.png",
            "val",
            [D, [5, 5, 15, 15], F_],
            ["dog", "unicorn", "dog"],
            [["big"], ["red"], ["red"]],
        ),
        DetectionImage("3", "im3.png", "val", [[0, 0, 5, 5]], ["cat"], [[]]),
        DetectionImage("4", "im4.png", "val", [], [], []),
    ]
    proposals = [  # of the 4 readable images
        torch.tensor([[0.0, 0, 10, 5]]),  # IoU with A exactly 0.5: found
        torch.zeros(0, 4),  # none: B and C missed
        torch.tensor([[40.0, 40, 60, 60], [0, 40, 20, 60]]),
        torch.tensor([[1.0, 1, 2, 2]]),
    ]
    found = [
        # cat: IoU 0.5 with A (TP); A again (FP, matched already); dog where there is none
        detections((1, 0.9, [0, 0, 10, 5]), (1, 0.7, A), (2, 0.4, D)),
        # cat: IoU 0.4 with B (FP); C (TP); a cow on B (no cow ground truth anywhere)
        detections((1, 0.85, [30, 0, 40, 4]), (1, 0.8, C), (3, 0.99, B)),
        # a cat on the dog D (FP for cat); the dog D, tied with image 0's FP, ranked after it
        detections((1, 0.6, D), (2, 0.4, D)),
        detections(),
    ]
    logits = {  # columns: background, cat, dog, cow
        tuple(map(float, A)): [5.0, 1, 0, 0],  # background first, cat among the classes: hit
        tuple(map(float, B)): [0.0, 0, 2, 0],  # dog: miss
        tuple(map(float, C)): [0.0, 3, 0, 0],  # cat: hit
        tuple(map(float, D)): [0.0, 0, 1, 1],  # dog and cow tie: the first, dog: hit
        tuple(map(float, F_)): [0.0, 0, 0, 4],  # cow: miss
    }
    probs = {  # columns: none, red, big
        tuple(map(float, A)): [0.1, 0.2, 0.7],  # red; top-1 big: 0
        tuple(map(float, B)): [0.5, 0.3, 0.2],  # red, big; top-2 of red, big: 1
        tuple(map(float, C)): [0.8, 0.1, 0.1],  # no attribute: not counted
        tuple(map(float, D)): [0.6, 0.1, 0.3],  # big; top-1 without "none": big: 1
        tuple(map(float, F_)): [0.2, 0.5, 0.3],  # red: 1
    }
    cfg = TINY.model_copy(update={"num_workers": 0})
    bars = []

    class Bar:
        def __init__(self, total):
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    model = FakeDetector(proposals, found, logits, probs)
    metrics = evaluate_detector(
        model, images, tmp_path, cfg, classes, attributes, batch_size=2, progress=Bar
    )
    # cat (3 ground truths): TP .9, FP .85, TP .8, FP .7, FP .6: precision 1, 1/2, 2/3, ...
    # at recall 1/3, 1/3, 2/3, ...: AP 1/3 + 1/3 x 2/3 = 5/9
    # dog (2): FP .4 (image 0), TP .4 (image 2): AP 1/2 x 1/2 = 1/4; cow: no ground truth
    assert metrics == {
        "val_images": 4,
        "val_boxes": 5,
        "map50": pytest.approx((5 / 9 + 1 / 4) / 2, abs=1e-6),
        "recall": pytest.approx(4 / 5),  # F alone is missed (B found by the cow)
        "proposal_recall": pytest.approx(3 / 5),  # A (IoU 0.5), D, F
        "class_accuracy": pytest.approx(3 / 5),  # A, C, D
        "ap50": {"cat": pytest.approx(5 / 9, abs=1e-6), "dog": pytest.approx(1 / 4)},
        "attribute_accuracy": pytest.approx(3 / 4),  # A 0, B 1, D 1, F 1
    }
    assert model.labels_seen == [1, 1, 1, 2, 2]  # attributes given the true classes
    assert [(b.total, b.done, b.closed) for b in bars] == [(5, 5, True)]
    # without attributes: the same, and no attribute accuracy
    model = FakeDetector(proposals, found, logits, probs, with_attributes=False)
    plain = evaluate_detector(model, images, tmp_path, cfg, classes, [], batch_size=3)
    assert plain == {k: v for k, v in metrics.items() if k != "attribute_accuracy"}


def test_voc_ap_and_recall_by_hand_at_the_iou_boundary():
    from features.detector.metrics import _recall

    gt = [torch.tensor([[0.0, 0, 10, 10]]), torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]])]
    found = [torch.tensor([[0.0, 0, 10, 5]]), torch.tensor([[0.0, 0, 10, 4]])]
    assert _recall(gt, found, 0.5) == pytest.approx(1 / 3)  # IoU 0.5 counts, 0.4 does not
    assert _recall(gt, found, 0.4) == pytest.approx(2 / 3)
    assert _recall(gt, [torch.zeros(0, 4), torch.zeros(0, 4)], 0.5) == 0.0
    assert _recall([torch.zeros(0, 4)], [torch.zeros(0, 4)], 0.5) == 0.0
    assert _recall(gt[:1], gt[:1], 0.5) == 1.0  # one box, found
    truths = [{"boxes": g, "labels": torch.ones(len(g), dtype=torch.long)} for g in gt]
    dets = [
        {"boxes": f, "labels": torch.tensor([1]), "scores": torch.tensor([s])}
        for f, s in zip(found, (0.9, 0.8), strict=True)
    ]
    # TP then FP of 3 ground truths: AP 1/3; at IoU 0.4 both hit: 2/3
    assert voc_ap_per_class(dets, truths, 2, 0.5) == {1: pytest.approx(1 / 3)}
    assert voc_ap_per_class(dets, truths, 2, 0.4) == {1: pytest.approx(2 / 3)}
    # the same as class 2 of 3: class 1, without ground truth, is left out, not the end
    for d in [*truths, *dets]:
        d["labels"] = d["labels"] + 1
    assert voc_ap_per_class(dets, truths, 3, 0.5) == {2: pytest.approx(1 / 3)}


def test_a_coco_file_trains_a_detector_without_attributes(tmp_path, demo):
    root, _, _ = demo
    files, names = coco_files(tmp_path, root)
    coco = read_coco(files["train"], files["val"], TINY)
    cfg = TINY.model_copy(update={"epochs": 1})
    metrics = train_detector(coco, root / "images", cfg, tmp_path / "out", **QUIET)
    assert "attribute_accuracy" not in metrics and metrics["data"]["dataset"] == "coco"
    ckpt = torch.load(tmp_path / "out" / "detector.pt", weights_only=True)
    assert ckpt["attributes"] == [] and ckpt["classes"] == names
    assert not any(k.startswith("roi_heads.attribute_head.") for k in ckpt["state_dict"])
    path = str(tmp_path / "out" / "detector.pt")
    model = build_detector(RegionsConfig(weights=path, proposals=cfg.rpn_post_nms_test))
    found = evaluate_detector(model, coco.split("val"), root / "images", cfg, names, [])
    assert found["map50"] == metrics["map50"]


def test_too_little_data_is_one_line(tmp_path, demo):
    root, _, data = demo
    with pytest.raises(DetectorTrainingError, match="cannot fill one batch of 64"):
        train_detector(
            data, root / "images", TINY.model_copy(update={"batch_size": 64}), tmp_path, **QUIET
        )


JOB = """
import sys
from pathlib import Path
from features.detector.data import read_manifest_boxes
from features.detector.train import train_detector
from features.ingest.manifest import read_manifest
from features.detector.config import DetectorConfig
root, out = Path(sys.argv[1]), Path(sys.argv[2])
cfg = DetectorConfig.model_validate_json(sys.argv[3])
data = read_manifest_boxes(read_manifest(root / "manifest.parquet"), cfg)
train_detector(data, root / "images", cfg, out, resume="--resume" in sys.argv, log=print)
"""


def test_same_inputs_same_bytes_and_a_killed_run_resumes_exactly(demo, trained, tmp_path):
    """Two runs give byte-identical checkpoints; a run killed after its first epoch,
    rerun with --resume, ends with the same detector.pt bytes as an uninterrupted one."""
    root, _, data = demo
    first, _ = trained
    again = tmp_path / "again"
    train_detector(data, root / "images", TINY, again, **QUIET)
    assert (again / "detector.pt").read_bytes() == (first / "detector.pt").read_bytes()
    assert (again / "last.pt").read_bytes() == (first / "last.pt").read_bytes()

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    cfg = TINY.model_copy(update={"epochs": 3})
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    run = [sys.executable, "-W", "ignore", "-c", JOB, str(root)]
    subprocess.run(
        [*run, str(clean), cfg.model_dump_json()], check=True, env=env, capture_output=True
    )
    proc = subprocess.Popen(
        [*run, str(killed), cfg.model_dump_json()], env=env, stdout=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not (killed / "last.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "detector.pt").exists()
    done = torch.load(killed / "last.pt", weights_only=True)["epoch"]
    assert done < 2
    resumed = subprocess.run(
        [*run, str(killed), cfg.model_dump_json(), "--resume"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    assert f"resuming from {killed / 'last.pt'} after epoch {done}" in resumed.stdout
    assert (killed / "detector.pt").read_bytes() == (clean / "detector.pt").read_bytes()
    # another config refuses to resume
    with pytest.raises(DetectorTrainingError, match="another config"):
        train_detector(
            data, root / "images", cfg.model_copy(update={"lr": 0.5}), killed, resume=True, **QUIET
        )


@pytest.mark.parametrize("damage", ["truncated", "pickled code"])
def test_resume_from_a_damaged_last_pt_is_one_line(demo, trained, tmp_path, damage):
    """The detector reads ``last.pt`` as `vse evaluate` reads checkpoints: plain data only
    (pickled code is never run), anything else one line naming the file."""
    import shutil

    root, _, data = demo
    out = tmp_path / "out"
    shutil.copytree(trained[0], out)
    last = out / "last.pt"
    if damage == "truncated":
        last.write_bytes(last.read_bytes()[:4096])
    else:
        torch.save({"x": _Mkdir(tmp_path / "ran")}, last)
    with pytest.raises(DetectorTrainingError) as err:
        train_detector(data, root / "images", TINY, out, resume=True, **QUIET)
    assert "\n" not in str(err.value) and str(last) in str(err.value)
    assert "without --resume" in str(err.value) and not (tmp_path / "ran").exists()


class _Mkdir:
    """Pickled, its loading would run ``os.mkdir(path)``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))
