"""Visual extractors with random-init weights on small images (no downloads)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torchvision.ops import roi_align

from features.demo import DemoConfig, build_dataset
from features.extract import extract_images, report_bad_images
from features.global_features import extract_global, fit_pca, project
from features.ingest import (
    READERS,
    Dataset,
    PrepareConfig,
    Record,
    read_manifest,
    validate,
    write_manifest,
)
from features.store import FieldSpec, Store, StoreConfig, incomplete_path
from features.visual import (
    GridExtractor,
    RegionExtractor,
    build_detector,
    build_trunk,
    butd_select,
    to_tensor,
)
from features.visual_config import GridConfig, RegionsConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_images import make_corpus  # noqa: E402

CPU = torch.device("cpu")
LAYOUT = StoreConfig(samples_per_shard=4, samples_per_chunk=2)
pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM initialisation")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A 10/3/3 demo dataset at 64px and its manifest."""
    root = tmp_path_factory.mktemp("demo")
    build_dataset(DemoConfig(n_train=10, n_val=3, n_test=3, image_size=64), root)
    dataset = READERS["demo"](root / "dataset.json", root / "images", PrepareConfig())
    records, _ = validate(dataset, root / "images", 5)
    write_manifest(records, dataset, 5, root / "manifest.parquet")
    return root, read_manifest(root / "manifest.parquet")


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


def test_pca_ignores_everything_but_train():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 8)) * np.arange(1, 9)
    mean, axes = fit_pca(x, 3)
    assert axes.shape == (3, 8) and np.allclose(axes @ axes.T, np.eye(3), atol=1e-8)
    assert np.abs(axes[0]).argmax() == 7  # the widest direction first
    again_mean, again_axes = fit_pca(x.copy(), 3)
    np.testing.assert_array_equal(again_axes, axes)


def test_bad_images_are_reported_not_fatal(tmp_path):
    corpus = make_corpus(tmp_path / "images")
    records = [Record(Path(p).stem, Path(p).name, "train", ["x"]) for p in corpus.values()]
    write_manifest(records, Dataset("corpus", records), 1, tmp_path / "m.parquet")
    manifest = read_manifest(tmp_path / "m.parquet")
    cfg = grid_cfg()
    extractor = GridExtractor(build_trunk(cfg), cfg, CPU)
    extract_images(extractor, manifest, tmp_path / "images", tmp_path / "g.zarr", cfg, LAYOUT)
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
from features.extract import extract_images, report_bad_images
from features.ingest import read_manifest
from features.store import StoreConfig
from features.visual import GridExtractor, build_trunk
from features.visual_config import GridConfig
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

    def __call__(self, items):
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
