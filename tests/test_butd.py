"""The native bottom-up-attention model (features/images/butd) on checkpoints in the
published key layouts (tests/butd_data.py: py-bottom-up-attention's detectron2 ``.pkl``,
MILVLG's ``.pth``) and real photographs (tests/fixtures/photos, CC BY, see ATTRIBUTION.md);
against upstream detectron2 (a stored golden fixture in every run, live where detectron2
is installed)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from butd_data import butd_state, photo_set, to_milvlg, write_pkl
from demo_data import demo_manifest
from make_butd_golden import (
    CHECKPOINTS,
    CONFIG,
    GOLDEN,
    GOLDEN_PARAMS,
    GOLDEN_PHOTOS,
    PHOTOS,
    VERSIONS,
    extract,
)
from PIL import Image
from torchvision.ops import box_iou

from features.detector.weights import WeightsError
from features.images.butd.model import cell_anchors
from features.images.config import RegionsConfig
from features.images.extract import build_image_extractor

SMALL = {"proposals": 60, "device": "cpu"}


def save(state: dict, path) -> str:
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    return str(path)


def photo(i: int = 0) -> Image.Image:
    return Image.open(PHOTOS[i]).convert("RGB")


def records(extractor, image):
    return extractor([extractor.prepare(image, {})])[0]


def test_both_layouts_load_by_their_keys_and_give_the_same_regions(tmp_path):
    """The same network written in MILVLG's layout (background first, two-way softmax
    RPN, renamed attribute head; converted by the test helper) gives the same records,
    whatever the files are called."""
    state = butd_state()
    d2 = build_image_extractor(
        "regions", RegionsConfig(weights=save(state, tmp_path / "a.pth"), **SMALL)
    )
    mv = build_image_extractor(
        "regions", RegionsConfig(weights=save(to_milvlg(state), tmp_path / "b.pth"), **SMALL)
    )
    assert d2.model.spec.layout == "detectron2" and mv.model.spec.layout == "milvlg"
    a, b = records(d2, photo()), records(mv, photo())
    assert set(a) == set(b) >= {"features", "boxes", "objects_id", "objects_conf", "attrs_id"}
    assert a["n_regions"] >= 10  # min_boxes
    for key in set(a) - {"attrs_conf"}:
        np.testing.assert_allclose(a[key].astype(float), b[key].astype(float), rtol=1e-5, atol=1e-6)
    # MILVLG's attribute confidence is not renormalised without "no attribute": lower
    assert (b["attrs_conf"] <= a["attrs_conf"] + 1e-6).all()
    assert (b["attrs_conf"] < a["attrs_conf"]).any()
    n = int(a["n_regions"])
    assert (a["objects_id"][:n] >= 0).all() and (a["objects_id"][:n] < 30).all()  # 0-based ids
    assert (a["attrs_id"][:n] >= 0).all() and (a["attrs_id"][:n] < 10).all()
    assert ((a["objects_conf"][:n] > 0) & (a["objects_conf"][:n] <= 1)).all()
    assert (a["objects_id"][n:] == -1).all() and (a["attrs_id"][n:] == -1).all()


def test_py_bottom_up_attention_pkl_needs_opt_in_and_builds_only_arrays(tmp_path):
    """The .pkl as those files are (protocol-2 pickle, numpy 1.x global names) loads with
    ``allow_pickle_weights`` into the same model as its .pth; without it, or with a pickle
    that wants anything but arrays, one line and nothing run."""
    state = butd_state(attrs=0)
    pkl = write_pkl(state, tmp_path / "faster_rcnn_from_caffe.pkl")
    with pytest.raises(WeightsError) as err:
        build_image_extractor("regions", RegionsConfig(weights=str(pkl), **SMALL))
    assert "allow_pickle_weights" in str(err.value) and "\n" not in str(err.value)
    from_pkl = build_image_extractor(
        "regions", RegionsConfig(weights=str(pkl), allow_pickle_weights=True, **SMALL)
    )
    from_pth = build_image_extractor(
        "regions", RegionsConfig(weights=save(state, tmp_path / "x.pth"), **SMALL)
    )
    assert "attrs_id" not in from_pkl.fields()  # no attribute head in this checkpoint
    a, b = records(from_pkl, photo(1)), records(from_pth, photo(1))
    np.testing.assert_array_equal(a["features"], b["features"])

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    bad = tmp_path / "evil.pkl"
    bad.write_bytes(pickle.dumps({"model": {"x": Evil()}}, protocol=2))
    with pytest.raises(WeightsError, match=r"the pickle wants \w+\.print"):
        build_image_extractor(
            "regions", RegionsConfig(weights=str(bad), allow_pickle_weights=True, **SMALL)
        )


def test_a_checkpoint_of_neither_layout_fails_in_one_line_naming_the_missing_keys(tmp_path):
    state = butd_state()
    del state["proposal_generator.rpn_head.conv.weight"]
    del state["roi_heads.box_predictor.cls_score.weight"]
    with pytest.raises(WeightsError) as err:
        build_image_extractor(
            "regions", RegionsConfig(weights=save(state, tmp_path / "c.pth"), **SMALL)
        )
    message = str(err.value)
    assert "\n" not in message and "c.pth" in message
    assert "proposal_generator.rpn_head.conv.weight" in message
    assert "roi_heads.box_predictor.cls_score.weight" in message
    state = butd_state()
    state["roi_heads.res5.0.conv9.weight"] = np.zeros((1,), np.float32)
    with pytest.raises(WeightsError, match=r"1 unexpected keys .*conv9"):
        build_image_extractor(
            "regions", RegionsConfig(weights=save(state, tmp_path / "d.pth"), **SMALL)
        )


def test_frozen_norms_without_running_statistics_read_as_mean_0_variance_1(tmp_path):
    """Checkpoints with scale and shift only (no running mean/var) load; they equal the
    same checkpoint with mean 0 and variance 1 written out."""
    bare = butd_state(stats=False)
    full = dict(bare)
    for key in [k for k in bare if k.endswith("norm.weight")]:
        full[key.replace("weight", "running_mean")] = np.zeros_like(bare[key])
        full[key.replace("weight", "running_var")] = np.ones_like(bare[key])
    a = records(
        build_image_extractor(
            "regions", RegionsConfig(weights=save(bare, tmp_path / "a.pth"), **SMALL)
        ),
        photo(2),
    )
    b = records(
        build_image_extractor(
            "regions", RegionsConfig(weights=save(full, tmp_path / "b.pth"), **SMALL)
        ),
        photo(2),
    )
    np.testing.assert_array_equal(a["features"], b["features"])


def test_anchors_are_the_caffe_models_sizes_and_ratios_by_hand():
    """64..512 (4..32 x stride 16), ratios h/w 0.5, 1, 2, size-major (detectron2's order)."""
    anchors = cell_anchors()
    assert anchors.shape == (12, 4)
    w, h = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    torch.testing.assert_close(anchors[1], torch.tensor([-32.0, -32.0, 32.0, 32.0]))
    torch.testing.assert_close(w[0], torch.tensor(64 * 2**0.5))  # ratio 0.5: wider
    torch.testing.assert_close(h[11], torch.tensor(512 * 2**0.5))  # ratio 2: taller
    torch.testing.assert_close(w * h, torch.tensor([64.0, 128, 256, 512]).repeat_interleave(3) ** 2)


def test_stem_pools_as_caffe_without_padding_and_rounding_up(tmp_path):
    """An odd map: Caffe's 3x3/2 pool without padding, ceil mode, from a naive loop
    (upstream detectron2's padded pool would give one more row and column)."""
    ext = build_image_extractor(
        "regions", RegionsConfig(weights=save(butd_state(), tmp_path / "a.pth"), **SMALL)
    )
    stem = ext.model.backbone.stem
    x = torch.randn(1, 3, 601, 801) * 50
    with torch.no_grad():
        out = stem(x)
        conv = F.relu(stem.conv1(x))[0]  # (C, 301, 401)
    c, h, w = conv.shape
    oh, ow = -(-(h - 3) // 2) + 1, -(-(w - 3) // 2) + 1
    assert out.shape[2:] == (oh, ow) == (150, 200)
    ref = torch.empty(c, oh, ow)
    for i in range(oh):
        for j in range(ow):
            ref[:, i, j] = conv[:, 2 * i : 2 * i + 3, 2 * j : 2 * j + 3].amax(dim=(1, 2))
    torch.testing.assert_close(out[0], ref)


def test_fixed_36_regions(tmp_path):
    ext = build_image_extractor(
        "regions",
        RegionsConfig(
            weights=save(butd_state(), tmp_path / "a.pth"), min_boxes=36, max_boxes=36, **SMALL
        ),
    )
    out = records(ext, photo(3))
    assert out["n_regions"] == 36 and out["features"].shape == (36, 256)
    assert ext.provenance_params()["object_vocabulary"] == "30-objects"


CONF_ATOL = 1e-4  # object and attribute confidences (measured against detectron2: <= 1.1e-5)


def same_region_ranks(native: dict, reference: dict) -> np.ndarray:
    """For each rank of the reference, the rank of the same region in ``native``: the same
    rank, except among regions whose object confidences tie within :data:`CONF_ATOL`
    (their order is then numerical noise), where it is the rank, in that tie, of the box
    that overlaps the reference's most (IoU >= 0.99). -1 where there is none."""
    iou = box_iou(torch.as_tensor(native["boxes"]), torch.as_tensor(reference["boxes"]))
    conf_a = np.asarray(native["objects_conf"], float)
    conf_b = np.asarray(reference["objects_conf"], float)
    ranks, free = [], set(range(len(conf_a)))
    for j, conf in enumerate(conf_b):
        tie = [k for k in free if abs(conf_a[k] - conf) <= CONF_ATOL and iou[k, j] >= 0.99]
        k = j if j in tie else max(tie, key=lambda k: float(iou[k, j]), default=-1)
        free.discard(k)
        ranks.append(k)
    return np.array(ranks, dtype=int)


def assert_same_regions(native: dict, reference: dict, label: str) -> None:
    """Parity: the same count, and at each rank (up to the order within a tie of
    confidences, :func:`same_region_ranks`) a box with IoU >= 0.99 with the reference's,
    features within 1e-3 relative, the same object and attribute ids, object and attribute
    confidences within :data:`CONF_ATOL`."""
    n = len(reference["boxes"])
    assert len(native["boxes"]) == n, label
    ranks = same_region_ranks(native, reference)
    assert (ranks >= 0).all(), (
        f"{label}: no region like the reference's at ranks {np.flatnonzero(ranks < 0)}"
    )
    native = {k: np.asarray(v)[ranks] for k, v in native.items()}
    iou = box_iou(torch.as_tensor(native["boxes"]), torch.as_tensor(reference["boxes"])).diag()
    assert float(iou.min()) >= 0.99, label
    a, b = np.asarray(native["features"], float), np.asarray(reference["features"], float)
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max(), label
    for labels in ("objects", "attrs"):
        np.testing.assert_array_equal(native[f"{labels}_id"], reference[f"{labels}_id"], label)
        np.testing.assert_allclose(
            np.asarray(native[f"{labels}_conf"], float),
            np.asarray(reference[f"{labels}_conf"], float),
            rtol=0,
            atol=CONF_ATOL,
            err_msg=label,
        )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Each checkpoint of the golden fixture, written once: name -> path."""
    folder = tmp_path_factory.mktemp("butd_golden")
    return {name: str(make(folder / f"{name}.pth")) for name, make in CHECKPOINTS.items()}


def test_golden_fixture_records_its_versions_and_peaked_scores():
    """The fixture names the torch, torchvision and detectron2 that made it; with the
    peaked checkpoint, classes and attributes vary between regions and within each photo,
    and in most regions the winning class and attribute take half the probability or more."""
    golden = np.load(GOLDEN)
    for key in VERSIONS:
        assert golden[key].ndim == 0 and str(golden[key]), key
    assert set(golden.files) >= {f"{name}/objects_conf" for name in CHECKPOINTS}
    objects, attrs = golden["peaked/objects_id"], golden["peaked/attrs_id"]  # (images, 36)
    assert len(np.unique(objects)) >= 12 and len(np.unique(attrs)) >= 6
    assert all(len(np.unique(row)) >= 4 for row in objects)
    assert all(len(np.unique(row)) >= 4 for row in attrs)
    assert np.median(golden["peaked/objects_conf"]) >= 0.5  # uniform over 30 would be 0.03
    assert np.median(golden["peaked/attrs_conf"]) >= 0.5  # uniform over 10 would be 0.1


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_native_matches_golden_detectron2_fixture(checkpoints, name):
    """The regions that upstream detectron2 (with the backend's registrations) extracted
    (tools/make_butd_golden.py), reproduced by the native model."""
    golden = np.load(GOLDEN)
    assert list(golden["photos"]) == [p.name for p in GOLDEN_PHOTOS]
    cfg = RegionsConfig(weights=checkpoints[name], device="cpu", **GOLDEN_PARAMS)
    native = extract(build_image_extractor("regions", cfg), GOLDEN_PHOTOS)
    assert {f"{name}/{k}" for k in native} <= set(golden.files)
    for i, photo_name in enumerate(golden["photos"]):
        assert_same_regions(
            {k: v[i] for k, v in native.items()},
            {k: golden[f"{name}/{k}"][i] for k in native},
            f"{name} {photo_name}",
        )


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_native_equals_detectron2_on_five_photos(checkpoints, name):
    pytest.importorskip("detectron2", reason="detectron2 is not installed (optional backend)")
    params = {"weights": checkpoints[name], "device": "cpu", "proposals": 150}
    native = build_image_extractor("regions", RegionsConfig(**params))
    d2 = build_image_extractor(
        "regions", RegionsConfig(**params, backend="detectron2", detectron2_config=str(CONFIG))
    )
    assert d2.name == "regions-detectron2-butd_r50_w8_attr_caffemaxpool"
    assert len(PHOTOS) >= 5
    for p in PHOTOS:
        image = Image.open(p).convert("RGB")
        a = native.regions([native.prepare(image, {})])[0]
        b = d2.regions([d2.prepare(image, {})])[0]
        assert_same_regions(a, b, f"{name} {p.name}")


@pytest.mark.parametrize("batch", [4, 8])
def test_a_batch_gives_each_photo_the_regions_it_gets_alone(checkpoints, batch):
    """Several photos of different sizes per forward pass: each photo's boxes (IoU >= 0.99
    at every rank), features (1e-3 relative), ids and confidences as when it is extracted
    by itself (:func:`assert_same_regions`)."""
    cfg = RegionsConfig(weights=checkpoints["peaked"], device="cpu", **GOLDEN_PARAMS)
    ext = build_image_extractor("regions", cfg)
    images = photo_set(8)
    assert len({image.size for image in images}) == 7  # padded where batching pads
    items = [ext.prepare(image, {}) for image in images]
    alone = [ext.regions([item])[0] for item in items]
    batched = [r for lo in range(0, 8, batch) for r in ext.regions(items[lo : lo + batch])]
    for i, (a, b) in enumerate(zip(batched, alone, strict=True)):
        assert_same_regions(
            {k: v.numpy() for k, v in a.items()},
            {k: v.numpy() for k, v in b.items()},
            f"batch {batch}, image {i}",
        )


def test_extracted_store_exports_as_obj36_rows(tmp_path):
    """The stage end to end: BUTD regions into a store (obj36 labels, -1 padding), then
    ``export-tsv``'s obj36 rows, decoded here as LXMERT's loader does (base64 buffers)."""
    import base64
    import csv

    from features.exchange.butd_tsv import export_obj36
    from features.images.extract import extract_images
    from features.store.reader import Store
    from features.store.spec import StoreConfig

    root = tmp_path / "demo"
    manifest = demo_manifest(root, n_train=2, n_val=1, n_test=1, image_size=96)
    cfg = RegionsConfig(
        weights=save(butd_state(), tmp_path / "w.pth"),
        min_side=96,
        max_side=96,
        proposals=20,
        min_boxes=3,
        max_boxes=8,
        num_workers=0,
        device="cpu",
    )
    extractor = build_image_extractor("regions", cfg)
    layout = StoreConfig(samples_per_shard=2, samples_per_chunk=2)
    extract_images(extractor, manifest, root / "images", tmp_path / "r.zarr", cfg, layout)
    store = Store.open(tmp_path / "r.zarr")
    data = store.read(0, len(manifest))
    assert {"objects_id", "objects_conf", "attrs_id", "attrs_conf"} <= set(data)
    written, _ = export_obj36(store, manifest, tmp_path / "obj36.tsv", log=lambda _: None)
    assert written == len(manifest)
    csv.field_size_limit(1 << 30)
    with open(tmp_path / "obj36.tsv") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    keys = manifest.table["key"].to_pylist()
    for row in rows:
        i = keys.index(row[0])
        n = int(row[7])
        assert n == data["n_regions"][i] and (data["objects_id"][i, n:] == -1).all()
        ids = np.frombuffer(base64.b64decode(row[3]), np.int64)
        attrs = np.frombuffer(base64.b64decode(row[5]), np.int64)
        feats = np.frombuffer(base64.b64decode(row[9]), np.float32).reshape(n, 256)
        np.testing.assert_array_equal(ids, data["objects_id"][i, :n])
        np.testing.assert_array_equal(attrs, data["attrs_id"][i, :n])
        np.testing.assert_array_equal(feats, data["features"][i, :n].astype(np.float32))


def test_given_boxes_keep_their_order_and_take_each_ones_most_likely_object(tmp_path):
    """``backend: given`` with bottom-up-attention weights: one region per given box, in
    the manifest's order; its object is the most probable class but background, its
    confidence that class's probability."""
    cfg = RegionsConfig(
        weights=save(butd_state(), tmp_path / "a.pth"), backend="given", min_boxes=0, **SMALL
    )
    ext = build_image_extractor("regions", cfg)
    boxes = [[10.0, 20.0, 200.0, 180.0], [0.0, 0.0, 60.0, 90.0], [50.0, 40.0, 300.0, 260.0]]
    item = ext.prepare(photo(), {"boxes": boxes})
    probs = ext.forward([item]).wait()["probs"][:, 1:]  # (3, classes): background dropped
    out = ext([item])[0]
    assert out["n_regions"] == 3
    np.testing.assert_allclose(out["boxes"][:3], boxes, rtol=1e-6)
    np.testing.assert_array_equal(out["objects_id"][:3], probs.argmax(1).numpy())
    np.testing.assert_allclose(out["objects_conf"][:3], probs.max(1).values.numpy(), rtol=1e-6)
    assert (out["objects_id"][3:] == -1).all()
