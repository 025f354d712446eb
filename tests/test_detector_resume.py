"""The detector's preemption: SIGTERM at a drawn step -> ``last.pt`` written mid-epoch and
exit status 75 -> ``--resume`` goes on with the very next batch, with the images read in
the loop or by 2 DataLoader workers (which ignore the signal sent to the process group),
reads none of the images of the batches before it, and ends with the weights of an
uninterrupted run, bit for bit."""

import os
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from detector_data import QUIET, TINY, make_demo

from features.detector.loader import DetectionItems
from features.detector.train import train_detector
from infra.resume import RESUMABLE_EXIT, Preempted

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return root, *make_demo(root)


def signal_group_at(monkeypatch, step: int, ignored: list) -> None:
    """During optimizer step ``step`` (counted over the run): SIGTERM to this process and
    its children (the loader's workers), as a queue signals a job's process group; notes
    in ``ignored`` whether each worker ignores SIGTERM and SIGINT (/proc's SigIgn mask)."""
    original, count = torch.optim.SGD.step, [0]
    earlier = {p.pid for p in psutil.Process().children()}  # not the run's (other tests')

    def step_then_signal(self, *args, **kwargs):
        count[0] += 1
        if count[0] == step:
            for child in psutil.Process().children():
                if child.pid in earlier:
                    continue
                status = Path(f"/proc/{child.pid}/status").read_text()
                mask = int(status.split("SigIgn:")[1].split()[0], 16)
                ignored.append(all(mask >> (s - 1) & 1 for s in (signal.SIGTERM, signal.SIGINT)))
                os.kill(child.pid, signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", step_then_signal)


def record_reads(monkeypatch, log: Path) -> None:
    """Every image the items read (in this process or a forked worker): a line
    ``key flip`` appended to ``log``."""
    original = DetectionItems.__getitem__

    def reading(self, job):
        with open(log, "a") as f:
            f.write(f"{self.images[job[0]].key} {int(job[1])}\n")
        return original(self, job)

    monkeypatch.setattr(DetectionItems, "__getitem__", reading)


def jobs_from(train, cfg, epoch: int, step: int) -> list[str]:
    """The train images (``key flip``) of epochs ``epoch``.. from batch ``step`` on, from
    the definition: per epoch a permutation and flips drawn from ``(seed, epoch)``, cut
    into full batches."""
    out = []
    for e in range(epoch, cfg.epochs):
        rng = np.random.default_rng([cfg.seed, e])
        order = rng.permutation(len(train))
        flips = rng.random(len(train)) < 0.5
        usable = len(train) // cfg.batch_size * cfg.batch_size
        first = step * cfg.batch_size if e == epoch else 0
        out += [f"{train[i].key} {int(flips[i])}" for i in order[first:usable]]
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_mid_epoch_then_resume_equals_an_uninterrupted_run(
    demo, tmp_path, monkeypatch, workers
):
    root, _, data = demo
    cfg = TINY.model_copy(update={"num_workers": workers})
    train = data.split("train")
    steps = len(train) // cfg.batch_size
    train_detector(data, root / "images", cfg, tmp_path / "full", **QUIET)
    # a step of either epoch, not its last (that one ends the epoch), drawn per case
    at = int(np.random.default_rng(workers).choice([s for s in range(1, 2 * steps) if s % steps]))
    ignored: list[bool] = []
    with monkeypatch.context() as patch:
        signal_group_at(patch, at, ignored)
        with pytest.raises(Preempted, match="stopped by SIGTERM.*rerun with --resume") as err:
            train_detector(data, root / "images", cfg, tmp_path / "split", **QUIET)
    assert err.value.exit_code == RESUMABLE_EXIT == 75
    assert len(ignored) == workers and all(ignored)
    split = tmp_path / "split"
    assert not (split / "detector.pt").exists()
    ckpt = torch.load(split / "last.pt", weights_only=True)
    epoch, step = divmod(at, steps)
    assert (ckpt["within"]["epoch"], ckpt["within"]["step"], ckpt["epoch"]) == (
        epoch,
        step,
        epoch - 1,
    )

    reads, said = tmp_path / "reads.txt", []
    with monkeypatch.context() as patch:
        record_reads(patch, reads)
        # checkpoint settings are not the run's identity: it resumes under others
        again = cfg.model_copy(update={"checkpoint_every_steps": 1})
        resumed = train_detector(data, root / "images", again, split, resume=True, log=said.append)
    assert f"detector: resuming from {split / 'last.pt'} at epoch {epoch} step {step}" in said
    keys = {im.key for im in train}
    got = [line for line in reads.read_text().splitlines() if line.split()[0] in keys]
    want = jobs_from(train, cfg, epoch, step)
    assert (got if workers == 0 else sorted(got)) == (want if workers == 0 else sorted(want))
    full = tmp_path / "full"
    a, b = (torch.load(d / "detector.pt", weights_only=True) for d in (full, split))
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]), at
    b["config"]["checkpoint_every_steps"] = a["config"]["checkpoint_every_steps"]
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a if k != "state_dict")
    a, b = (torch.load(d / "last.pt", weights_only=True)["history"] for d in (full, split))
    assert a == b and resumed["last_epoch"] == a[-1]


def test_step_checkpoints_follow_the_step_count(demo, tmp_path, monkeypatch):
    """checkpoint_every_steps: last.pt rewritten mid-epoch every N steps of an epoch (not
    at its end, where the epoch's own is written)."""
    import infra.resume as writer

    root, _, data = demo
    written, original = [], writer.save_torch

    def recording(obj, path):
        if Path(path).name == "last.pt":
            within = obj["within"]
            written.append(within and (within["epoch"], within["step"]))
        return original(obj, path)

    monkeypatch.setattr(writer, "save_torch", recording)
    cfg = TINY.model_copy(update={"checkpoint_every_steps": 2})
    train_detector(data, root / "images", cfg, tmp_path / "run", **QUIET)
    assert written == [(0, 2), None, (1, 2), None]  # 3 steps an epoch
