"""Sentence-BERT caption statistics and offline text-model resolution (bundled MiniLM)."""

import json

import numpy as np
import pytest

from features.demo import DemoConfig, build_dataset
from features.ingest import READERS, PrepareConfig, read_manifest, validate, write_manifest
from features.sbert_stats import SbertConfig, caption_statistics, pairwise_similarities
from features.text_models import TextModelError, model_digest, resolve_model
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


def test_pairwise_similarities_and_summary_by_hand():
    e = np.array([[1, 0], [0, 1], [-1, 0], [1, 0], [0.6, 0.8]], dtype=np.float32)
    pairs = pairwise_similarities(e, [3, 2])
    assert pairs[0].tolist() == pytest.approx([0.0, -1.0, 0.0])
    assert pairs[1].tolist() == pytest.approx([0.6])


def test_statistics_per_split_with_extremes(tmp_path):
    build_dataset(DemoConfig(n_train=6, n_val=3, n_test=3), tmp_path)
    dataset = READERS["demo"](tmp_path / "dataset.json", tmp_path / "images", PrepareConfig())
    records, _ = validate(dataset, tmp_path / "images", 5)
    write_manifest(records, dataset, 5, tmp_path / "m.parquet")
    manifest = read_manifest(tmp_path / "m.parquet")
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
    build_dataset(DemoConfig(n_train=4, n_val=2, n_test=2), tmp_path)
    dataset = READERS["demo"](tmp_path / "dataset.json", tmp_path / "images", PrepareConfig())
    records, _ = validate(dataset, tmp_path / "images", 5)
    write_manifest(records, dataset, 5, tmp_path / "m.parquet")
    out = tmp_path / "out"
    args = [
        "--params",
        str(repo_root / "params.yaml"),
        "stats",
        "sbert",
        "--manifest",
        str(tmp_path / "m.parquet"),
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
