"""The model comparison (models/report/table.py): the chance level against counting and
simulation, every cell of the tables against values written by hand, and the papers'
numbers as printed in their tables."""

from __future__ import annotations

import math
from itertools import combinations

import pytest
import torch

from models.metrics import retrieval_metrics
from models.report.table import chance_rsum, markdown_table


def counted_chance(images: int, per_image: int) -> float:
    """Expected rsum of random scores by counting: an image's captions lie on every set of
    positions among the n candidates equally often (i2t), a caption's image on every
    position among the images (t2i)."""
    n = images * per_image
    sets = list(combinations(range(n), per_image))
    i2t = [sum(min(s) < k for s in sets) / len(sets) for k in (1, 5, 10)]
    t2i = [sum(pos < k for pos in range(images)) / images for k in (1, 5, 10)]
    return 100 * (sum(i2t) + sum(t2i))


@pytest.mark.parametrize(
    "images, per_image", [(4, 2), (10, 2), (3, 5), (12, 1), (2, 3), (1, 1), (25, 1)]
)
def test_chance_rsum_counted(images, per_image):
    """Splits smaller than K = 10 on either side included (everything is in the top K)."""
    result = {"images": images, "captions": images * per_image}
    assert chance_rsum(result) == pytest.approx(counted_chance(images, per_image))


def test_chance_rsum_by_hand():
    # 4 images, 2 captions each: i2t R@1 2/8, R@5 1 - C(6,5)/C(8,5) = 50/56, R@10 1 (all 8
    # captions are in the top 10); t2i R@1 1/4, R@5 = R@10 = 1
    want = 100 * (2 / 8 + 50 / 56 + 1 + 1 / 4 + 1 + 1)
    assert chance_rsum({"images": 4, "captions": 8}) == pytest.approx(want)
    # COCO 5K: P(no caption of 5 in the top K of 25000) = prod_j (24995 - j) / (25000 - j)
    i2t = sum(1 - math.prod((24995 - j) / (25000 - j) for j in range(k)) for k in (1, 5, 10))
    want = 100 * (i2t + (1 + 5 + 10) / 5000)
    assert chance_rsum({"images": 5000, "captions": 25000}) == pytest.approx(want)
    assert want == pytest.approx(0.64, abs=0.01)  # about 16 / 25000 + 16 / 5000


def test_chance_rsum_is_what_random_scores_get():
    """The mean rsum of 300 random similarity matrices, ranked by retrieval_metrics."""
    g = torch.Generator().manual_seed(0)
    c2i = torch.arange(150) // 5  # 30 images, 5 captions each
    rsums = [retrieval_metrics(torch.rand(30, 150, generator=g), c2i)["rsum"] for _ in range(300)]
    mean, sem = float(torch.tensor(rsums).mean()), float(torch.tensor(rsums).std()) / 300**0.5
    assert mean == pytest.approx(chance_rsum({"images": 30, "captions": 150}), abs=4 * sem)


def full(i2t, t2i):
    keys = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
    values = dict(zip(keys, (*i2t, *t2i), strict=True))
    return values | {"rsum": sum(i2t) + sum(t2i), "i2t_medr": 3.0, "t2i_medr": 2.0}


LEFT = {"captions": 8, "left_out": 0}
RESULTS = {
    "vsepp": {
        "split": "test",
        "images": 4,
        "captions": 8,
        "full": full((25.0, 75.0, 100.0), (37.5, 100.0, 100.0)),
        "folds": {"fold_size": 2, "n_folds": 2, "rsum": 525.0, "i2t_r1": 50.0} | LEFT,
        "adversarial": {
            "attribute": {"i2t_r1": 0.0, "i2t_r5": 75.0, "fake_captions": 2},
            "relation": {"i2t_r1": 25.0, "i2t_r5": 75.0, "fake_captions": 1},
        },
    },
    "huse": {
        "split": "test",
        "images": 4,
        "captions": 8,
        "full": full((12.34, 66.66, 99.96), (0.04, 50.0, 87.5)),
        "adversarial": {"object": {"i2t_r1": 8.34, "i2t_r5": 50.0, "fake_captions": 3}},
        "classification": {
            "accuracy_image": 50.0,
            "accuracy_text": 62.5,
            "accuracy_fused": 75.0,
            "accuracy_fused_equal": 62.54,
            "fusion_weight_image": 0.35,
            "class_image_to_text_r1": 75.0,
            "class_text_to_image_r1": 62.54,
            "class_image_to_image_r1": 50.0,
            "class_text_to_text_r1": 12.5,
            "class_text_to_text_r5": 99.0,
        },
    },
}

