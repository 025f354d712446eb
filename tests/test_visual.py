"""Visual extractors with random-init weights on small images (no downloads)."""

import collections
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import yaml
from demo_data import demo_manifest
from PIL import Image
from torchvision.ops import batched_nms, box_iou, nms, roi_align

from features.detector.inputs import to_tensor
from features.images.config import GridConfig, RegionsConfig
from features.images.extract import extract_images
from features.images.global_features import extract_global, fit_pca, project
from features.images.grid import GridExtractor, build_trunk
from features.images.regions import RegionExtractor, build_detector
from features.images.report import region_recall, report_bad_images
from features.images.select import _max_conf_from, butd_select
from features.ingest.manifest import Dataset, Record, read_manifest, write_manifest
from features.store.layout import incomplete_path
from features.store.reader import Store
from features.store.spec import FieldSpec, StoreConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_images import make_corpus  # noqa: E402

CPU = torch.device("cpu")
LAYOUT = StoreConfig(samples_per_shard=4, samples_per_chunk=2)
pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM initialisation")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A 10/3/3 demo dataset at 64px and its manifest."""
    root = tmp_path_factory.mktemp("demo")
    return root, demo_manifest(root, n_train=10, n_val=3, n_test=3, image_size=64)


def given_cfg(**kw):
    return RegionsConfig(
        backend="given",
        architecture="resnet50_c4",
        num_classes=7,
        min_side=64,
        max_side=64,
        max_boxes=6,
        min_boxes=0,
        num_workers=0,
        **kw,
    )


def test_given_box_features_are_roi_align_on_the_backbone_map(demo, tmp_path):
    root, manifest = demo
    cfg = given_cfg()
    extractor = RegionExtractor(build_detector(cfg), cfg, CPU)
    extract_images(extractor, manifest, root / "images", tmp_path / "r.zarr", cfg, LAYOUT)
    store = Store.open(tmp_path / "r.zarr", kind="regions", manifest_digest=manifest.digest)
    rows = manifest.table.to_pylist()
    assert store.fields["features"].shape == (6, 2048) and store.fields["boxes"].dtype == "float32"
    model = extractor.model
    for i in (0, 7):
        sample, row = store[i], rows[i]
        n = len(row["boxes"])
        assert sample["n_regions"] == n and sample["valid"] == 1
        assert tuple(sample["image_hw"]) == (64, 64)
        np.testing.assert_allclose(sample["boxes"][:n], row["boxes"], rtol=1e-6)
        assert not sample["features"][n:].any() and (sample["classes"][:n] == -1).all()
        image = to_tensor(Image.open(root / "images" / row["path"]).convert("RGB"))[None]
        with torch.no_grad():
            fmap = model.backbone(image)
            rois = roi_align(
                fmap,
                [torch.tensor(row["boxes"])],
                output_size=14,
                spatial_scale=1 / 16,
                sampling_ratio=0,
            )
            expected = model.roi_heads.box_head(rois).numpy()
        np.testing.assert_allclose(
            sample["features"][:n].astype(np.float32), expected, rtol=2e-3, atol=2e-3
        )
    # with ground-truth boxes in the manifest, the stage reports how well regions cover them
    coverage = region_recall(tmp_path / "r.zarr", manifest)
    counts = [len(r["boxes"]) for r in rows]
    assert coverage["all"] == {
        "images": len(rows),
        "regions_per_image": round(sum(counts) / len(rows), 4),
        "gt_boxes": sum(counts),
        "gt_recall": 1.0,
    }
    assert coverage["val"]["images"] == 3


def test_each_box_keeps_its_own_feature(demo):
    """Region i's feature does not depend on the other boxes: order is preserved."""
    root, manifest = demo
    cfg = given_cfg()
    extractor = RegionExtractor(build_detector(cfg), cfg, CPU)
    row = manifest.table.to_pylist()[2]
    image = Image.open(root / "images" / row["path"]).convert("RGB")
    all_boxes = extractor([extractor.prepare(image, row)])[0]
    for k, box in enumerate(row["boxes"]):
        alone = extractor([extractor.prepare(image, {**row, "boxes": [box]})])[0]
        np.testing.assert_array_equal(alone["features"][0], all_boxes["features"][k])


