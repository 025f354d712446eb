"""The synthetic demo dataset: deterministic, varied, and its annotations are true."""

import json

import numpy as np
import pytest
from spacy.tokens import Doc
from spacy.vocab import Vocab

from features.demo import (
    COLORS,
    SHAPES,
    SIZES,
    TEXTURES,
    DemoConfig,
    DemoObject,
    build_dataset,
    caption_relation,
    class_of,
    generate_image,
    spatial_relation,
)

CFG = DemoConfig()


@pytest.fixture(scope="module")
def sample():
    """60 training images with their records."""
    return [generate_image(CFG, "train", i) for i in range(60)]


def test_same_seed_same_images_and_captions():
    a_img, a_rec = generate_image(CFG, "val", 7)
    b_img, b_rec = generate_image(CFG, "val", 7)
    assert np.array_equal(np.asarray(a_img), np.asarray(b_img)) and a_rec == b_rec
    c_img, c_rec = generate_image(DemoConfig(seed=1), "val", 7)
    assert not np.array_equal(np.asarray(a_img), np.asarray(c_img)) or a_rec != c_rec


def test_build_dataset_is_bitwise_reproducible(tmp_path):
    cfg = DemoConfig(n_train=4, n_val=2, n_test=2)
    for run in ("a", "b"):
        build_dataset(cfg, tmp_path / run)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    assert len(files_a) == 8 + 1
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    text = (tmp_path / "a" / "dataset.json").read_text()
    data = json.loads(text)
    # written record by record, in the bytes of the whole dict dumped at once
    assert text == json.dumps(data, indent=1) + "\n"
    assert data["class_names"] == list(SHAPES)
    assert [img["split"] for img in data["images"]] == ["train"] * 4 + ["val"] * 2 + ["test"] * 2
    sentids = [s for img in data["images"] for s in img["sentids"]]
    assert sentids == list(range(8 * 5))


def test_changing_one_split_size_keeps_other_splits():
    small, big = DemoConfig(n_train=5), DemoConfig(n_train=50)
    assert generate_image(small, "test", 3)[1] == generate_image(big, "test", 3)[1]


def test_content_covers_the_vocabulary(sample):
    objects = [o for _, rec in sample for o in rec["objects"]]
    assert {o["shape"] for o in objects} == set(SHAPES)
    assert {o["color"] for o in objects} == set(COLORS)
    assert {o["size"] for o in objects} == set(SIZES)
    assert {rec["background"] for _, rec in sample} == set(TEXTURES)
    assert {len(rec["objects"]) for _, rec in sample} == {2, 3, 4}
    views = {s["view"] for _, rec in sample for s in rec["sentences"]}
    assert views == {"all_objects", "attributes", "relation", "count"}
    words = {w for _, rec in sample for s in rec["sentences"] for w in s["tokens"]}
    assert {"circle", "disc", "disk"} & words and {"big", "large", "huge"} <= words


def test_boxes_are_tight_around_the_drawn_objects(sample):
    for image, rec in sample[:20]:
        pixels = np.asarray(image).astype(int)
        size = pixels.shape[0]
        for box, obj in zip(rec["boxes"], rec["objects"], strict=True):
            x1, y1, x2, y2 = box
            assert 0 <= x1 < x2 <= size and 0 <= y1 < y2 <= size
            # pixels of the object's colour in a 2px margin around its box (boxes are >3px apart)
            a, b = max(int(x1) - 2, 0), max(int(y1) - 2, 0)
            crop = pixels[b : int(y2) + 3, a : int(x2) + 3]
            ys, xs = np.nonzero((crop == COLORS[obj["color"]]).all(-1))
            assert len(xs), (rec["filename"], obj)
            assert abs(xs.min() + a - x1) <= 1.5 and abs(xs.max() + a + 1 - x2) <= 1.5
            assert abs(ys.min() + b - y1) <= 1.5 and abs(ys.max() + b + 1 - y2) <= 1.5


def test_class_is_the_largest_objects_shape(sample):
    for _, rec in sample:
        areas = [(x2 - x1) * (y2 - y1) for x1, y1, x2, y2 in rec["boxes"]]
        assert SHAPES[rec["label"]] == rec["box_names"][int(np.argmax(areas))]
    objs = [
        DemoObject("star", "red", "small", (0, 0, 10, 10)),
        DemoObject("circle", "red", "large", (20, 20, 50, 50)),
    ]
    assert class_of(objs) == SHAPES.index("circle")


def _is_projective(heads):
    for child, head in enumerate(heads):
        lo, hi = sorted((child, head))
        for k in range(lo + 1, hi):
            node = k  # every token between head and child must descend from head
            while node != head and heads[node] != node:
                node = heads[node]
            if node != head:
                return False
    return True


def test_gold_trees_are_well_formed_spacy_docs(sample):
    vocab = Vocab()
    for _, rec in sample:
        assert len(rec["sentences"]) == 5 and rec["sentences"][0]["view"] == "all_objects"
        for sentence in rec["sentences"]:
            tree = sentence["tree"]
            heads = tree["heads"]
            assert sum(h == i for i, h in enumerate(heads)) == 1, sentence["raw"]
            assert _is_projective(heads), sentence["raw"]
            doc = Doc(
                vocab,
                words=tree["words"],
                spaces=tree["spaces"],
                heads=heads,
                deps=tree["deps"],
                pos=tree["pos"],
                tags=tree["tags"],
                lemmas=tree["lemmas"],
            )
            assert doc.text == sentence["raw"]
            assert [t.head.i for t in doc] == heads
            assert sum(1 for _ in doc.sents) == 1


def test_scene_graphs_refer_to_the_caption(sample):
    for _, rec in sample:
        for sentence in rec["sentences"]:
            graph, lemmas = sentence["scene_graph"], sentence["tree"]["lemmas"]
            n = len(graph["objects"])
            assert n >= 1 and all(name in lemmas for name in graph["objects"])
            for obj, attr in graph["attributes"]:
                assert 0 <= obj < n and attr in sentence["tree"]["words"]
            for subj, predicate, obj in graph["relations"]:
                assert 0 <= subj < n and 0 <= obj < n and subj != obj
                assert all(w in lemmas for w in predicate.split())


def test_relation_words_match_the_geometry():
    rng = np.random.default_rng(0)
    top = DemoObject("circle", "red", "small", (40, 5, 60, 25))
    bottom = DemoObject("square", "blue", "large", (35, 80, 75, 120))
    left = DemoObject("star", "green", "small", (0, 85, 20, 105))
    assert spatial_relation(top, bottom) == "above" and spatial_relation(bottom, top) == "below"
    assert spatial_relation(left, bottom) == "left" and spatial_relation(bottom, left) == "right"
    for _ in range(20):
        ((_, predicate, _),) = caption_relation(rng, top, bottom).relations
        assert predicate.split()[-1] in ("above", "over")
        ((_, predicate, _),) = caption_relation(rng, left, bottom).relations
        assert predicate.endswith(("left of", "next to", "beside"))


def test_captions_read_naturally(sample):
    raws = [s["raw"] for _, rec in sample for s in rec["sentences"]]
    assert all(" ," not in r and "  " not in r and r == r.strip() for r in raws)
    assert not any(" a a" in r or " a e" in r or " a o" in r for r in raws)  # a/an agreement
    assert len(set(raws)) > 0.9 * len(raws)
