"""Adversarial captions (UniVSE 4.2): edits that make the caption wrong for its image."""

from features.scenegraph.adversarial import AdversarialConfig, adversarial_captions


def obj(word):
    return {"span": word, "head": word, "lemma": word}


ROWS = [
    {
        "key": "im#0",
        "caption": "a red circle on a blue square",
        "objects": [obj("circle"), obj("square")],
        "attributes": [
            {"object": 0, "attribute": "red", "lemma": "red"},
            {"object": 1, "attribute": "blue", "lemma": "blue"},
        ],
        "relations": [{"subject": 0, "relation": "on", "lemma": "on", "object": 1}],
    },
    {
        "key": "im#1",
        "caption": "a big circle",
        "objects": [obj("circle")],
        "attributes": [{"object": 0, "attribute": "big", "lemma": "big"}],
        "relations": [],
    },
]
VOCAB = {
    "nouns": {"circle": 9, "square": 5, "star": 3, "triangle": 2},
    "adjectives": {"red": 5, "blue": 4, "big": 3, "green": 2, "small": 1},
    "relations": {"on": 5, "under": 2, "beside": 1},
}


def fakes(cfg=None):
    return list(adversarial_captions(ROWS, ["im", "im"], VOCAB, cfg or AdversarialConfig()))


def test_every_fake_is_wrong_for_its_image_and_keeps_a_consistent_graph():
    out = fakes()
    assert {f["attack"] for f in out} == {"object", "attribute", "relation"}
    for f in out:
        source = next(r for r in ROWS if r["key"] == f["source"])
        assert f["caption"] != source["caption"]
        assert f["key"].startswith(f["source"] + "~" + f["attack"] + "~")
        if f["attack"] == "object":
            new = {o["lemma"] for o in f["objects"]} - {"circle", "square"}
            assert new and new <= {"star", "triangle"}
            assert any(w in f["caption"].split() for w in new)
        if f["attack"] == "attribute":
            new = {a["lemma"] for a in f["attributes"]} - {"red", "blue", "big"}
            assert new and new <= {"green", "small"}
        if f["attack"] == "relation":
            assert {r["lemma"] for r in f["relations"]} & {"under", "beside"}
            assert not {r["lemma"] for r in f["relations"]} & {"on"}


def test_counts_distinctness_and_additions():
    out = fakes(AdversarialConfig(per_caption=5))
    for key in ("im#0", "im#1"):
        for attack in ("object", "attribute", "relation"):
            captions = [f["caption"] for f in out if f["source"] == key and f["attack"] == attack]
            assert 1 <= len(captions) <= 5 and len(set(captions)) == len(captions)
    # "a big circle" has no relation: one is attached with a new object
    added = [f for f in out if f["source"] == "im#1" and f["attack"] == "relation"]
    assert all(len(f["objects"]) == 2 and f["relations"][0]["object"] == 1 for f in added)
    assert {f["caption"] for f in added} <= {
        f"a big circle {r} a {n}" for r in ("under", "beside") for n in ("star", "triangle")
    }
    # object attack on the 2-object caption: 2 positions x 2 nouns = 4 distinct fakes
    assert len([f for f in out if f["source"] == "im#0" and f["attack"] == "object"]) == 4


def test_reproducible_and_seeded():
    assert fakes() == fakes()
    other = fakes(AdversarialConfig(seed=1))
    assert {f["caption"] for f in other} <= {
        f["caption"] for f in fakes(AdversarialConfig(per_caption=50, max_tries=500))
    }


def test_graphs_of_real_captions_compounds_and_relation_phrases():
    """Real parses name compounds ("fire hydrant"), relations that are phrases of the
    caption ("parked on the side of"), not contiguous ("sitting alone on") or not in it at
    all (a possessive's "have"): every attack still makes a fake that edits whole names."""
    rows = [
        {
            "key": "a#0",
            "caption": "A red fire hydrant parked on the side of a street.",
            "objects": [
                {"span": "fire hydrant", "head": "hydrant", "lemma": "fire hydrant"},
                obj("street"),
            ],
            "attributes": [{"object": 0, "attribute": "red", "lemma": "red"}],
            "relations": [
                {
                    "subject": 0,
                    "relation": "parked on the side of",
                    "lemma": "park on the side of",
                    "object": 1,
                }
            ],
        },
        {
            "key": "a#1",
            "caption": "A man's dog sitting alone on a park bench.",
            "objects": [
                obj("man"),
                obj("dog"),
                {"span": "park bench", "head": "bench", "lemma": "park bench"},
            ],
            "attributes": [],
            "relations": [
                {"subject": 0, "relation": "have", "lemma": "have", "object": 1},
                {"subject": 1, "relation": "sitting on", "lemma": "sit on", "object": 2},
            ],
        },
    ]
    vocab = {
        "nouns": {"table": 3, "kite": 2},
        "adjectives": {"green": 2},
        "relations": {"under": 2, "sit next to": 1},
    }
    out = list(adversarial_captions(rows, ["a", "a"], vocab, AdversarialConfig(per_caption=10)))
    for key in ("a#0", "a#1"):
        assert {f["attack"] for f in out if f["source"] == key} == {
            "object",
            "attribute",
            "relation",
        }
    captions = {f["caption"] for f in out}
    assert "A red table parked on the side of a street." in captions  # the whole name
    assert not any("fire table" in c or "fire kite" in c for c in captions)
    assert "A red fire hydrant under a street." in captions
    assert "A green fire hydrant parked on the side of a street." in captions
    # nothing replaceable in a#1's text: a relation and a new object are attached
    added = [f for f in out if f["source"] == "a#1" and f["attack"] == "relation"]
    assert added and all(len(f["objects"]) == 4 for f in added)
    assert all(
        f["caption"].startswith("A man's dog sitting alone on a park bench. ") for f in added
    )
    green = [f for f in out if f["source"] == "a#1" and f["attack"] == "attribute"]
    assert any("green park bench" in f["caption"] for f in green)
    assert not any("park green bench" in f["caption"] for f in green)


def test_graph_rows_of_some_captions_are_read_in_file_order(tmp_path):
    from features.scenegraph.files import read_graph_rows, write_scene_graphs

    rows = [{**ROWS[i % 2], "key": f"im{i}#0"} for i in range(6)]
    write_scene_graphs(tmp_path / "graphs", rows, VOCAB)
    assert read_graph_rows(tmp_path / "graphs") == rows
    wanted = {"im4#0": "im4", "im1#0": "im1", "nowhere#0": "nowhere"}  # any iterable of keys
    assert read_graph_rows(tmp_path / "graphs", keys=wanted) == [rows[1], rows[4]]
    assert read_graph_rows(tmp_path / "graphs", keys=[]) == []


def test_fakes_written_in_blocks_read_back_as_made(tmp_path, monkeypatch):
    """The stage writes its fakes a block at a time: the parquet holds every one, in order,
    in one schema, however the blocks fall (here 4 fakes a block, a last one short)."""
    import pyarrow.parquet as pq

    from features.scenegraph import adversarial

    made = fakes()
    assert len(made) % 4  # a short last block
    monkeypatch.setattr(adversarial, "BLOCK", 4)
    keys, captions, counts = adversarial._write_captions(iter(made), tmp_path / "fakes.parquet")
    table = pq.read_table(tmp_path / "fakes.parquet")
    assert table.schema == adversarial.captions_schema()
    assert table.to_pylist() == made
    assert keys == [f["key"] for f in made] and captions == [f["caption"] for f in made]
    assert counts == {
        a: sum(f["attack"] == a for f in made) for a in ("object", "attribute", "relation")
    }
