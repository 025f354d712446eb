"""Preemption: SIGTERM at a step -> ``last.pt`` written mid-epoch, a resumable exit ->
``--resume`` goes on with the very next batch, for the stores (Zarr) and the WebDataset
shards, built in the loop or by 2 worker processes, and ends with weights bitwise equal
to an uninterrupted run; the resumed run reads none of the batches before the step."""

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from store_data import make_stores

import features.shards.reader
from features.ingest.manifest import read_manifest
from features.shards.writer import ShardsConfig, build_shards
from features.store.reader import Store
from infra.resume import RESUMABLE_EXIT, Preempted, StepCheckpoints
from models.common import TrainConfig
from models.data.pairs import PairData
from models.data.shards import ShardData
from models.mvvse import MVVSEConfig
from models.registry import model_inputs
from models.train import TrainingError, train
from models.vsepp import VSEPPConfig

INPUTS = frozenset({"image", "words"})
MODELS = {
    "vsepp": VSEPPConfig(embed_size=16, word_dim=8),
    "mvvse": MVVSEConfig(embed_size=16, word_dim=8, gpo_hidden=8, gpo_pe_dim=8),
}
CFG = TrainConfig(
    epochs=2, batch_size=4, lr=2e-3, shuffle_buffer=10, device="cpu", prefetch=1, standardize=True
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    paths = make_stores(root)
    stores = {"regions": Store.open(paths.regions), "global": Store.open(paths.global_)}
    layout = ShardsConfig(samples_per_shard=8, images_per_group=3)
    text = Store.open(paths.text)
    build_shards(read_manifest(paths.manifest), stores, root / "out", layout, text=text)
    return root, paths


def run(packed, name, cfg, out, *, source="stores", resume=False):
    root, paths = packed
    inputs = model_inputs(name, MODELS[name])
    data = PairData(paths, "train", inputs)
    train_data = ShardData(str(root / "out"), data, cfg) if source == "shards" else data
    val = PairData(paths, "val", inputs)
    return train(name, MODELS[name], cfg, train_data, val, out, resume=resume, log=lambda m: None)


def weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


def signal_at(monkeypatch, step: int) -> None:
    """SIGTERM to this process during optimizer step ``step`` (counted over the run)."""
    original, count = torch.optim.AdamW.step, [0]

    def step_then_signal(self, *args, **kwargs):
        count[0] += 1
        if count[0] == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_signal)