def test_detector_regions_shapes_selection_and_determinism(demo, tmp_path):
    root, manifest = demo
    cfg = RegionsConfig(
        backend="torchvision",
        architecture="resnet50_c4",
        num_classes=5,
        min_side=64,
        max_side=64,
        proposals=12,
        min_boxes=3,
        max_boxes=5,
        num_workers=0,
        conf_threshold=0.5,
    )
    stores = []
    for run in ("a", "b"):
        extractor = RegionExtractor(build_detector(cfg), cfg, CPU)
        extract_images(extractor, manifest, root / "images", tmp_path / f"{run}.zarr", cfg, LAYOUT)
        stores.append(Store.open(tmp_path / f"{run}.zarr").read(0, len(manifest)))
    a, b = stores
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert ((a["n_regions"] >= 3) & (a["n_regions"] <= 5)).all()
    for i, n in enumerate(a["n_regions"]):
        scores = a["scores"][i, :n]
        assert (np.diff(scores) <= 0).all()  # ranked by confidence
        assert ((a["classes"][i, :n] >= 1) & (a["classes"][i, :n] <= 4)).all()
        boxes = a["boxes"][i, :n]
        assert (boxes >= -1e-3).all() and (boxes <= 64 + 1e-3).all()
        assert not a["features"][i, n:].any() and not a["boxes"][i, n:].any()  # padding


def test_butd_selection_by_hand():
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], dtype=torch.float)
    scores = torch.tensor(
        [  # background, class 1, class 2
            [0.0, 0.9, 0.1],
            [0.0, 0.8, 0.5],  # suppressed by box 0 in class 1; survives in class 2
            [0.0, 0.3, 0.0],
        ]
    )
    cfg = RegionsConfig(conf_threshold=0.4, min_boxes=0, max_boxes=10)
    keep, classes, conf = butd_select(boxes, scores, cfg)
    assert keep.tolist() == [0, 1] and classes.tolist() == [1, 2]
    assert conf.tolist() == pytest.approx([0.9, 0.5])
    keep, _, conf = butd_select(boxes, scores, cfg.model_copy(update={"min_boxes": 3}))
    assert keep.tolist() == [0, 1, 2] and conf[2] == pytest.approx(0.3)
    keep, _, _ = butd_select(boxes, scores, cfg.model_copy(update={"max_boxes": 1}))
    assert keep.tolist() == [0]
    # box 1's best score is class 2 (0.95), but box 0 suppresses it there: its confidence
    # and class are those of class 1, where it survives
    scores = torch.tensor([[0.0, 0.1, 0.99], [0.0, 0.6, 0.95], [0.0, 0.3, 0.0]])
    keep, classes, conf = butd_select(boxes, scores, cfg)
    assert keep.tolist() == [0, 1] and classes.tolist() == [2, 1]
    assert conf.tolist() == pytest.approx([0.99, 0.6])
    # background only: no class, nothing to select, whatever min_boxes asks
    keep, classes, conf = butd_select(boxes, scores[:, :1], cfg.model_copy(update={"min_boxes": 3}))
    assert (len(keep), len(classes), len(conf)) == (0, 0, 0)


def reference_butd(boxes, scores, cfg):
    """The per-class loop of bottom-up-attention's generate_tsv.py, with torchvision's nms;
    plus the class of each kept box (the first class that raised its max_conf, else its
    top-scoring class) and the ranking by max_conf (ties by index)."""
    n, c = scores.shape
    max_conf = torch.zeros(n, dtype=scores.dtype)
    best = torch.zeros(n, dtype=torch.long)
    for k in range(1, c):
        keep = nms(boxes, scores[:, k], cfg.nms_iou)
        raised = keep[scores[keep, k] > max_conf[keep]]
        max_conf[raised] = scores[raised, k]
        best[raised] = k
    n_keep = int((max_conf >= cfg.conf_threshold).sum())
    n_keep = min(max(n_keep, cfg.min_boxes), cfg.max_boxes, n)
    keep = torch.argsort(max_conf, descending=True, stable=True)[:n_keep]
    classes = torch.where(best[keep] > 0, best[keep], scores[keep, 1:].argmax(dim=1) + 1)
    return keep, classes, max_conf[keep]


def at_iou(iou: float) -> torch.Tensor:
    """Two boxes whose IoU is ``iou``: 10x10 and 10x(10 iou) sharing a corner (30/100 is
    exact in float64; 25/100 and 50/100 also in float32)."""
    return torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0 * iou]], dtype=torch.float64)


