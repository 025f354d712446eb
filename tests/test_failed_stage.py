"""A failed image stage publishes nothing, and min_boxes is a promise (issue 25.4): grid
once failed its max_error_fraction and left grid.zarr complete with valid = 0 for all;
regions once kept n_regions = 0 under min_boxes 10 for 22 images with no report."""

import csv
import json

import numpy as np
import pytest
import torch
from demo_data import demo_manifest

from features.images.config import GridConfig, RegionsConfig
from features.images.extract import extract_images
from features.images.report import report_bad_images
from features.ingest.manifest import IngestError
from features.store.layout import incomplete_path
from features.store.reader import Store
from features.store.spec import FieldSpec, StoreConfig

LAYOUT = StoreConfig(samples_per_shard=4, samples_per_chunk=2)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return root, demo_manifest(root, n_train=6, n_val=2, n_test=2, image_size=64)


class AllNaN:
    """A grid extractor whose every output is NaN (a diverged model)."""

    kind, name, device = "grid", "all-nan-test", torch.device("cpu")

    def fields(self):
        return {"features": FieldSpec((3,), "float16")}

    def prepare(self, image, row):
        return {}

    def forward(self, items):
        return [{"features": np.full(3, np.nan, np.float32)} for _ in items]

    def finish(self, items, raw):
        return raw

    def empty(self):
        return {"features": np.zeros(3, np.float16)}

    def provenance_params(self):
        return {}


def test_a_stage_failing_its_error_fraction_leaves_no_store_and_a_rerun_resumes(demo, tmp_path):
    root, manifest = demo
    cfg = GridConfig(architecture="resnet50", image_size=32, grid=3, num_workers=0)
    out = tmp_path / "grid.zarr"
    extract_images(AllNaN(), manifest, root / "images", out, cfg, LAYOUT, log=lambda m: None)
    with pytest.raises(IngestError) as err:
        report_bad_images(out, tmp_path / "e.csv", tmp_path / "m.json", 0.01, log=lambda m: 0)
    assert str(err.value) == (
        f"10 of 10 images (100.00%) could not be used, more than max_error_fraction = 1.00%; "
        f"see {tmp_path / 'e.csv'} ({out} withdrawn: a rerun resumes it)"
    )
    assert not out.exists()  # nothing published at the stage's path
    assert Store.open(incomplete_path(out)).committed.all()  # kept aside for the rerun
    assert json.loads((tmp_path / "m.json").read_text())["bad_images"] == 10
    # the rerun (same inputs) resumes: no shard is extracted again
    messages = []
    extract_images(AllNaN(), manifest, root / "images", out, cfg, LAYOUT, log=messages.append)
    assert any("resuming, 3/3 shards done" in m for m in messages), messages
    assert Store.open(out).verify() == [] and not incomplete_path(out).exists()
    # with the limit raised, the same store passes and stays
    report_bad_images(out, tmp_path / "e.csv", tmp_path / "m.json", 1.0, log=lambda m: 0)
    assert out.exists()


class ShortRegions:
    """A regions extractor whose detector proposes few boxes for some images: the number
    proposed per image is the image's index modulo 5 (0, 1, 2, 3, 4, 0, ...)."""

    kind, name, device = "regions", "short-regions-test", torch.device("cpu")
    given = False

    def __init__(self, min_boxes):
        self.cfg = RegionsConfig(min_boxes=min_boxes, max_boxes=4, num_workers=0)

    def fields(self):
        return {
            "features": FieldSpec((4, 2), "float16"),
            "n_regions": FieldSpec((), "int32"),
        }

    def prepare(self, image, row):
        return {"n": int(row["key"].rsplit("_", 1)[-1]) % 5}

    def forward(self, items):
        out = []
        for item in items:
            features = np.zeros((4, 2), np.float32)
            features[: item["n"]] = 1.0
            out.append({"features": features, "n_regions": np.int32(item["n"])})
        return out

    def finish(self, items, raw):
        return raw

    def empty(self):
        return {"features": np.zeros((4, 2), np.float16), "n_regions": np.int32(0)}

    def provenance_params(self):
        return {"min_boxes": self.cfg.min_boxes}


def test_images_short_of_min_boxes_are_reported_never_silent(demo, tmp_path):
    root, manifest = demo
    keys = manifest.table["key"].to_pylist()
    proposed = {k: int(k.rsplit("_", 1)[-1]) % 5 for k in keys}  # the reference, by hand
    extractor = ShortRegions(min_boxes=3)
    out = tmp_path / "r.zarr"
    extract_images(extractor, manifest, root / "images", out, extractor.cfg, LAYOUT,
                   log=lambda m: None)  # fmt: skip
    store = Store.open(out)
    data = store.read(0, len(store))
    notes = store.notes()
    for i, key in enumerate(keys):
        n = proposed[key]
        if n == 0:  # nothing to use: stored empty, an error
            assert notes[key] == ["no_regions", "0 regions < min_boxes 3: the detector "
                                  "proposed 0 boxes"]  # fmt: skip
            assert data["valid"][i] == 0
        elif n < 3:  # kept, and said
            assert notes[key] == ["few_regions", f"{n} regions < min_boxes 3: the detector "
                                  f"proposed {n} boxes"]  # fmt: skip
            assert data["valid"][i] == 1 and data["n_regions"][i] == n
        else:
            assert key not in notes and data["n_regions"][i] == n
    summary = report_bad_images(out, tmp_path / "e.csv", tmp_path / "m.json", 1.0, log=print)
    n_none = sum(n == 0 for n in proposed.values())
    n_few = sum(0 < n < 3 for n in proposed.values())
    assert summary["bad_images"] == n_none  # warnings do not count as bad images
    assert summary["counts"] == {"no_regions": n_none, "few_regions": n_few}
    with open(tmp_path / "e.csv", newline="") as f:
        severities = {row["key"]: row["severity"] for row in csv.DictReader(f)}
    assert severities == {k: "error" if n == 0 else "warning" for k, n in proposed.items()
                          if n < 3}  # fmt: skip
    # min_boxes 0: nothing is short
    none = ShortRegions(min_boxes=0)
    extract_images(none, manifest, root / "images", tmp_path / "z.zarr", none.cfg, LAYOUT,
                   log=lambda m: None)  # fmt: skip
    assert Store.open(tmp_path / "z.zarr").notes() == {}
