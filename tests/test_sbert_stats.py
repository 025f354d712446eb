"""Sentence-BERT caption statistics and offline text-model resolution (bundled MiniLM)."""

import json

import numpy as np
import pytest
from demo_data import demo_manifest

from features.ingest.manifest import Dataset, Record, read_manifest, write_manifest
from features.text.models import TextModelError, model_digest, resolve_model
from features.text.sbert_stats import (
    SbertConfig,
    caption_statistics,
    pairwise_similarities,
    summarise,
)
from flows.cli import main


@pytest.fixture(scope="module")
def minilm():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(resolve_model("all-MiniLM-L6-v2")), device="cpu")


def test_bundled_minilm_scores_paraphrases_above_unrelated_text(minilm):
    e = minilm.encode(
        [
            "a dog runs across the grass",
            "a puppy is running on a lawn",
            "the stock market fell sharply today",
        ],
        normalize_embeddings=True,
    )
    sims = e @ e.T
    assert sims[0, 1] > sims[0, 2] + 0.3 and sims[0, 1] > sims[1, 2] + 0.3


def test_missing_models_are_clear_errors(tmp_path):
    with pytest.raises(TextModelError, match="not available offline.*nothing is downloaded"):
        resolve_model("no-such-org/no-such-model")
    with pytest.raises(TextModelError, match="no config.json"):
        resolve_model(str(tmp_path))
    folder = resolve_model("minilm")
    assert (folder / "config.json").exists() and len(model_digest(folder)) == 64


