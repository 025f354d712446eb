"""retrieval_metrics against a naive per-query loop and a hand-made 3-image case."""

import numpy as np
import pytest
import torch
from device_check import made_elsewhere

from models.metrics import fold_metrics, retrieval_metrics, retrieval_ranks, similarity_matrix


def naive(sims: np.ndarray, c2i: np.ndarray) -> dict:
    """One query at a time, written from the definition (optimistic ties)."""
    i2t, t2i = [], []
    for i in range(sims.shape[0]):
        best = max(sims[i, c] for c in range(len(c2i)) if c2i[c] == i)
        i2t.append(sum(1 for c in range(len(c2i)) if sims[i, c] > best))
    for c in range(len(c2i)):
        if c2i[c] < 0:
            continue
        t2i.append(sum(1 for i in range(sims.shape[0]) if sims[i, c] > sims[c2i[c], c]))
    out = {}
    for name, ranks in (("i2t", np.array(i2t)), ("t2i", np.array(t2i))):
        for k in (1, 5, 10):
            out[f"{name}_r{k}"] = 100.0 * np.mean(ranks < k)
        out[f"{name}_medr"] = np.floor(np.median(ranks)) + 1
        out[f"{name}_meanr"] = ranks.mean() + 1
    out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    return out


def test_three_images_by_hand():
    # captions 0,1 -> image 0; 2 -> image 1; 3 -> image 2
    sims = torch.tensor(
        [
            [0.9, 0.1, 0.5, 0.2],  # image 0: best GT 0.9, nothing higher -> rank 0
            [0.3, 0.8, 0.4, 0.7],  # image 1: GT 0.4; 0.8 and 0.7 are higher -> rank 2
            [0.2, 0.6, 0.1, 0.6],  # image 2: GT 0.6 tied with caption 1 -> rank 0 (optimistic)
        ]
    )
    c2i = torch.tensor([0, 0, 1, 2])
    m = retrieval_metrics(sims, c2i)
    assert m["i2t_r1"] == pytest.approx(200 / 3)
    assert m["i2t_r5"] == 100.0
    assert m["i2t_medr"] == 1.0 and m["i2t_meanr"] == pytest.approx(5 / 3)
    # t2i: caption 0: 0.9 best -> 0; caption 1: 0.1 vs 0.8, 0.6 -> 2; caption 2: 0.4 vs 0.5 -> 1;
    # caption 3: 0.6 vs 0.7 -> 1
    assert m["t2i_r1"] == 25.0 and m["t2i_r5"] == 100.0
    assert m["t2i_medr"] == 2.0 and m["t2i_meanr"] == pytest.approx(2.0)
    assert m["rsum"] == pytest.approx(200 / 3 + 100 + 100 + 25 + 100 + 100)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_loop_with_ties_and_distractors(seed):
    rng = np.random.default_rng(seed)
    n_img, per = 17, 5
    c2i = np.repeat(np.arange(n_img), per)
    c2i = np.concatenate([c2i, -np.ones(9, dtype=int)])  # 9 distractor captions
    sims = rng.integers(0, 6, size=(n_img, len(c2i))).astype(np.float32)  # many ties
    got = retrieval_metrics(torch.from_numpy(sims), torch.from_numpy(c2i), chunk=4)
    want = naive(sims, c2i)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k]), k


def test_folds_average_per_fold_metrics():
    rng = np.random.default_rng(3)
    sims = rng.normal(size=(20, 100)).astype(np.float32)
    c2i = np.repeat(np.arange(20), 5)
    folds = fold_metrics(torch.from_numpy(sims), torch.from_numpy(c2i), fold_size=10)
    first = naive(sims[:10, :50], c2i[:50])
    second = naive(sims[10:, 50:], c2i[50:] - 10)
    for k in first:
        assert folds[k] == pytest.approx((first[k] + second[k]) / 2), k


@pytest.mark.parametrize("dim", [8, 40])  # fewer and more dimensions than captions
def test_similarity_matrix_in_chunks_equals_one_product(dim):
    """At most ``max_elements`` scores per call: rows of max(1, max_elements // n_txt)."""
    img, txt = torch.randn(10, dim), torch.randn(33, dim)
    calls = []

    def product(a, b):
        calls.append((a.shape[0], b.shape[0]))
        return (a @ b.t()).double()  # float64: the matrix comes back in float32

    for max_elements, rows in ((3 * 33 + 1, [3, 3, 3, 1]), (10 * 33 - 1, [9, 1]), (5, [1] * 10)):
        calls.clear()
        got = similarity_matrix(product, img, txt, max_elements=max_elements)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, img @ txt.t())
        assert calls == [(r, 33) for r in rows], max_elements
    calls.clear()
    torch.testing.assert_close(similarity_matrix(product, img, txt, 10 * 33), img @ txt.t())
    assert calls == [(10, 33)]  # it fits: one call


def test_ranks_in_the_similarities_precision():
    """float64 scores closer than float32 can tell apart keep their order."""
    sims = torch.tensor([[1 + 1e-9, 1 + 5e-10], [0.0, 2.0]], dtype=torch.float64)
    m = retrieval_metrics(sims, torch.tensor([0, 1]))
    assert m["i2t_r1"] == 100.0 and m["t2i_r1"] == 100.0
    assert float(torch.tensor(1 + 1e-9).float()) == 1.0  # in float32 image 0 would rank 1


