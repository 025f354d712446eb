"""The demo's spaCy pipeline trained on gold trees, and the scene-graph stage using it."""

import json

import pyarrow.parquet as pq
import pytest

from features.demo import DemoConfig, build_dataset
from features.demo_parser import ParserConfig, evaluate, train
from features.scenegraph import SceneGraph, graph_scores, load_spacy, negative_vocab
from flows.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("parser")
    dataset = build_dataset(DemoConfig(n_train=60, n_val=4, n_test=20), root)
    nlp = train(dataset, ParserConfig(epochs=6, max_train_captions=300), log=lambda m: None)
    nlp.to_disk(root / "pipeline")
    return root, dataset, nlp


def test_trained_pipeline_parses_held_out_captions(trained):
    _, dataset, nlp = trained
    scores = evaluate(nlp, dataset, "test")
    assert scores["captions"] == 100
    assert scores["pos_acc"] > 0.95 and scores["dep_las"] > 0.9 and scores["lemma_acc"] > 0.95
    assert scores["scene_graph"]["relations"]["f1"] > 0.8
    assert scores["scene_graph"]["exact_graphs"] > 0.6


def test_graph_scores_by_hand():
    predicted = SceneGraph(
        objects=[{"lemma": "cat"}, {"lemma": "mat"}],
        attributes=[{"object": 0, "lemma": "black"}],
        relations=[{"subject": 0, "lemma": "under", "object": 1}],
    )
    gold = ({"cat", "mat"}, {("cat", "black"), ("mat", "red")}, {("cat", "on", "mat")})
    scores = graph_scores([predicted], [gold])
    assert scores["objects"]["f1"] == 1.0
    assert scores["attributes"] == {"precision": 1.0, "recall": 0.5, "f1": 0.6667}
    assert scores["relations"]["f1"] == 0.0 and scores["exact_graphs"] == 0.0


def test_missing_spacy_model_is_a_clear_error():
    with pytest.raises(RuntimeError, match="python -m spacy download en_core_web_sm"):
        load_spacy("en_core_web_sm")


def test_negative_vocab_counts_train_only():
    rows = [
        {"objects": [{"lemma": "cat"}], "attributes": [{"lemma": "black"}], "relations": []},
        {"objects": [{"lemma": "dog"}], "attributes": [], "relations": [{"lemma": "on"}]},
        {"objects": [{"lemma": "cat"}], "attributes": [], "relations": []},
    ]
    vocab = negative_vocab(rows, ["train", "test", "train"])
    assert vocab == {"nouns": {"cat": 2}, "adjectives": {"black": 1}, "relations": {}}


def test_scenegraph_stage_with_the_trained_pipeline(trained, tmp_path):
    root, _, _ = trained
    manifest_args = ["--params", str(tmp_path / "p.yaml")]
    (tmp_path / "p.yaml").write_text(
        f"prepare:\n  format: demo\nscenegraph:\n  spacy_model: {root / 'pipeline'}\n"
    )
    assert (
        main(
            [
                *manifest_args,
                "prepare",
                "--annotations",
                str(root / "dataset.json"),
                "--images",
                str(root / "images"),
                "--out",
                str(tmp_path / "m.parquet"),
                "--errors",
                str(tmp_path / "e.csv"),
                "--metrics",
                str(tmp_path / "pm.json"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                *manifest_args,
                "extract",
                "scenegraph",
                "--manifest",
                str(tmp_path / "m.parquet"),
                "--out",
                str(tmp_path / "sg"),
                "--metrics",
                str(tmp_path / "sg.json"),
            ]
        )
        == 0
    )
    table = pq.read_table(tmp_path / "sg" / "graphs.parquet").to_pylist()
    assert len(table) == 84 * 5 and table[0]["key"] == "train_00000#0"
    assert table[0]["objects"] and {"subject", "relation", "lemma", "object"} <= set(
        next(r for row in table for r in row["relations"])
    )
    vocab = json.loads((tmp_path / "sg" / "negatives.json").read_text())
    assert "background" in vocab["nouns"] and vocab["relations"]
