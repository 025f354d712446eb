"""benchmarks/gpu_check.py --dry-run: the GPU check end to end on the CPU at tiny sizes
(one run, read by every test here), so that CI runs the script a GPU machine will run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "x.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_part_ran_without_error_or_skip_for_time(dry_run):
    report, _ = dry_run
    assert report["meta"]["dry_run"] is True and report["meta"]["device"] == "cpu"
    for part in ("cuda_tests", "butd", "training", "ddp"):
        assert "error" not in report[part], report[part]
        assert report[part]["part_s"] >= 0
    assert not report["training"]["skipped"]
    assert not report["butd"]["skipped"]


def test_the_cuda_tests_are_collected(dry_run):
    tests = dry_run[0]["cuda_tests"]
    assert tests["collected"] > 0 and tests["returncode"] == 0
    assert tests["strict_skips"] == "cuda"


def test_butd_rates_at_each_batch_on_photos_of_several_sizes(dry_run):
    butd = dry_run[0]["butd"]
    assert butd["images"] == 8 and len(butd["input_sizes_hw"]) > 2
    assert all(min(hw) == 64 for hw in butd["input_sizes_hw"])  # min_side 64 in a dry run
    assert (butd["width"], butd["proposals"]) == (8, 30)
    assert [(r["dtype"], r["batch"]) for r in butd["runs"]] == [
        (dtype, batch) for dtype in ("float32", "bfloat16") for batch in (1, 4, 8)
    ]
    for run in butd["runs"]:
        assert run["images_per_s"] > 0 and run["seconds"] > 0 and run["regions_per_image"] >= 10
        assert run["busy_share"] is None and run["peak_memory_mib"] is None  # no GPU
    assert butd["busy_share_unavailable"]


def test_training_rates_of_both_models_on_the_synthetic_store(dry_run):
    training = dry_run[0]["training"]
    store = training["store"]
    assert (store["images"], store["captions"], store["regions_per_image"]) == (64, 320, 36)
    assert store["region_dim"] == 2048 and "113287" in store["why"]
    assert training["batch"] == 8
    assert set(training["models"]) == {"mvvse", "camera"}
    for row in training["models"].values():
        assert row["steps"] == 5 and row["samples_per_s"] > 0 and row["parameters"] > 0
        assert math.isfinite(row["loss"]) and "capped" not in row


def test_one_ddp_step_and_the_ranks_agree(dry_run):
    ddp = dry_run[0]["ddp"]
    assert (ddp["world_size"], ddp["backend"]) == (1, "gloo")
    assert ddp["params_agree"] and ddp["params_changed"] and ddp["max_param_difference"] == 0
    assert ddp["step_s"] > 0 and ddp["first_step_s"] > 0


def test_targets_are_not_judged_off_a_gpu_and_the_summary_is_printed(dry_run):
    report, stdout = dry_run
    assert {t["met"] for t in report["targets"].values()} == {None}
    assert report["targets"]["butd_images_per_s"]["value"] > 0
    assert "images/s" in stdout  # progress lines
    for row in ("cuda_tests", "butd float32", "training mvvse", "training camera", "ddp"):
        assert any(line.startswith(row) for line in stdout.splitlines()), row