TABLE = """\
Split `test`: 4 images, 8 captions (R@K in %, rsum = sum of the six R@K).

| model | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | rsum | folds rsum \
| adv. R@1 object | attribute | relation |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| vsepp | 25.0 | 75.0 | 100.0 | 37.5 | 100.0 | 100.0 | 437.5 | 525.0 | - | 0.0 | 25.0 |
| huse | 12.3 | 66.7 | 100.0 | 0.0 | 50.0 | 87.5 | 316.5 | - | 8.3 | - | - |

Chance level (random scores): rsum 439.3 on the whole split.
Folds rsum: mean over 2 folds of 2 images (NOT the COCO 1K protocol (1000)); 0 images of \
the split left out of the folds; chance level per fold: rsum 500.0.

| model | accuracy image | text | fused | image weight | fused, equal weights \
| class-level R@1 i2t | t2i | i2i | t2t |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| huse | 50.0 | 62.5 | 75.0 | 0.35 | 62.5 | 75.0 | 62.5 | 50.0 | 12.5 |

Fused: the image and text softmaxes averaged with the image weight chosen on the val split \
(HUSE Sec. 4.5 gives none); beside it with equal weights.

Reported in the papers (their data and features; for orientation only):

| model | setting | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 |
|---|---|---:|---:|---:|---:|---:|---:|
| vsepp | MS-COCO 1K, fixed CNN (UniVSE Table 1) | 57.7 | 86.0 | 94.0 | 42.8 | 77.2 | 87.4 |
| huse | UPMC Food-101: accuracy image 73.8, text 87.3, fused 92.3 (HUSE Table 3) \
| - | - | - | - | - | - |
"""


def test_markdown_table_cell_by_cell():
    """Rows in the order of the results, each cell the value rounded to 0.1 (the chance
    level is test_chance_rsum_by_hand's 439.29; per fold of 2 images with 2 captions
    each, i2t R@1 1 - C(2, 1) / C(4, 1), R@5 = R@10 = 1 and t2i 1/2, 1, 1: 500), '-'
    where a model has no such number."""
    assert markdown_table(RESULTS) == TABLE


def test_markdown_table_without_results():
    assert markdown_table({}) == "_no evaluation results_\n"


def test_an_ablation_is_a_row_of_its_own_beside_its_model():
    """A run of models.ablations (e.g. HUSE on the pooled feature beside HUSE on Graph-RISE)
    is a row under its run name in both tables, named with its model and store below the
    table; the papers' row of the model is shown once."""
    pca = RESULTS["huse"] | {"model": "huse", "image_store": "global.zarr"}
    pca = pca | {"full": full((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))}
    table = markdown_table({"huse": RESULTS["huse"] | {"model": "huse"}, "huse-pooled": pca})
    assert "| huse-pooled | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 21.0 | - | 8.3 | - | - |" in table
    assert "| huse-pooled | 50.0 | 62.5 | 75.0 | 0.35 | 62.5 | 75.0 | 62.5 | 50.0 | 12.5 |" in table
    assert "Ablations (`models.ablations`): huse-pooled is huse on global.zarr." in table
    assert table.count("| huse | UPMC Food-101") == 1


def test_ablations_alone_older_results_and_an_unnamed_store():
    """Only ablation runs (their models' own rows absent): each is named below the table,
    an unnamed store as such, and its model's papers' row is still shown; a result file
    from before the val-chosen fusion weight has '-' in those two cells."""
    older = dict(RESULTS["huse"]["classification"])
    del older["fusion_weight_image"], older["accuracy_fused_equal"]
    runs = {
        "huse-pooled": RESULTS["huse"] | {"model": "huse", "image_store": "global.zarr"},
        "vsepp-grid": RESULTS["vsepp"] | {"model": "vsepp"},
    }
    runs["huse-pooled"] = runs["huse-pooled"] | {"classification": older}
    table = markdown_table(runs)
    assert (
        "\n\nAblations (`models.ablations`): huse-pooled is huse on global.zarr; vsepp-grid is "
        "vsepp on another image store.\n"
    ) in table
    assert "| huse-pooled | 50.0 | 62.5 | 75.0 | - | - | 75.0 | 62.5 | 50.0 | 12.5 |" in table
    papers = table.split("Reported in the papers")[1]
    assert papers.count("| huse | UPMC Food-101") == 1 and papers.count("| vsepp | MS-COCO") == 1


# as printed in each paper's table (../shared/papers): i2t R@1/5/10, t2i R@1/5/10
PAPERS = {
    "vsepp": ("UniVSE Table 1", "57.7 | 86.0 | 94.0 | 42.8 | 77.2 | 87.4"),  # VSE++ [11, 2], 1K
    "mvvse": ("MV-VSE Table 2", "56.7 | 84.1 | 91.4 | 40.3 | 70.6 | 81.6"),  # GPO (MV-VSE), RNN
    "camera": ("CAMERA Table 3", "75.9 | 95.5 | 98.6 | 62.3 | 90.1 | 95.2"),  # single model
    "univse": ("UniVSE Table 1", "64.3 | 89.2 | 94.8 | 48.3 | 81.7 | 91.2"),  # 1K
}


def test_paper_rows_are_the_papers_numbers():
    results = {
        name: {"split": "test", "images": 1000, "captions": 5000, "full": full((0,) * 3, (0,) * 3)}
        for name in ("camera", "univse", "mvvse", "huse", "vsepp")
    }
    table = markdown_table(results)
    papers = table.split("Reported in the papers")[1].splitlines()
    rows = [r for r in papers if r.startswith("| ") and not r.startswith("| model")]
    assert [r.split(" | ")[0] for r in rows] == [f"| {n}" for n in results]  # results' order
    for row in rows:
        name, setting, *cells = row.strip("| ").split(" | ")
        if name == "huse":  # classification accuracy, no retrieval (HUSE Table 3)
            assert "73.8" in setting and "87.3" in setting and "92.3" in setting
            assert cells == ["-"] * 6
            continue
        source, numbers = PAPERS[name]
        assert source in setting and " | ".join(cells) == numbers, name
    assert "MS-COCO 5K" in rows[2] and "MV-VSE" in rows[2]  # mvvse: the 5K table