@pytest.mark.parametrize("name", ["vsepp", "mvvse"])
@pytest.mark.parametrize("source", ["stores", "shards"])
@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_then_resume_equals_an_uninterrupted_run(
    packed, tmp_path, monkeypatch, name, source, workers
):
    cfg = CFG.model_copy(update={"num_workers": workers})
    full = run(packed, name, cfg, tmp_path / "full", source=source)
    steps = len(full["history"]) and _steps_per_epoch(packed, cfg, source)
    # a step of either epoch, not its last (that one ends the epoch), drawn per case
    rng = np.random.default_rng(sum(map(ord, f"{name}{source}{workers}")))
    at = int(rng.choice([s for s in range(1, 2 * steps) if s % steps]))
    with monkeypatch.context() as patch:
        signal_at(patch, at)
        with pytest.raises(Preempted, match="stopped by SIGTERM.*rerun with --resume") as err:
            run(packed, name, cfg, tmp_path / "split", source=source)
    assert err.value.exit_code == RESUMABLE_EXIT == 75
    ckpt = torch.load(tmp_path / "split" / "last.pt", weights_only=True)
    assert ckpt["within"]["epoch"] == at // steps and ckpt["within"]["step"] == at % steps
    resumed = run(packed, name, cfg, tmp_path / "split", source=source, resume=True)
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in full["history"]]
    a, b = weights(tmp_path / "full" / "last.pt"), weights(tmp_path / "split" / "last.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (at, steps)


def _steps_per_epoch(packed, cfg, source) -> int:
    root, paths = packed
    data = PairData(paths, "train", INPUTS)
    if source == "shards":
        return ShardData(str(root / "out"), data, cfg).steps(1)
    return len(data) // cfg.batch_size


def test_resume_of_the_stores_builds_no_batch_before_the_step(packed, tmp_path, monkeypatch):
    """Resumed at epoch 0 step k, the first batch built is the k-th of the epoch's
    permutation (written out here from its definition), and only the rest are built."""
    cfg = CFG.model_copy(update={"epochs": 1, "checkpoint_every_steps": 5})
    built = []
    original = PairData.build

    def recorded(self, kind, index, alloc=np.empty):
        if self.split == "train" and kind == "pair":
            built.append(np.asarray(index).copy())
        return original(self, kind, index, alloc)

    monkeypatch.setattr(PairData, "build", recorded)
    with monkeypatch.context() as patch:
        signal_at(patch, 7)  # written at step 5 (every 5 steps), then at step 7 (signal)
        with pytest.raises(Preempted):
            run(packed, "vsepp", cfg, tmp_path / "split")
    n = len(PairData(packed[1], "train", INPUTS))
    order = np.random.default_rng([cfg.seed, 0]).permutation(n)
    want = [order[s * 4 : s * 4 + 4] for s in range(n // 4)]
    built.clear()
    run(packed, "vsepp", cfg, tmp_path / "split", resume=True)
    assert len(built) == len(want) - 7
    assert all(np.array_equal(a, b) for a, b in zip(built, want[7:], strict=True))


def test_resume_of_the_shards_reads_no_group_consumed_before_the_step(
    packed, tmp_path, monkeypatch
):
    """Groups decoded by the resumed run each hold a caption of a batch still to come
    (from the uninterrupted run): the groups whose captions were all given are not read."""
    cfg = CFG.model_copy(update={"epochs": 1})
    original_read = features.shards.reader.read_groups
    decoded: list[set] = []

    def recording(url, recorded, storage_options=None, keep=None):
        for group in original_read(url, recorded, storage_options, keep):
            if group is not None:
                decoded.append(set(group.meta["index"]))
            yield group

    images = []  # per batch of the uninterrupted run: its images (positions in the split)
    original_emit = ShardData._emit

    def emitted(self, held, chosen, alloc):
        batch = original_emit(self, held, chosen, alloc)
        images.append(set(batch["caption_image"].tolist()))
        return batch

    monkeypatch.setattr(features.shards.reader, "read_groups", recording)
    monkeypatch.setattr(ShardData, "_emit", emitted)
    run(packed, "vsepp", cfg, tmp_path / "full", source="shards")
    uninterrupted = list(images)
    k = 9
    with monkeypatch.context() as patch:
        signal_at(patch, k)
        with pytest.raises(Preempted):
            run(packed, "vsepp", cfg, tmp_path / "split", source="shards")
    later = set().union(*uninterrupted[k:])  # images of the batches still to come
    decoded.clear()
    images.clear()
    run(packed, "vsepp", cfg, tmp_path / "split", source="shards", resume=True)
    assert images == uninterrupted[k:]  # the very next batch, and only those after it
    assert decoded and all(group & later for group in decoded), (decoded, later)
    assert len(decoded) < len(read_all(packed))


def test_a_second_signal_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    # what the process had before (SIG_IGN where the shell started it in the background)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    checkpoints = StepCheckpoints(log=lambda m: None)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert checkpoints.stopping == "SIGINT" and checkpoints.due(3) and not exits
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [128 + signal.SIGTERM]
    finally:
        checkpoints.close()
    assert {s: signal.getsignal(s) for s in before} == before  # handlers given back


def test_step_checkpoints_follow_the_step_count(packed, tmp_path, monkeypatch):
    """checkpoint_every_steps: last.pt rewritten mid-epoch every N steps (not at step 0),
    each loadable and resumable; the epoch-end one has no step."""
    written = []
    import infra.resume

    original = infra.resume.save_torch

    def recording(obj, path):  # in the background writer's thread
        written.append(obj.get("within") and obj["within"]["step"])
        return original(obj, path)

    monkeypatch.setattr(infra.resume, "save_torch", recording)
    cfg = CFG.model_copy(update={"epochs": 1, "checkpoint_every_steps": 4})
    run(packed, "vsepp", cfg, tmp_path / "run")
    steps = _steps_per_epoch(packed, cfg, "stores")
    mid = [s for s in written if s]
    assert mid == list(range(4, steps, 4)) and written[-1] is None


@pytest.mark.parametrize(
    "damage",
    ["truncated", "garbage", "pickled code", "other file"],
)
def test_resume_from_a_damaged_last_pt_is_one_line(packed, tmp_path, damage):
    """An unreadable, cut or malicious last.pt: one line naming it, no traceback, and
    pickled code is never run (weights_only)."""
    cfg = CFG.model_copy(update={"epochs": 1})
    out = tmp_path / "run"
    run(packed, "vsepp", cfg, out)
    last = out / "last.pt"
    data = last.read_bytes()
    if damage == "truncated":
        last.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        last.write_bytes(b"\x00not a checkpoint" * 100)
    elif damage == "pickled code":
        torch.save({"x": _Boom(tmp_path / "boom")}, last)
    else:
        torch.save({"state_dict": {}}, last)  # plain data, but not a training checkpoint
    with pytest.raises(TrainingError) as err:
        run(packed, "vsepp", cfg.model_copy(update={"epochs": 2}), out, resume=True)
    message = str(err.value)
    assert "\n" not in message and str(last) in message and "without --resume" in message
    assert not (tmp_path / "boom").exists()


class _Boom:
    """A pickled object whose loading would run code (makes a folder)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def read_all(packed) -> list:
    """Every train group of the shards (what a replayed skip would decode)."""
    root, _ = packed
    names = sorted(p.name for p in (root / "out").glob("train-*.tar"))
    read = features.shards.reader.read_groups
    return [g for n in names for g in read(str(root / "out" / n), None)]


def _launch(repo_root, out, world: int, batch: int, stop: int, port: int, resume: bool):
    job = [
        str(repo_root / "tests" / "jobs" / "ddp_elastic_job.py"),
        str(out),
        str(batch),
        str(stop),
    ]
    job += ["--resume"] if resume else []
    run = [sys.executable, *job]
    if world > 1:
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]
        run += ["--master_addr", "127.0.0.1", "--master_port", str(port), *job]
    env = {**os.environ, "PYTHONPATH": f"{repo_root}:{repo_root / 'tests'}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 75, 1), done.stdout + done.stderr  # 1: torchrun's, for 75
    return done


def _consumed(out, name: str, world: int) -> list[int]:
    """The global sequence of caption positions: step by step, rank by rank."""
    ranks = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(world)]
    return [c for step in zip(*ranks, strict=True) for part in step for c in part]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_ddp_run_resumes_on_another_number_of_ranks(tmp_path, repo_root, before, after):
    """Checkpointed mid-epoch under DDP (gloo) on ``before`` ranks, resumed on ``after``:
    the same global batch (8), and from the resume point the same global sequence of
    samples as the uninterrupted run on ``before`` ranks."""
    port = 29541 + before
    reference, split = tmp_path / "reference", tmp_path / "split"
    _launch(repo_root, reference, before, 8 // before, 0, port, False)
    full = _consumed(reference, "first", before)
    stopped = _launch(repo_root, split, before, 8 // before, 3, port, False)
    assert (split / "model" / "last.pt").exists(), stopped.stdout + stopped.stderr
    ckpt = torch.load(split / "model" / "last.pt", weights_only=True)
    assert ckpt["within"]["step"] == 3 and ckpt["global_batch"] == 8
    given = _consumed(split, "first", before)
    resumed = _launch(repo_root, split, after, 8 // before, 0, port, True)
    assert f"global batch 8 = {after} x {8 // after}" in resumed.stdout + resumed.stderr
    rest = _consumed(split, "resumed", after)
    assert given == full[: 3 * 8] and rest == full[3 * 8 :]


def test_a_two_node_run_that_loses_a_node_resumes_on_the_survivor(tmp_path, repo_root):
    """Two torchrun nodes of one process each (gloo, node ranks 0 and 1, static rendezvous
    on loopback), step checkpoints every 2 steps; node 1's process is SIGKILLed at step 5
    (a machine lost: nothing written), node 0's next collective fails. Resumed on node 0
    alone from the step-4 checkpoint: the same global sequence of samples, from there, as
    the uninterrupted two-node run (as the one-machine elastic resume above)."""
    port, job = 29561, str(repo_root / "tests" / "jobs" / "ddp_elastic_job.py")
    env = {**os.environ, "PYTHONPATH": f"{repo_root}:{repo_root / 'tests'}", "OMP_NUM_THREADS": "1"}

    def two_nodes(out, *extra):
        nodes = []
        for node in (0, 1):
            run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            run += ["--nproc_per_node", "1", "--node_rank", str(node)]
            run += ["--master_addr", "127.0.0.1", "--master_port", str(port)]
            run += [job, str(out), "4", "5", *extra]
            nodes.append(subprocess.Popen(run, env=env, stdout=subprocess.PIPE, text=True))
        return [(proc.communicate(timeout=300)[0], proc.returncode) for proc in nodes]

    reference, lost = tmp_path / "reference", tmp_path / "lost"
    assert [code for _, code in two_nodes(reference, "--kill-rank", "9")] == [0, 0]
    full = _consumed(reference, "first", 2)
    assert [code for _, code in two_nodes(lost, "--kill-rank", "1")] == [1, 1]
    ckpt = torch.load(lost / "model" / "last.pt", weights_only=True)
    assert ckpt["within"]["step"] == 4 and ckpt["global_batch"] == 8
    resumed = _launch(repo_root, lost, 1, 4, 0, port, True)
    assert "global batch 8 = 1 x 8" in resumed.stdout + resumed.stderr
    assert _consumed(lost, "resumed", 1) == full[4 * 8 :]


def test_a_rerun_flow_resumes_only_from_a_compatible_last_pt(packed, tmp_path):
    """``train-<model>`` passes a preempted run's last.pt on (VSE_TRAIN_RESUME_FROM) only
    when it is this model's, trained with the same params, and readable as plain data."""
    from flows.pipeline import resumable

    cfg = CFG.model_copy(update={"epochs": 1, "checkpoint_every_steps": 5})
    with pytest.MonkeyPatch.context() as patch:
        signal_at(patch, 6)
        with pytest.raises(Preempted):
            run(packed, "vsepp", cfg, tmp_path / "run")
    last, config = tmp_path / "run" / "last.pt", MODELS["vsepp"].model_dump()
    assert resumable(last, "vsepp", config)
    assert not resumable(last, "vsepp", {**config, "margin": 0.3})
    assert not resumable(last, "mvvse", config)
    assert not resumable(tmp_path / "missing.pt", "vsepp", config)
    last.write_bytes(last.read_bytes()[:1000])
    assert not resumable(last, "vsepp", config)


def test_a_background_write_holds_the_state_of_its_moment(tmp_path, monkeypatch):
    """save() returns once the state is copied: weights changed in place and a history
    grown while the thread writes are not in the file; tied weights stay one tensor; a
    second save waits for the first write, so the file ends with the second."""
    import infra.resume

    gates, events, real = [threading.Event(), threading.Event()], [], infra.resume.save_torch
    calls = iter(gates)

    def held(obj, path):  # the writer thread, each write held until the test opens its gate
        next(calls).wait(30)
        real(obj, path)
        events.append(f"wrote {len(obj['history'])}")

    monkeypatch.setattr(infra.resume, "save_torch", held)
    weight, history, last = torch.arange(6.0), [{"loss": 1.0}], tmp_path / "last.pt"
    checkpoints = StepCheckpoints(log=lambda m: None)
    try:
        checkpoints.save({"state_dict": {"a": weight, "b": weight}, "history": history}, last)
        weight.add_(100.0)  # the next optimizer steps, in place
        history.append({"loss": 0.5})
        assert not last.exists() and not events
        threading.Timer(0.2, gates[0].set).start()
        checkpoints.save({"state_dict": {"a": weight, "b": weight}, "history": history}, last)
        events.append("second save returned")
        first = torch.load(last, weights_only=True)  # the second write is still held
        gates[1].set()
        checkpoints.wait()
    finally:
        checkpoints.close()
    assert events == ["wrote 1", "second save returned", "wrote 2"]
    assert torch.equal(first["state_dict"]["a"], torch.tensor([0.0, 1, 2, 3, 4, 5]))
    assert first["history"] == [{"loss": 1.0}]
    a, b = first["state_dict"]["a"], first["state_dict"]["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    second = torch.load(last, weights_only=True)
    assert torch.equal(second["state_dict"]["b"], torch.tensor([100.0, 101, 102, 103, 104, 105]))


def test_a_failed_background_write_fails_the_run_in_one_line(packed, tmp_path, monkeypatch):
    """The disk fills during a mid-epoch write: the run stops at its next checkpoint (or
    its end) with one line naming last.pt, the earlier last.pt is kept, no thread is left."""
    import infra.resume

    real, calls = infra.resume.save_torch, []

    def full_disk(obj, path):
        calls.append(obj["within"] and obj["within"]["step"])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(infra.resume, "save_torch", full_disk)
    cfg = CFG.model_copy(update={"epochs": 1, "checkpoint_every_steps": 3})
    threads = threading.active_count()
    with pytest.raises(TrainingError) as err:
        run(packed, "vsepp", cfg, tmp_path / "run")
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "run" / "last.pt") in message
    assert "No space left on device" in message and "--resume" in message
    assert calls == [3, 6]  # raised by the next save, before it writes
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["within"]["step"] == 3
    assert threading.active_count() == threads


def test_a_preempted_ablation_run_is_set_aside_under_its_run_name(tmp_path):
    """A ``train-ablation@<run>`` stage's preempted last.pt (the run's model, trained with
    that model's params) is set aside for the rerun like a ``train@<model>`` one's; the
    model's own stage, which left none, gets nothing."""
    from pathlib import Path

    from dvc.repo import Repo
    from prefect.logging import disable_run_logger

    from flows.params import load_params
    from flows.pipeline import RESUME_FROM, set_aside_preempted

    root = Path(__file__).resolve().parents[1]
    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_text((root / name).read_text())
    Repo.init(str(tmp_path), no_scm=True).close()
    params = load_params(tmp_path / "params.yaml")
    (run,) = [r for r, a in params.models.ablations.items() if a.model == "huse"]
    last = tmp_path / "data" / "models" / run / "last.pt"
    last.parent.mkdir(parents=True)
    config = params.models.huse.model_dump()
    torch.save({"model": "huse", "config": config, "state_dict": {}, "optimizer": {}}, last)
    with disable_run_logger():
        env = set_aside_preempted(str(tmp_path), f"train-ablation@{run}")
        assert set_aside_preempted(str(tmp_path), "train@huse") == {}
    aside = Path(env[RESUME_FROM])
    assert aside.name == f"{run}.pt" and aside.read_bytes() == last.read_bytes()