def test_nms_boundary_is_torchvisions():
    """The reference's own rule, checked here so the cases below rest on it: nms keeps a
    box whose IoU with a kept one equals the threshold, and so does butd_select."""
    for iou, dtype in ((0.5, torch.float32), (0.25, torch.float32), (0.3, torch.float64)):
        boxes = at_iou(iou).to(dtype)
        assert float(box_iou(boxes, boxes)[0, 1]) == iou
        score = torch.tensor([0.9, 0.8], dtype=dtype)
        assert nms(boxes, score, iou).tolist() == [0, 1]
        assert batched_nms(boxes, score, torch.tensor([1, 1]), iou).tolist() == [0, 1]
        cfg = RegionsConfig(nms_iou=iou, conf_threshold=0.5, min_boxes=0)
        scores = torch.stack([torch.zeros(2, dtype=dtype), score], dim=1)  # (P, 2)
        keep, classes, conf = butd_select(boxes, scores, cfg)
        assert keep.tolist() == [0, 1] and classes.tolist() == [1, 1]
        assert conf.tolist() == score.tolist()
        # a hair above the threshold, the second box is suppressed
        below = cfg.model_copy(update={"nms_iou": float(np.nextafter(iou, 0))})
        assert nms(boxes, score, below.nms_iou).tolist() == [0]
        assert butd_select(boxes, scores, below)[0].tolist() == [0]
    # float32 cannot hold 0.3: the IoU 30/100 is 0.30000001 > 0.3 and suppresses
    boxes = at_iou(0.3).float()
    scores = torch.tensor([[0.0, 0.9], [0.0, 0.8]])
    assert nms(boxes, scores[:, 1], 0.3).tolist() == [0]
    assert butd_select(boxes, scores, RegionsConfig(min_boxes=0))[0].tolist() == [0]


def random_boxes(gen, n, spread=100.0):
    xy = torch.rand(n, 2, generator=gen) * spread
    wh = torch.rand(n, 2, generator=gen) * spread / 2 + 1
    return torch.cat([xy, xy + wh], dim=1)


def butd_cases():
    """(name, boxes, scores, cfg): random and adversarial selections."""
    gen = torch.Generator().manual_seed(0)
    cfg = RegionsConfig(conf_threshold=0.2, nms_iou=0.3, min_boxes=10, max_boxes=30)
    n, c = 60, 41
    for temperature in (0.5, 3.0, 8.0):  # flat (all below threshold) to peaked softmax
        logits = torch.randn(n, c, generator=gen) * temperature
        yield f"softmax-t{temperature}", random_boxes(gen, n), logits.softmax(1), cfg
    # ties: scores on a coarse grid, so many pairs share a score, in several classes
    grid = torch.randint(0, 5, (n, c), generator=gen).float() / 8
    yield "tied scores", random_boxes(gen, n, 40), grid, cfg
    # identical boxes: only one survives per class; the min_boxes fill comes from
    # proposals suppressed in every class (max_conf 0, ranked by index)
    same = torch.tensor([[5.0, 5.0, 30.0, 30.0]]).repeat(n, 1)
    yield "identical boxes", same, torch.rand(n, c, generator=gen).softmax(1), cfg
    # one proposal wins every class: all others suppressed everywhere
    scores = torch.full((n, c), 0.01)
    scores[7] = 0.5
    yield "one winner", same, scores, cfg
    yield "all equal", random_boxes(gen, n, 30), torch.full((n, c), 1.0 / c), cfg
    # everything below threshold and few classes: the fill needs low-scoring survivors
    low = torch.rand(n, 3, generator=gen) * 0.05
    yield "all below threshold", random_boxes(gen, n, 30), low, cfg
    yield "over max_boxes", random_boxes(gen, n, 300), torch.rand(n, c, generator=gen), cfg
    yield "min_boxes > n", random_boxes(gen, 5), torch.rand(5, c, generator=gen), cfg
    yield (
        "threshold 0",
        random_boxes(gen, n),
        torch.rand(n, c, generator=gen),
        (cfg.model_copy(update={"conf_threshold": 0.0})),
    )
    yield (
        "threshold 1",
        random_boxes(gen, n),
        torch.rand(n, c, generator=gen),
        (cfg.model_copy(update={"conf_threshold": 1.0, "min_boxes": 0})),
    )
    yield "zero scores", random_boxes(gen, n, 30), torch.zeros(n, c), cfg
    # IoU at the threshold: torchvision's nms suppresses only IoU > nms_iou, so two boxes
    # whose IoU equals nms_iou both survive (see test_nms_boundary_is_torchvisions)
    for iou, dtype in ((0.5, torch.float32), (0.25, torch.float32), (0.3, torch.float64)):
        pair = at_iou(iou).to(dtype)
        boxes = torch.cat([pair, pair + 50])
        scores = torch.tensor([[0, 0.9, 0.1], [0, 0.8, 0.7]] * 2, dtype=dtype)
        at = cfg.model_copy(update={"nms_iou": iou, "min_boxes": 0})
        yield f"IoU exactly {iou} ({dtype}) = nms_iou", boxes, scores, at
    # float32 has no 0.3: the IoU 30/100 is float32(0.3) = 0.30000001 > 0.3, suppressed
    pair = at_iou(0.3).float()
    boxes = torch.cat([pair, pair + 50])
    scores = torch.tensor([[0, 0.9, 0.1], [0, 0.8, 0.7]] * 2)
    yield "IoU float32(0.3) just above nms_iou 0.3", boxes, scores, cfg
    # proposal 0 is kept only to reach min_boxes: it survives in class 1, at score 0, and
    # its class is its top-scoring one (2), as in the loop (a score 0 raises no max_conf)
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10], [50, 50, 60, 60]])
    scores = torch.tensor([[0.5, 0.0, 0.5], [0.1, 0.0, 0.9], [0.6, 0.0, 0.4]])
    yield "kept at score 0", boxes, scores, cfg.model_copy(update={"min_boxes": 3})
    # max_conf exactly conf_threshold: kept (>=), like the loop's max_conf >= threshold
    scores = torch.tensor([[0.0, 0.5, 0.25], [0.0, 0.25, 0.5], [0.0, 0.5, 0.0]])
    at = cfg.model_copy(update={"conf_threshold": 0.5, "min_boxes": 0})
    yield "max_conf = conf_threshold", random_boxes(gen, 3, 300), scores, at
    logits = torch.randn(n, c, generator=gen, dtype=torch.float64) * 3
    yield "float64", random_boxes(gen, n).double(), logits.softmax(1), cfg
    low = torch.rand(n, 3, generator=gen, dtype=torch.float64) * 0.05
    yield "float64, all below threshold", random_boxes(gen, n, 30).double(), low, cfg
    yield "no proposals", torch.zeros(0, 4), torch.zeros(0, c), cfg
    empty = torch.zeros(0, 4, dtype=torch.float64)
    yield "no proposals, float64", empty, torch.zeros(0, c, dtype=torch.float64), cfg


