"""benchmarks/graph_rise_select.py: Graph-RISE's settings chosen on val alone, test read
once afterwards for the chosen setting only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from features.images.graph_rise import graph as G
from features.images.graph_rise.model import Graph, ItemSets
from features.images.graph_rise.stage import GraphRiseConfig

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "graph_rise_select.py"
GRID = {"input": ["regions", "global"], "dropout": [0.3], "label_weighting": ["none", "idf"]}
GRID["alpha"] = [0.0, 0.5]
SEEDS = (0, 1)
FINALISTS = 3
CFG = GraphRiseConfig(epochs=1, batch_size=16, hidden=8, dim=4, precision_k=3)


@pytest.fixture(scope="module")
def select_script():
    spec = importlib.util.spec_from_file_location("graph_rise_select", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def recorded(name: str, sets: ItemSets, reads: list) -> ItemSets:
    def load(rows):
        reads.append((name, len(rows)))
        return sets.load(rows)

    return ItemSets(load, sets.dim)


def split(mod, seed: int, n: int, train: bool = False, reads: list | None = None):
    """A synthetic split: 5 labels, regions = (the labels' vector, noise), global = one
    vector; ``reads`` records (input, rows) of every item read."""
    rng = np.random.default_rng(seed)
    labels = (rng.random((n, 5)) < 0.4).astype(np.uint8)
    w = np.random.default_rng(99).standard_normal((5, 6))  # each label's vector, every split
    x = labels @ w + 0.5 * rng.standard_normal((n, 6))  # (n, 6)
    regions = np.stack([x, rng.standard_normal(x.shape)], 1).astype(np.float32)  # (n, 2, 6)
    inputs = {
        "regions": ItemSets.of_arrays(regions, np.ones((n, 2), bool)),
        "global": ItemSets.of_arrays(x[:, None, :].astype(np.float32), np.ones((n, 1), bool)),
    }
    if reads is not None:
        inputs = {name: recorded(name, s, reads) for name, s in inputs.items()}
    graph = None
    if train:
        src, dst, w = G.knn_graph(G.image_vectors(labels + 0.01, [1] * n), 3)
        graph = Graph(src, dst, w, n)
    pca = rng.standard_normal((n, 4)).astype(np.float32)
    return mod.Split(labels, pca, inputs, graph)


def without_seconds(selection: dict) -> dict:
    return {
        **selection,
        "candidates": [
            {k: v for k, v in c.items() if k != "seconds"} for c in selection["candidates"]
        ],
    }


def test_the_test_split_is_read_after_the_choice_for_the_chosen_setting_only(
    select_script, monkeypatch
):
    mod = select_script
    train, val = split(mod, 0, 48, train=True), split(mod, 1, 24)
    chosen: list[dict] = []
    real_select = mod.select

    def select_then_note(*args, **kwargs):
        out = real_select(*args, **kwargs)
        chosen.append(out[0]["chosen"])
        return out

    monkeypatch.setattr(mod, "select", select_then_note)

    def run(test_seed: int) -> tuple[dict, list]:
        reads: list = []
        chosen.clear()

        def load(name: str):
            if name == "test":
                assert chosen, "the test split was read before the setting was chosen"
                return split(mod, test_seed, 24, reads=reads)
            return {"train": train, "val": val}[name]

        return mod.run(load, GRID, SEEDS, CFG, FINALISTS, log=lambda s: None), reads

    result, reads = run(2)
    # test items read for the chosen input only, once per seed's head
    assert len(result["candidates"]) == 8
    assert [name for name, _ in reads] == [result["chosen"]["input"]] * len(SEEDS)
    # the choice and every val figure are selection's on (train, val) alone ...
    alone, _ = real_select(train, val, GRID, SEEDS, CFG, FINALISTS, log=lambda s: None)
    assert without_seconds({k: result[k] for k in alone}) == without_seconds(alone)
    rows = alone["candidates"]
    first = sorted(c["val_per_seed"][0] for c in rows)
    final = [c for c in rows if c["finalist"]]  # the best by the first seed, every seed
    assert len(final) == FINALISTS and min(c["val_per_seed"][0] for c in final) == first[-FINALISTS]
    assert all(len(c["val_per_seed"]) == (len(SEEDS) if c["finalist"] else 1) for c in rows)
    best = max(final, key=lambda c: c["val"])
    assert alone["chosen"] == {k: best[k] for k in GRID} and alone["chosen_val"] == best["val"]
    # ... and another test split changes the test figures, nothing else
    other, _ = run(3)
    assert other["test"] != result["test"]
    assert without_seconds({k: other[k] for k in alone}) == without_seconds(alone)
    t = result["test"]
    assert t["trained"] == pytest.approx(np.mean(t["trained_per_seed"]), abs=1e-4)
    assert t["trained_over_pca"] == pytest.approx(t["trained"] / t["pca"], abs=2e-3)


def test_candidates_cover_the_grid_in_order(select_script):
    got = select_script.candidates({"a": [1, 2], "b": ["x", "y", "z"]})
    assert len(got) == 6 and got[0] == {"a": 1, "b": "x"} and got[1] == {"a": 1, "b": "y"}
    assert {(c["a"], c["b"]) for c in got} == {(a, b) for a in (1, 2) for b in "xyz"}