def test_pairwise_similarities_are_every_pair_of_an_images_captions():
    rng = np.random.default_rng(0)
    counts = [3, 1, 0, 5, 2]
    e = rng.standard_normal((sum(counts), 6)).astype(np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    pairs = pairwise_similarities(e, counts)
    start = 0
    for n, got in zip(counts, pairs, strict=True):
        rows = e[start : start + n].astype(np.float64)
        want = [rows[i] @ rows[j] for i in range(n) for j in range(i + 1, n)]
        assert got.dtype == np.float64 and len(got) == n * (n - 1) // 2
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        start += n


# Known captions: unit vectors whose cosines are exact. Train: image a (3 captions, pairs
# 0, -1, 0), b (pair 0.6), c (1 caption, no pair); test: d (pairs 1, 0.8, 0.8), e (-0.6);
# no val image.
VECTORS = {
    "a0": [1, 0, 0],
    "a1": [0, 1, 0],
    "a2": [-1, 0, 0],
    "b0": [1, 0, 0],
    "b1": [0.6, 0.8, 0],
    "c0": [0, 0, 1],
    "d0": [0, 0, 1],
    "d1": [0, 0, 1],
    "d2": [0, 0.6, 0.8],
    "e0": [0, 1, 0],
    "e1": [0, -0.6, 0.8],
}
IMAGES = {"a": "train", "b": "train", "c": "train", "d": "test", "e": "test"}
# the statistics worked out by hand (numpy's default linear interpolation for quantiles:
# q at position q (n - 1) of the sorted values)
TRAIN = {  # sorted pairs -1, 0, 0, 0.6
    "images": 3,
    "pairs": 4,
    "mean": -0.1,
    "std": 0.33**0.5,  # squared deviations 0.81, 0.01, 0.01, 0.49
    "fraction_below_0": 0.25,
    "q05": -0.85,  # position 0.15: -1 + 0.15 * (0 - -1)
    "q25": -0.25,
    "median": 0.0,
    "q75": 0.15,  # position 2.25: 0 + 0.25 * 0.6
    "q95": 0.51,
}
TEST = {  # sorted pairs -0.6, 0.8, 0.8, 1
    "images": 2,
    "pairs": 4,
    "mean": 0.5,
    "std": 0.41**0.5,  # squared deviations 1.21, 0.09, 0.09, 0.25
    "fraction_below_0": 0.25,
    "q05": -0.39,  # position 0.15: -0.6 + 0.15 * 1.4
    "q25": 0.45,
    "median": 0.8,
    "q75": 0.85,
    "q95": 0.97,
}


def test_summary_by_hand_and_by_numpy():
    e = np.array([VECTORS[k] for k in ("a0", "a1", "a2", "b0", "b1", "c0")], dtype=np.float64)
    pairs = pairwise_similarities(e, [3, 2, 1])
    assert [p.tolist() for p in pairs] == [[0.0, -1.0, 0.0], [0.6], []]
    summary = summarise(pairs)
    assert summary == {k: pytest.approx(v, abs=1e-12) for k, v in TRAIN.items()}
    values = np.array([0.0, -1.0, 0.0, 0.6])
    numpy_says = np.quantile(values, [0.05, 0.25, 0.5, 0.75, 0.95])
    assert [summary[k] for k in ("q05", "q25", "median", "q75", "q95")] == pytest.approx(
        numpy_says, abs=1e-12
    )
    assert summary["mean"] == pytest.approx(values.mean(), abs=1e-15)
    assert summary["std"] == pytest.approx(values.std(), abs=1e-15)
    assert summarise([]) == {"images": 0, "pairs": 0}
    assert summarise([np.zeros(0), np.zeros(0)]) == {"images": 2, "pairs": 0}


def test_caption_statistics_of_known_captions(tmp_path):
    records = [
        Record(key, f"{key}.jpg", split, sorted(c for c in VECTORS if c[0] == key))
        for key, split in IMAGES.items()
    ]
    write_manifest(records, Dataset("known", records), 1, tmp_path / "m.parquet")
    manifest = read_manifest(tmp_path / "m.parquet")

    def embed(captions):
        return np.array([VECTORS[c] for c in captions], dtype=np.float64)

    result = caption_statistics(manifest, embed, SbertConfig(bins=3, examples=2))
    metrics = result["metrics"]
    assert list(metrics) == ["train", "test"]  # no val image: no val entry
    assert metrics["train"] == {k: pytest.approx(v, abs=1e-12) for k, v in TRAIN.items()}
    assert metrics["test"] == {k: pytest.approx(v, abs=1e-12) for k, v in TEST.items()}
    # bins [-1, -1/3), [-1/3, 1/3), [1/3, 1] at their centres, to 4 decimals
    assert [(h["split"], h["similarity"], h["pairs"]) for h in result["histogram"]] == [
        ("train", -0.6667, 1),
        ("train", 0.0, 2),
        ("train", 0.6667, 1),
        ("test", -0.6667, 1),
        ("test", 0.0, 0),
        ("test", 0.6667, 3),
    ]
    extremes = result["extremes"]
    assert set(extremes) == {"train", "test"}

    def listed(split, which):
        return [(x["key"], x["mean_similarity"]) for x in extremes[split][which]]

    # image means: a -1/3, b 0.6 (c has no pair); d 2.6/3, e -0.6
    assert listed("train", "most_consistent") == [("b", 0.6), ("a", -0.3333)]
    assert listed("train", "least_consistent") == [("a", -0.3333), ("b", 0.6)]
    assert listed("test", "most_consistent") == [("d", 0.8667), ("e", -0.6)]
    assert listed("test", "least_consistent") == [("e", -0.6), ("d", 0.8667)]
    assert extremes["test"]["most_consistent"][0]["captions"] == ["d0", "d1", "d2"]
    one = caption_statistics(manifest, embed, SbertConfig(bins=3, examples=1))["extremes"]
    assert [x["key"] for x in one["train"]["most_consistent"]] == ["b"]
    assert [x["key"] for x in one["train"]["least_consistent"]] == ["a"]


def test_statistics_per_split_with_extremes(tmp_path):
    manifest = demo_manifest(tmp_path, n_train=6, n_val=3, n_test=3)
    rng = np.random.default_rng(0)

    def embed(captions):
        x = rng.standard_normal((len(captions), 8)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    result = caption_statistics(manifest, embed, SbertConfig(bins=10, examples=2))
    train = result["metrics"]["train"]
    assert train["images"] == 6 and train["pairs"] == 6 * 10
    assert 0 < train["fraction_below_0"] < 1 and train["q05"] <= train["median"] <= train["q95"]
    assert sum(h["pairs"] for h in result["histogram"] if h["split"] == "val") == 30
    most, least = (result["extremes"]["test"][k] for k in ("most_consistent", "least_consistent"))
    assert most[0]["mean_similarity"] >= least[0]["mean_similarity"] and len(most) == 2


def test_cli_writes_metrics_plot_and_examples(tmp_path, repo_root):
    demo_manifest(tmp_path, n_train=4, n_val=2, n_test=2)
    out = tmp_path / "out"
    args = [
        "--params",
        str(repo_root / "params.yaml"),
        "stats",
        "sbert",
        "--manifest",
        str(tmp_path / "manifest.parquet"),
        "--metrics",
        str(out / "m.json"),
        "--histogram",
        str(out / "h.json"),
        "--png",
        str(out / "h.png"),
        "--examples",
        str(out / "e.json"),
    ]
    assert main(args) == 0
    metrics = json.loads((out / "m.json").read_text())
    assert set(metrics) == {"train", "val", "test"} and metrics["train"]["pairs"] == 40
    assert (out / "h.png").read_bytes()[:4] == b"\x89PNG"