@pytest.mark.parametrize("case", list(butd_cases()), ids=lambda case: case[0])
def test_fast_butd_selection_equals_the_per_class_loop(case):
    _, boxes, scores, cfg = case
    keep, classes, conf = butd_select(boxes, scores, cfg)
    ref_keep, ref_classes, ref_conf = reference_butd(boxes, scores, cfg)
    assert keep.tolist() == ref_keep.tolist()
    assert classes.tolist() == ref_classes.tolist()
    assert conf.tolist() == ref_conf.tolist()  # bit for bit
    assert (keep.dtype, classes.dtype, conf.dtype) == (torch.long, torch.long, scores.dtype)


def test_max_conf_marks_proposals_without_a_positive_surviving_score():
    """_max_conf_from on its own: proposal 0 is suppressed by 1 in class 1 and scores 0 in
    class 2 (survives there, but a 0 is no confidence): max_conf 0, class -1."""
    fg = torch.tensor([[0.8, 0.0], [0.9, 0.0], [0.0, 0.3]])  # (P, C - 1)
    over = torch.tensor([[False, True, False], [True, False, False], [False, False, False]])
    max_conf, best = _max_conf_from(fg, over, 0.0)
    assert max_conf.tolist() == pytest.approx([0.0, 0.9, 0.3]) and best.tolist() == [-1, 0, 1]
    max_conf, best = _max_conf_from(fg, over, 0.95)  # no pair reaches tau
    assert max_conf.tolist() == [0.0, 0.0, 0.0] and best.tolist() == [-1, -1, -1]


def test_fast_butd_selection_on_many_random_images():
    gen = torch.Generator().manual_seed(1)
    for trial in range(40):
        n = int(torch.randint(1, 80, (1,), generator=gen))
        c = int(torch.randint(2, 30, (1,), generator=gen))
        boxes = random_boxes(gen, n, float(torch.randint(20, 200, (1,), generator=gen)))
        temperature = float(torch.rand(1, generator=gen)) * 6
        scores = (torch.randn(n, c, generator=gen) * temperature).softmax(1)
        cfg = RegionsConfig(
            conf_threshold=float(torch.rand(1, generator=gen)) * 0.5,
            nms_iou=float(torch.rand(1, generator=gen)) * 0.8 + 0.1,
            min_boxes=int(torch.randint(0, 15, (1,), generator=gen)),
            max_boxes=15,
        )
        got = butd_select(boxes, scores, cfg)
        want = reference_butd(boxes, scores, cfg)
        for g, w in zip(got, want, strict=True):
            assert g.tolist() == w.tolist(), trial


