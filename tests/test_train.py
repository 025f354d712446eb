"""The training loop: exact resume, NaN guard, DDP with gloo on CPU, checkpoints as data."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from model_data import TinyPairs

from infra.schedule import lr_factor
from models.common import TrainConfig
from models.huse import HUSEConfig
from models.train import TrainingError, epoch_batches, load_checkpoint, train, write_history
from models.univse import UniVSEConfig
from models.vsepp import VSEPPConfig

VSEPP = VSEPPConfig(embed_size=32, word_dim=16)
CFG = TrainConfig(epochs=3, batch_size=8, lr=2e-3, lr_decay_epochs=[2], device="cpu")


@pytest.fixture(scope="module")
def data():
    return TinyPairs(n_images=32)


def test_resume_continues_exactly(tmp_path, data):
    full = train("vsepp", VSEPP, CFG, data, data, tmp_path / "full", log=lambda m: None)
    train(
        "vsepp",
        VSEPP,
        CFG.model_copy(update={"epochs": 1}),
        data,
        data,
        tmp_path / "split",
        log=lambda m: None,
    )
    resumed = train(
        "vsepp", VSEPP, CFG, data, data, tmp_path / "split", resume=True, log=lambda m: None
    )
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in full["history"]]
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "split" / "last.pt", weights_only=True)["state_dict"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    # best.pt is plain data and rebuilds the model without the stores
    model, info = load_checkpoint(tmp_path / "full" / "best.pt")
    assert info == data.info
    assert model.cfg.embed_size == 32


@pytest.mark.parametrize(
    "name, model_cfg",
    [
        # dropout 0.15 between the tower layers (Sec. 4.1.3): a fresh mask every step
        ("huse", HUSEConfig(hidden=32, image_layers=2, text_layers=2)),
        # negatives sampled from the global torch RNG every step (sec. 3.4)
        ("univse", UniVSEConfig(embed_size=16, d_basic=8, d_modif=8, rel_start_epoch=0)),
    ],
)
def test_resume_continues_exactly_when_the_model_draws_from_the_rng(
    tmp_path, data, name, model_cfg
):
    """A model that draws from torch's RNG while training ends bit-identical after a
    resume only if the RNG state saved after epoch 0 is restored: the resumed run would
    otherwise draw epoch 1's dropout masks or negatives from the state right after the
    model's initialisation."""
    cfg = CFG.model_copy(update={"epochs": 2, "lr_decay_epochs": [1]})
    quiet = dict(log=lambda m: None)
    full = train(name, model_cfg, cfg, data, data, tmp_path / "full", **quiet)
    first = cfg.model_copy(update={"epochs": 1})
    train(name, model_cfg, first, data, data, tmp_path / "split", **quiet)
    resumed = train(name, model_cfg, cfg, data, data, tmp_path / "split", resume=True, **quiet)
    assert len(resumed["history"]) == 2
    assert resumed["history"] == full["history"]
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "split" / "last.pt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_refuses_another_config(tmp_path, data):
    train("vsepp", VSEPP, CFG.model_copy(update={"epochs": 1}), data, data, tmp_path, log=print)
    with pytest.raises(TrainingError, match="another config"):
        train(
            "vsepp",
            VSEPP.model_copy(update={"margin": 0.5}),
            CFG,
            data,
            data,
            tmp_path,
            resume=True,
        )


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, data):
    def poison(model):
        loss = model.loss

        def poisoned(batch):
            out = loss(batch)
            return {"loss": out["loss"] * (math.nan if batch["epoch"] == 1 else 1.0)}

        model.loss = poisoned

    with pytest.raises(TrainingError, match=r"loss is nan at epoch 1 step 0.*last.pt \(epoch 0\)"):
        train("vsepp", VSEPP, CFG, data, data, tmp_path, prepare_model=poison, log=print)
    kept = torch.load(tmp_path / "last.pt", weights_only=True)
    assert kept["epoch"] == 0
    assert all(torch.isfinite(v).all() for v in kept["state_dict"].values())


def test_batches_are_disjoint_equal_per_rank_and_seeded_by_epoch():
    ranks = [epoch_batches(100, 8, seed=0, epoch=3, rank=r, world=2) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 6
    seen = [int(i) for r in ranks for b in r for i in b]
    assert len(seen) == len(set(seen)) == 96
    again = epoch_batches(100, 8, seed=0, epoch=3, rank=0, world=2)
    assert all((a == b).all() for a, b in zip(again, ranks[0], strict=True))
    other = epoch_batches(100, 8, seed=0, epoch=4, rank=0, world=2)
    assert not all((a == b).all() for a, b in zip(other, ranks[0], strict=True))


def test_lr_schedule_warms_up_then_decays():
    f = lr_factor(10, warmup_steps=4, lr_decay=0.1, lr_decay_epochs=[2])
    assert [round(f(s), 3) for s in (0, 1, 3, 10, 19, 20, 35)] == [
        0.25,
        0.5,
        1.0,
        1.0,
        1.0,
        0.1,
        0.1,
    ]


def test_torchrun_two_processes_gloo(tmp_path, repo_root):
    """``torchrun --nproc_per_node 2`` on CPU: both ranks train, rank 0 writes the
    checkpoint, and the replicas end with identical weights."""
    env = {**os.environ, "PYTHONPATH": f"{repo_root}:{repo_root / 'tests'}", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29533",
        str(repo_root / "tests" / "jobs" / "ddp_train_job.py"),
        str(tmp_path),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    digests = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert digests[0] == digests[1]
    assert (tmp_path / "model" / "best.pt").exists()
    # 32 pairs, batch 8, 2 ranks: 2 steps per epoch per rank
    assert "step 2/2" in result.stdout + result.stderr


def test_the_history_files_hold_the_last_and_the_best_epoch_and_a_flat_table(tmp_path):
    """The metrics file DVC reads (epochs, last, best by val rsum) and the plot table (one
    row per epoch, nested values left out); nothing is written for an empty history."""
    history = [
        {"epoch": 1, "loss": 2.5, "val_rsum": 100.0, "val": {"r1": 1.0}},
        {"epoch": 2, "loss": 1.5, "val_rsum": 140.0, "val": {"r1": 2.0}},
        {"epoch": 3, "loss": 1.0, "val_rsum": 120.0, "val": {"r1": 3.0}},
    ]
    metrics, plot = tmp_path / "m.json", tmp_path / "p.json"
    write_history(history, metrics, plot)
    assert json.loads(metrics.read_text()) == {
        "epochs": 3,
        "last": history[2],
        "best": history[1],
    }
    assert json.loads(plot.read_text()) == [
        {"epoch": e, "loss": loss, "val_rsum": r}
        for e, loss, r in ((1, 2.5, 100.0), (2, 1.5, 140.0), (3, 1.0, 120.0))
    ]
    no_val = [{"epoch": 1, "loss": 3.0}, {"epoch": 2, "loss": 2.0}]
    write_history([{"epoch": 1}, *history[:1]], metrics, None)  # unvalidated: never best
    assert json.loads(metrics.read_text())["best"] == history[0]
    write_history(no_val, metrics, None)  # no selection on val: the first epoch is "best"
    assert json.loads(metrics.read_text())["best"] == no_val[0]
    write_history(no_val, None, plot)
    assert json.loads(plot.read_text()) == no_val
    empty = tmp_path / "e.json"
    write_history([], empty, empty)
    assert not empty.exists()