def test_huge_finite_scores_are_ranked():
    """Their sum overflows to inf: the exact test finds every score finite."""
    sims = torch.full((3, 3), 3e38).fill_diagonal_(3.3e38)
    assert not torch.isfinite(sims.sum())
    m = retrieval_metrics(sims, torch.arange(3))
    assert m["rsum"] == 600.0
    assert fold_metrics(sims, torch.arange(3), fold_size=1)["rsum"] == 600.0


def test_one_fold_and_one_caption():
    rng = np.random.default_rng(4)
    sims = rng.normal(size=(7, 30)).astype(np.float32)
    c2i = np.sort(rng.integers(0, 7, size=30))
    c2i[:7] = np.arange(7)  # every image has a caption
    c2i.sort()
    got = fold_metrics(torch.from_numpy(sims), torch.from_numpy(c2i), fold_size=5)
    want = naive(sims[:5, c2i < 5], c2i[c2i < 5])  # one fold: images 0-4 and their captions
    assert got == pytest.approx(want)
    # a single real caption among distractors
    m = retrieval_metrics(torch.tensor([[0.5, 0.2, 0.9]]), torch.tensor([0, -1, -1]))
    assert (m["i2t_r1"], m["i2t_r5"], m["t2i_r1"], m["i2t_meanr"]) == (0.0, 100.0, 100.0, 2.0)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="image 1 has no caption"):
        retrieval_metrics(torch.zeros(2, 2), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="expected \\(3,\\)"):
        retrieval_metrics(torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="^no caption has an image: nothing to evaluate$"):
        retrieval_metrics(torch.zeros(2, 3), torch.tensor([-1, -1, -1]))
    with pytest.raises(ValueError, match="^caption_to_image refers to image 2 of 2$"):
        retrieval_metrics(torch.zeros(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="^3 images: fewer than one fold of 4$"):
        fold_metrics(torch.zeros(3, 6), torch.arange(6) // 2, fold_size=4)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_similarities_are_refused_not_ranked(value):
    """A NaN never compares greater, so it would rank first and raise the scores."""
    from infra.finite import NonFiniteError

    sims = torch.rand(4, 8)
    sims[2, 5] = value
    message = (
        f"^the similarity of image 2 and caption 5 is {value}: NaN or infinite scores cannot "
        "be ranked; check the checkpoint and the features of that image and caption "
        "\\(vse store verify\\)$"
    )
    with pytest.raises(NonFiniteError, match=message):
        retrieval_metrics(sims, torch.arange(8) // 2)
    with pytest.raises(NonFiniteError, match="image 2 and caption 5"):
        fold_metrics(sims, torch.arange(8) // 2, fold_size=2)
    # a negative's score (not a ground truth), in the third chunk of two rows
    sims = torch.rand(6, 12)
    sims[5, 2] = value
    with pytest.raises(NonFiniteError, match="image 5 and caption 2 is"):
        retrieval_metrics(sims, torch.arange(12) // 2, chunk=2)


def test_tensors_are_made_on_the_scores_device():
    """On a GPU a tensor made on the CPU beside CUDA scores fails or costs a copy; here a
    tensor made without the scores' device lands on the meta device and fails."""
    torch.manual_seed(0)
    sims = torch.randn(10, 50)
    c2i = np.repeat(np.arange(10), 5)  # numpy: becomes a tensor inside, on sims' device
    img, txt = torch.randn(10, 8), torch.randn(50, 8)
    want = retrieval_ranks(sims, c2i), fold_metrics(sims, c2i, 5)
    chunked = similarity_matrix(lambda a, b: a @ b.t(), img, txt, max_elements=100)
    with made_elsewhere():
        ranks = retrieval_ranks(sims, c2i)
        folds = fold_metrics(sims, c2i, 5)
        again = similarity_matrix(lambda a, b: a @ b.t(), img, txt, max_elements=100)
    assert all(torch.equal(a, b) for a, b in zip(ranks, want[0], strict=True))
    assert folds == want[1]
    assert again.device == chunked.device and torch.equal(again, chunked)
    with made_elsewhere(), pytest.raises((RuntimeError, NotImplementedError)):  # it can fail
        torch.full((3,), 1.0) + sims[0, :3]


def test_mean_ranks_are_exact_in_float64():
    """meanr is the float64 mean of integer ranks: counted in float32, 2/3 + 1 would read
    1.6666667461 in the metrics file."""
    sims = torch.tensor([[0.9, 0.1, 0.5], [0.3, 0.8, 0.9], [0.2, 0.6, 0.5]])
    c2i = torch.tensor([0, 1, 2])  # i2t ranks 0, 1, 1; t2i ranks 0, 0, 1
    m = retrieval_metrics(sims, c2i)
    assert m["i2t_meanr"] == float(np.mean([0, 1, 1]) + 1)
    assert m["t2i_meanr"] == float(np.mean([0, 0, 1]) + 1)
    assert m["i2t_meanr"] != float(np.float32(2 / 3) + 1)  # float32 would tell