def grid_cfg(**kw):
    return GridConfig(architecture="resnet50", image_size=64, grid=3, num_workers=0, **kw)


def test_grid_and_global_features(demo, tmp_path):
    root, manifest = demo
    cfg = grid_cfg()
    extractor = GridExtractor(build_trunk(cfg), cfg, CPU)
    extract_images(extractor, manifest, root / "images", tmp_path / "g.zarr", cfg, LAYOUT)
    grid = Store.open(tmp_path / "g.zarr")
    sample = grid[5]
    assert sample["features"].shape == (3, 3, 2048) and sample["features"].dtype == np.float16
    image = to_tensor(Image.open(root / "images" / manifest.table["path"][5].as_py()))[None]
    with torch.no_grad():
        conv5 = extractor.model(image)
    np.testing.assert_allclose(
        sample["pooled"], conv5.mean(dim=(2, 3))[0].numpy(), rtol=1e-4, atol=1e-5
    )
    store = extract_global(tmp_path / "g.zarr", manifest, tmp_path / "glob.zarr", 4, LAYOUT)
    assert store.fields["projected"].shape == (4,)
    train = np.asarray(manifest.table["split"].to_pylist()) == "train"
    pooled = grid.read(0, len(grid))["pooled"]
    mean, axes = fit_pca(pooled[train], 4)  # fitted on the train split only
    np.testing.assert_allclose(store.extra("pca_axes"), axes, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        store.read(0, len(store))["projected"], project(pooled, mean, axes), rtol=1e-4, atol=1e-4
    )
    assert store.verify() == []


def adaptive_pool_by_hand(fmap: np.ndarray, g: int) -> np.ndarray:
    """(C, H, W) -> (g, g, C): cell (i, j) is the mean of rows floor(iH/g)..ceil((i+1)H/g)
    and the same for columns, the bins of adaptive average pooling."""
    c, h, w = fmap.shape
    out = np.zeros((g, g, c))
    for i in range(g):
        for j in range(g):
            rows = slice(i * h // g, -(-(i + 1) * h // g))
            cols = slice(j * w // g, -(-(j + 1) * w // g))
            out[i, j] = fmap[:, rows, cols].mean(axis=(1, 2))
    return out


def test_grid_cells_and_pooled_vector_are_the_conv5_map_of_the_torchvision_resnet(tmp_path):
    """On a non-square image (conv5 5 x 9), the stored grid is the conv5 map of the
    torchvision ResNet, its layers called here one by one, pooled to 7 x 7 cell by cell
    (rows from H, columns from W), and the pooled vector its mean over all positions."""
    torch.manual_seed(3)
    resnet = torchvision.models.resnet18(weights=None).eval()
    torch.save(resnet.state_dict(), tmp_path / "r18.pt")
    cfg = GridConfig(architecture="resnet18", weights=str(tmp_path / "r18.pt"), grid=7)
    extractor = GridExtractor(build_trunk(cfg), cfg, CPU)
    image = torch.randn(3, 160, 288)  # (3, H, W)
    out = extractor([{"image": image, "hw": (480, 864)}])[0]
    with torch.no_grad():
        x = resnet.maxpool(resnet.relu(resnet.bn1(resnet.conv1(image[None]))))
        conv5 = resnet.layer4(resnet.layer3(resnet.layer2(resnet.layer1(x))))[0].numpy()
    assert conv5.shape == (512, 5, 9)
    assert out["features"].shape == (7, 7, 512) and out["pooled"].shape == (512,)
    np.testing.assert_allclose(out["features"], adaptive_pool_by_hand(conv5, 7), atol=1e-5)
    np.testing.assert_allclose(out["pooled"], conv5.mean(axis=(1, 2)), rtol=1e-5, atol=1e-6)
    assert out["image_hw"].tolist() == [480, 864]


def test_pca_ignores_everything_but_train():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 8)) * np.arange(1, 9)
    mean, axes = fit_pca(x, 3)
    assert axes.shape == (3, 8) and np.allclose(axes @ axes.T, np.eye(3), atol=1e-8)
    assert np.abs(axes[0]).argmax() == 7  # the widest direction first
    again_mean, again_axes = fit_pca(x.copy(), 3)
    np.testing.assert_array_equal(again_axes, axes)


