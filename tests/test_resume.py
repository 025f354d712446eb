"""infra/resume.py: ``--resume`` restores the random streams, torch's and CUDA's, so a
resumed run draws what the uninterrupted run would have drawn; on CUDA, a model with
dropout (HUSE) trained 1 + 1 epochs ends equal to 2 epochs."""

import pytest
import torch
from model_data import TinyPairs
from strict_skips import CUDA
from torch import nn

from infra.resume import read_checkpoint, restore_training, training_state
from models.common import TrainConfig
from models.huse import HUSEConfig
from models.train import train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_resume_restores_the_random_streams(tmp_path, device):
    device = torch.device(device)
    model = nn.Linear(3, 2).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.manual_seed(1)
    torch.rand(5, device=device)  # a state other than the seed's, as after some epochs
    torch.save(
        {"model": "m", **training_state(model, optimizer, scheduler, device)}, tmp_path / "last.pt"
    )
    want = [torch.rand(8), torch.rand(8, device=device)]  # what comes after the saved state
    torch.manual_seed(2)  # a new process seeds its streams afresh
    torch.rand(3, device=device)
    last = tmp_path / "last.pt"
    restore_training(last, {"model": "m"}, model, optimizer, scheduler, device, needs=())
    got = [torch.rand(8), torch.rand(8, device=device)]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_cuda
def test_cuda_training_with_dropout_resumes_exactly(tmp_path):
    """Dropout on the GPU draws from CUDA's generator: a resume that did not restore it
    (or could not load the checkpoint's RNG states onto the CPU) would differ."""
    data = TinyPairs(n_images=32)
    huse = HUSEConfig(hidden=32, image_layers=2, text_layers=2, dropout=0.5)
    cfg = TrainConfig(epochs=2, batch_size=8, lr=2e-3, device="cuda", prefetch=1)

    def run(out, epochs, resume=False):
        run_cfg = cfg.model_copy(update={"epochs": epochs})
        return train("huse", huse, run_cfg, data, data, out, resume=resume, log=lambda m: None)

    full = run(tmp_path / "full", 2)
    run(tmp_path / "split", 1)
    resumed = run(tmp_path / "split", 2, resume=True)
    assert len(resumed["history"]) == 2
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in full["history"]]
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "split" / "last.pt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_is_read_onto_the_cpu_as_plain_data_or_refused_in_one_line(
    tmp_path, monkeypatch
):
    """Whatever device wrote it, onto the CPU (a CUDA checkpoint loads on a CPU-only
    machine), with pickled objects refused; a damaged file names itself and what went
    wrong, then the caller's hint (none by default)."""
    from infra.config import UserError

    good = tmp_path / "last.pt"
    torch.save({"epoch": 3, "weights": torch.ones(2)}, good)
    calls = []
    load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    assert read_checkpoint(good, needs=("epoch",))["epoch"] == 3
    assert calls == [{"map_location": "cpu", "weights_only": True}]
    bad = tmp_path / "cut.pt"
    bad.write_bytes(good.read_bytes()[:40])
    with pytest.raises(UserError) as err:
        read_checkpoint(bad)
    message = str(err.value)
    assert message.startswith(f"{bad}: not a checkpoint torch can read as plain data (")
    assert message.endswith("); ") and "None" not in message and "\n" not in message
    with pytest.raises(UserError, match=r"not a checkpoint of this trainer \(no step\); resume"):
        read_checkpoint(good, hint="resume", needs=("epoch", "step"))