def global_source(path, kind, n=13, seed=0):
    """A small grid or regions store (shards of 4, the last one short) of random
    features: regions with 0 to 5 of 6 slots used, some samples invalid."""
    from features.store.spec import Provenance, regions_fields
    from features.store.writer import StoreWriter

    rng = np.random.default_rng(seed)
    if kind == "grid":
        fields = {"pooled": FieldSpec((8,), "float32"), "valid": FieldSpec((), "uint8")}
        data = {"pooled": rng.standard_normal((n, 8)), "valid": rng.random(n) > 0.2}
    else:
        fields = {**regions_fields(6, 8), "valid": FieldSpec((), "uint8")}
        data = {
            "features": rng.standard_normal((n, 6, 8)) * 4,
            "boxes": rng.random((n, 6, 4)),
            "n_regions": np.r_[0, 1, rng.integers(0, 6, n - 2)],
            "image_hw": np.tile([40, 60], (n, 1)),
            "valid": rng.random(n) > 0.2,
        }
    keys = [f"img{i:03d}" for i in range(n)]
    cfg = StoreConfig(samples_per_shard=4, samples_per_chunk=2)
    provenance = Provenance("test", "1", {}, None, "m" * 64)
    with StoreWriter(path, kind, fields, keys, provenance, cfg, log=lambda m: None) as w:
        for shard in w.pending_shards():
            lo, hi = w.shard_range(shard)
            w.write_shard(shard, {k: v[lo:hi] for k, v in data.items()})
    return Store.open(path), data


def test_pooled_global_features_are_the_mean_of_the_valid_regions_or_the_grids_pool(tmp_path):
    from features.images.global_features import pooled_features
    from infra.config import ConfigError

    store, data = global_source(tmp_path / "r.zarr", "regions")
    features, valid = pooled_features(store)
    stored = data["features"].astype(np.float16).astype(np.float32)  # as the store keeps it
    expected = np.stack(
        [stored[i, :n].mean(0) if n else np.zeros(8, np.float32)
         for i, n in enumerate(data["n_regions"])]
    )  # fmt: skip
    assert features.dtype == np.float32 and features.shape == (13, 8)
    np.testing.assert_allclose(features, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(valid, (data["n_regions"] > 0) & data["valid"])
    grid, data = global_source(tmp_path / "g.zarr", "grid")
    features, valid = pooled_features(grid)
    assert features.dtype == np.float32
    np.testing.assert_array_equal(features, data["pooled"].astype(np.float32))
    np.testing.assert_array_equal(valid, data["valid"])
    assert valid.dtype == bool
    import store_writer_job as job

    job.run(tmp_path / "plain.zarr", "regions", 9, 4)  # no valid field: valid = any regions
    plain = Store.open(tmp_path / "plain.zarr")
    features, valid = pooled_features(plain)
    np.testing.assert_array_equal(valid, plain.read(0, 9)["n_regions"] > 0)
    tokens = tmp_path / "t.zarr"
    job.run(tokens, "tokens", 5, 4)
    with pytest.raises(ConfigError, match="a tokens store; global features come from a grid"):
        pooled_features(Store.open(tokens))


def test_projection_is_float64_arithmetic_kept_as_float32():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5)).astype(np.float32) * 1e4
    mean, axes = fit_pca(rng.standard_normal((40, 5)), 2)
    out = project(x, mean, axes)
    assert out.dtype == np.float32 and out.shape == (6, 2)
    np.testing.assert_array_equal(out, ((x.astype(np.float64) - mean) @ axes.T).astype(np.float32))


def test_pca_is_the_svds_principal_axes_with_fixed_signs():
    """fit_pca against the SVD of the centred rows (float32 input computed in float64):
    the mean, then the top axes by variance, each with its largest loading positive; one
    row has no variance: its mean, and axes that are unit vectors, without a warning."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((30, 6)) @ rng.standard_normal((6, 6))).astype(np.float32) + 5
    mean, axes = fit_pca(x, 4)
    centred = x.astype(np.float64) - x.astype(np.float64).mean(0)
    vt = np.linalg.svd(centred, full_matrices=False)[2][:4]
    vt *= np.sign(vt[np.arange(4), np.abs(vt).argmax(1)])[:, None]
    assert mean.dtype == np.float64 and axes.shape == (4, 6)
    np.testing.assert_allclose(mean, x.astype(np.float64).mean(0), rtol=1e-12)
    np.testing.assert_allclose(axes, vt, atol=1e-9)
    assert (axes[np.arange(4), np.abs(axes).argmax(1)] > 0).all()
    two_mean, two_axes = fit_pca(x[:2], 1)  # two rows: the axis is their difference
    diff = (x[1] - x[0]).astype(np.float64)
    np.testing.assert_allclose(np.abs(two_axes[0]), np.abs(diff) / np.linalg.norm(diff))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_mean, one_axes = fit_pca(x[:1], 2)
    np.testing.assert_array_equal(one_mean, x[0].astype(np.float64))
    assert one_axes.shape == (2, 6) and np.allclose(np.abs(one_axes).sum(1), 1)


def test_bad_images_are_reported_not_fatal(tmp_path):
    corpus = make_corpus(tmp_path / "images")
    records = [Record(Path(p).stem, Path(p).name, "train", ["x"]) for p in corpus.values()]
    write_manifest(records, Dataset("corpus", records), 1, tmp_path / "m.parquet")
    manifest = read_manifest(tmp_path / "m.parquet")
    cfg = grid_cfg()
    extractor = GridExtractor(build_trunk(cfg), cfg, CPU)
    extract_images(extractor, manifest, tmp_path / "images", tmp_path / "g.zarr", cfg, LAYOUT)
    assert region_recall(tmp_path / "none.zarr", manifest) is None  # no boxes, no report
    bad = Store.open(tmp_path / "g.zarr").notes()
    assert {k: v[0] for k, v in bad.items()} == {
        "truncated": "corrupt",
        "empty": "empty_file",
        "notes": "not_an_image",
        "bomb": "too_large",
    }
    store = Store.open(tmp_path / "g.zarr")
    valid = dict(zip(store.keys, store.read(0, len(store))["valid"], strict=True))
    assert valid["rotated"] == 1 and valid["deep16"] == 1 and valid["bomb"] == 0
    assert tuple(store["rotated"]["image_hw"]) == (40, 20)


def test_cli_reports_and_fails_over_threshold(tmp_path, capsys):
    from flows.cli import main

    corpus = make_corpus(tmp_path / "images")
    records = [Record(Path(p).stem, Path(p).name, "train", ["x"]) for p in corpus.values()]
    write_manifest(records, Dataset("corpus", records), 1, tmp_path / "m.parquet")
    params = tmp_path / "params.yaml"
    params.write_text(
        yaml.safe_dump(
            {
                "grid": {
                    "architecture": "resnet50",
                    "image_size": 64,
                    "grid": 2,
                    "num_workers": 0,
                    "max_error_fraction": 0.2,
                }
            }
        )
    )
    args = [
        "--params",
        str(params),
        "extract",
        "grid",
        "--manifest",
        str(tmp_path / "m.parquet"),
        "--images",
        str(tmp_path / "images"),
        "--out",
        str(tmp_path / "g.zarr"),
        "--errors",
        str(tmp_path / "errors.csv"),
        "--metrics",
        str(tmp_path / "m.json"),
    ]
    assert main(args) == 1  # 4 of 11 images are bad: over 20%
    err = capsys.readouterr()
    assert "not_an_image 1" in err.out and "4 of 11 images" in err.err
    assert "truncated,error,corrupt" in (tmp_path / "errors.csv").read_text()


JOB = """
import sys
from pathlib import Path
import torch
from features.images.extract import extract_images
from features.ingest.manifest import read_manifest
from features.store.spec import StoreConfig
from features.images.grid import GridExtractor, build_trunk
from features.images.config import GridConfig
root, out = Path(sys.argv[1]), Path(sys.argv[2])
cfg = GridConfig(architecture="resnet50", image_size=64, grid=3, num_workers=0, batch_size=2)
layout = StoreConfig(samples_per_shard=4, samples_per_chunk=2)
extractor = GridExtractor(build_trunk(cfg), cfg, torch.device("cpu"))
manifest = read_manifest(root / "manifest.parquet")
extract_images(extractor, manifest, root / "images", out, cfg, layout, log=lambda m: None)
"""


def test_killed_extraction_resumes_to_the_same_store(demo, tmp_path):
    root, _ = demo
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    run = [sys.executable, "-W", "ignore", "-c", JOB, str(root)]
    subprocess.run([*run, str(tmp_path / "clean.zarr")], check=True, env=env)
    proc = subprocess.Popen([*run, str(tmp_path / "killed.zarr")], env=env)
    marker = incomplete_path(tmp_path / "killed.zarr") / "_commits" / "c.0"
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = Store.open(incomplete_path(tmp_path / "killed.zarr"), require_complete=False)
    assert 0 < partial.committed.sum() < len(partial.committed)
    assert not (tmp_path / "killed.zarr").exists()  # built aside until complete
    subprocess.run([*run, str(tmp_path / "killed.zarr")], check=True, env=env)

    def data_files(path):
        return {
            str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
        }

    assert data_files(tmp_path / "killed.zarr") == data_files(tmp_path / "clean.zarr")
    assert Store.open(tmp_path / "killed.zarr").verify() == []


class NonFiniteExtractor:
    """Features made up per key: NaN for one image, a float32 value that overflows the
    float16 field for another, infinity in a float32 field for a third."""

    kind, name, device = "grid", "non-finite-test", CPU
    BAD = {"train_00001": "features", "train_00002": "features", "val_00000": "pooled"}

    def fields(self):
        return {"features": FieldSpec((3,), "float16"), "pooled": FieldSpec((2,), "float32")}

    def prepare(self, image, row):
        return {"key": row["key"]}

    def forward(self, items):
        out = []
        for item in items:
            features, pooled = np.ones(3, np.float32), np.ones(2, np.float32)
            if item["key"] == "train_00001":
                features[1] = np.nan
            if item["key"] == "train_00002":
                features[0] = 1e6  # finite here, infinite as float16
            if item["key"] == "val_00000":
                pooled[0] = -np.inf
            out.append({"features": features, "pooled": pooled})
        return out

    def finish(self, items, raw):
        return raw

    def empty(self):
        return {"features": np.zeros(3, np.float16), "pooled": np.zeros(2, np.float32)}

    def provenance_params(self):
        return {}


def test_non_finite_features_are_stored_invalid_and_reported(demo, tmp_path):
    root, manifest = demo
    cfg = grid_cfg()
    extract_images(
        NonFiniteExtractor(), manifest, root / "images", tmp_path / "n.zarr", cfg, LAYOUT
    )
    store = Store.open(tmp_path / "n.zarr")
    notes = store.notes()
    assert {k: v[0] for k, v in notes.items()} == dict.fromkeys(
        NonFiniteExtractor.BAD, "non_finite"
    )
    for key, field in NonFiniteExtractor.BAD.items():
        assert field in notes[key][1]
    data = store.read(0, len(store))
    assert np.isfinite(data["features"].astype(np.float32)).all()
    assert np.isfinite(data["pooled"]).all()
    valid = dict(zip(store.keys, data["valid"], strict=True))
    assert [k for k, v in valid.items() if not v] == sorted(NonFiniteExtractor.BAD)
    summary = report_bad_images(
        tmp_path / "n.zarr", tmp_path / "e.csv", tmp_path / "m.json", 1.0, log=lambda m: None
    )
    assert summary["counts"] == {"non_finite": 3}
    assert "train_00001,error,non_finite," in (tmp_path / "e.csv").read_text()


class Overlapping:
    """Records made up per key; each batch's ``finish`` but the last waits (at most 5 s)
    for the next batch's ``forward`` to begin and notes whether it did."""

    kind, name, device = "grid", "overlap-test", CPU

    def __init__(self, batches):
        self.batches = batches
        self.begun = collections.defaultdict(threading.Event)
        self.forwards = 0
        self.overlapped = []

    def fields(self):
        return {"features": FieldSpec((1,), "float32")}

    def prepare(self, image, row):
        return {"value": float(int(row["key"].rsplit("_", 1)[1]))}

    def forward(self, items):
        n, self.forwards = self.forwards, self.forwards + 1
        self.begun[n].set()
        return n, [{"features": np.float32([it["value"]])} for it in items]

    def finish(self, items, raw):
        n, records = raw
        if n + 1 < self.batches:
            self.overlapped.append(self.begun[n + 1].wait(timeout=5))
        return records

    def empty(self):
        return {"features": np.zeros(1, np.float32)}

    def provenance_params(self):
        return {}


def test_a_batch_is_finished_while_the_next_batch_runs(demo, tmp_path):
    root, manifest = demo
    batches = -(-len(manifest.table) // 2)
    extractor = Overlapping(batches)
    cfg = grid_cfg(batch_size=2)
    extract_images(extractor, manifest, root / "images", tmp_path / "o.zarr", cfg, LAYOUT)
    # every batch but the last was finished beside the next one's forward
    assert extractor.overlapped == [True] * (batches - 1)
    store = Store.open(tmp_path / "o.zarr")
    assert store.verify() == []
    expected = [float(int(k.rsplit("_", 1)[1])) for k in store.keys]
    assert store.read(0, len(store))["features"][:, 0].tolist() == expected
