"""The one training loop: any registered model, CPU or CUDA (bf16 autocast), one process
or ``torchrun`` (DDP), resumable to the exact result of an uninterrupted run.

Per epoch: the training captions in an order seeded by ``(seed, epoch)``, split evenly
over the ranks (or each rank's stream of shards); then rank 0 evaluates on val (rsum),
writes ``last.pt`` and, when rsum improves, ``best.pt`` (the model only). Batches are built
ahead of the step (:class:`models.data.batches.Batches`), and the step does not wait for
the device: loss parts are summed there, and a non-finite loss (a flag on the device,
read every ``CHECK_EVERY`` steps) stops training naming its epoch and step. Checkpoints are
plain data, ``{model, config, info, state_dict, ...}``, loaded with ``weights_only=True``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from infra.config import Section, UserError, one_line
from infra.device import autocast, resolve_device
from infra.files import save_torch, write_json
from infra.kernels import adamw
from infra.resume import read_checkpoint
from infra.schedule import lr_factor
from infra.trainer import Trainer
from models.common import TrainConfig
from models.data.batches import Batches, Stream
from models.data.info import DataInfo
from models.registry import MODELS, model_class, model_inputs

CHECKPOINT_VERSION = 1
CHECK_EVERY = 50  # steps between reads of the device's non-finite-loss flag


class TrainingError(UserError):
    """Training cannot go on; the message says why and what was kept."""


def build_model(name: str, cfg: Section, info: DataInfo) -> nn.Module:
    """Registered model ``name`` from its validated config (``models.<name>``) and the
    sizes of its inputs."""
    if name not in MODELS:
        raise TrainingError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    cls = model_class(name)
    if not isinstance(cfg, cls.Config):
        raise TypeError(f"{name} is built from a {cls.Config.__name__}, got {type(cfg).__name__}")
    return cls(cfg, info)


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu"
) -> tuple[nn.Module, DataInfo]:
    """The model saved in ``path`` (``best.pt`` or ``last.pt``), in eval mode, and the
    DataInfo it was trained with (dimensions, feature statistics)."""
    path = Path(path)
    if not path.exists():
        raise TrainingError(f"{path}: no checkpoint; run `vse train` (dvc repro train@MODEL)")
    hint = "give best.pt or last.pt as `vse train` writes them (dvc repro train@MODEL)"
    ckpt = read_checkpoint(path, TrainingError, hint, ("model", "config", "info", "state_dict"))
    name = ckpt["model"]
    if name not in MODELS:
        raise TrainingError(f"{path}: a checkpoint of unknown model {name!r}; {hint}")
    try:
        config = model_class(name).Config.model_validate(ckpt["config"])
        info = DataInfo(**ckpt["info"])
        model = build_model(name, config, info)
        model.load_state_dict(ckpt["state_dict"])
    except Exception as err:  # noqa: BLE001 - config, sizes or weights that do not fit
        raise TrainingError(
            f"{path}: a {name} checkpoint whose config or weights do not load "
            f"({type(err).__name__}: {one_line(err)}); {hint}"
        ) from None
    return model.to(device).eval(), info


class _LossOf(nn.Module):
    """``forward`` = the model's ``loss``, so DDP sees the forward pass it must sync."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> dict:
        return self.model.loss(batch)


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def init_distributed(device: torch.device) -> torch.device:
    """Join the ``torchrun`` process group if launched by it (gloo on CPU, nccl on CUDA)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return device
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, rank: int, world: int):
    """This rank's batches of caption positions for ``epoch``: a permutation seeded by
    ``(seed, epoch)``, cut into ``world`` equal parts (the tail that does not fill a batch
    on every rank is dropped, so all ranks take the same number of steps)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    steps = n // (batch_size * world)
    if steps == 0:
        raise TrainingError(
            f"{n} training captions cannot fill one batch of {batch_size} on {world} ranks; "
            "lower train.batch_size"
        )
    order = order[: steps * batch_size * world].reshape(steps, world, batch_size)
    return [order[s, rank] for s in range(steps)]


def epoch_tasks(data, cfg: TrainConfig, epoch: int, rank: int, world: int):
    """This rank's batches of ``epoch``: a streaming source's own :class:`Stream` (WebDataset
    shards), else the caption batches of :func:`epoch_batches` as ``("pair", captions)``."""
    if hasattr(data, "epoch_stream"):
        return data.epoch_stream(epoch, rank, world)
    batches = epoch_batches(len(data), cfg.batch_size, cfg.seed, epoch, rank, world)
    return [("pair", captions) for captions in batches]


def _steps(tasks) -> int:
    return tasks.steps if hasattr(tasks, "steps") else len(tasks)


def train(
    name: str,
    model_config: Section,
    cfg: TrainConfig,
    train_data,
    val_data,
    out_dir: str | Path,
    *,
    resume: bool = False,
    on_epoch: Callable[[dict], None] | None = None,
    log: Callable[[str], None] = print,
    prepare_model: Callable[[nn.Module], None] | None = None,
) -> dict:
    """Train ``name`` on ``train_data`` (a ``PairData`` or ``ShardData``), select on
    ``val_data`` (a ``PairData``).

    ``model_config`` is the model's validated ``models.<name>`` section. Returns the
    trained model and the history: one dict per epoch (loss components, val metrics, lr);
    the history goes into tracked files, so it holds nothing that depends on run time.
    ``on_epoch`` is called on rank 0 after each epoch with the history so far (metrics
    files, plots). ``prepare_model`` may change a fresh model before training (e.g. load
    GloVe vectors); it is not called when resuming.
    """
    from models.evaluate import evaluate_split

    out_dir = Path(out_dir)
    device = init_distributed(resolve_device(cfg.device))
    rank, world = _dist()
    if cfg.standardize:
        stats = train_data.feature_stats()
        train_data.standardize(stats)
        val_data.standardize(stats)
    torch.manual_seed(cfg.seed)
    model = build_model(name, model_config, train_data.info).to(device)
    if prepare_model is not None:
        prepare_model(model)
    optimizer = adamw(model.parameters(), cfg.lr, cfg.weight_decay)
    last_path, best_path = out_dir / "last.pt", out_dir / "best.pt"
    saved = None
    if resume and last_path.exists():
        hint = "delete it or train without --resume"
        needs = ("state_dict", "optimizer", "scheduler", "rng", "epoch", "history")
        saved = read_checkpoint(last_path, TrainingError, hint, needs)
        cfg = _elastic(cfg, saved, world, train_data, last_path, log)
    steps_per_epoch = _steps(epoch_tasks(train_data, cfg, 0, rank, world))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lr_factor(steps_per_epoch, cfg.warmup_steps, cfg.lr_decay, cfg.lr_decay_epochs),
    )
    identity = {
        "model": name,
        "config": model_config.model_dump(),
        "info": train_data.info.to_dict(),
    }
    best = {"rsum": -math.inf}
    trainer = Trainer(
        name,
        model,
        optimizer,
        scheduler,
        identity=identity,
        last_path=last_path,
        device=device,
        error=TrainingError,
        log=log,
        every_steps=cfg.checkpoint_every_steps,
        every_minutes=cfg.checkpoint_every_minutes,
        rank=rank,
        world=world,
        fields=lambda: {
            "version": CHECKPOINT_VERSION,
            "best_rsum": best["rsum"],
            "global_batch": cfg.batch_size * world,
        },
    )
    if resume:
        ckpt = trainer.resume(saved)
        if ckpt is not None:
            best["rsum"] = ckpt["best_rsum"]
            # a stream (shards) goes on mid-epoch only on as many ranks as wrote it
            within = trainer.within
            wrote = world if within is None else len(within.get("positions") or [None])
            if wrote != world and hasattr(train_data, "epoch_stream"):
                raise TrainingError(
                    f"{last_path}: written mid-epoch by {wrote} ranks streaming shards; resume "
                    f"on {wrote} ranks, or let the epoch finish (train.shards: streams are "
                    "dealt per rank)"
                )

    wrapped: nn.Module = _LossOf(model)
    if world > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            wrapped, device_ids=[device.index] if device.type == "cuda" else None
        )
    batches = Batches(train_data, device, num_workers=cfg.num_workers, prefetch=cfg.prefetch)
    val_batches = Batches(val_data, device, prefetch=cfg.prefetch)  # a thread: small, per epoch
    timing = {}

    def run_epoch(epoch: int, within: dict | None) -> dict:
        row, timing["seconds"], timing["seen"] = _epoch(
            trainer, wrapped, batches, cfg, epoch, within
        )
        return row

    def end_epoch(epoch: int, row: dict) -> None:  # rank 0: select on val
        model.eval()
        val = evaluate_split(model, val_data, cfg.eval_batch_size, device, val_batches)
        row.update({f"val_{k}": v for k, v in val.items()})
        timing["improved"] = val["rsum"] > best["rsum"]
        best["rsum"] = max(best["rsum"], val["rsum"])

    def after_save(epoch: int, row: dict, state: dict) -> None:
        if timing["improved"]:
            weights = {"state_dict": state["state_dict"], "epoch": epoch}
            save_torch({**identity, **weights}, best_path)
        seconds, seen = timing["seconds"], timing["seen"]
        log(
            f"{name} epoch {epoch}: loss {row['loss']:.4f}, val rsum {row['val_rsum']:.1f} "
            f"(best {best['rsum']:.1f}), {seconds:.1f} s ({seen / seconds:.0f} pairs/s)"
        )
        if on_epoch is not None:
            on_epoch(trainer.history)

    try:
        history = trainer.fit(cfg.epochs, run_epoch, end_epoch, after_save)
    finally:
        batches.close()
        val_batches.close()
    return {"history": history, "best_rsum": best["rsum"], "model": model}


def _elastic(cfg: TrainConfig, saved: dict, world: int, data, path: Path, log) -> TrainConfig:
    """``cfg`` for resuming ``saved`` on ``world`` ranks: the global batch it was trained
    with stays, re-split over the ranks (``batch_size`` per rank), so that the epochs'
    global batches, and the steps, are the same as on the ranks that wrote it."""
    total = saved.get("global_batch")
    if not total or total == cfg.batch_size * world or hasattr(data, "epoch_stream"):
        return cfg
    if total % world:
        raise TrainingError(
            f"{path}: trained with a global batch of {total}, which {world} ranks cannot "
            "split evenly; resume on a number of ranks that divides it"
        )
    log(f"resuming on {world} ranks: global batch {total} = {world} x {total // world}")
    return cfg.model_copy(update={"batch_size": total // world})


def _epoch(
    trainer: Trainer, wrapped: nn.Module, batches, cfg: TrainConfig, epoch: int, within
) -> tuple[dict, float, int]:
    """One epoch of optimizer steps (from a step checkpoint's ``within``: from its next
    batch); returns the history row (mean loss parts, lr), the seconds it took and the
    pairs seen (all ranks). The steps after a non-finite one, until its flag is read, only
    touch weights that are never saved; between steps the trainer decides when ``last.pt``
    is written (all ranks agree)."""
    name, device, world, rank = trainer.name, trainer.device, trainer.world, trainer.rank
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.scheduler
    tasks = epoch_tasks(batches.source, cfg, epoch, rank, world)
    steps = _steps(tasks)
    t0, seen, done, first = time.perf_counter(), 0, 0, 0
    sums: dict[str, torch.Tensor] = {}
    if within is not None:  # the skip is computed: no batch before it is built
        first, seen = within["step"], within["seen"]
        sums = {k: v.to(device) for k, v in within["sums"].items()}
        if isinstance(tasks, Stream):
            tasks = Stream(tasks.spec, tasks.steps, within["positions"][rank])
        else:
            tasks = tasks[first:]
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # step of the first
    bad_loss = torch.zeros((), dtype=torch.float32, device=device)  # and its loss
    model.train()
    stream = batches.run(tasks)
    try:
        for step, batch in enumerate(stream, first):
            batch["epoch"] = epoch
            with autocast(device):
                parts = wrapped(batch)
            loss = parts["loss"]
            newly = ~torch.isfinite(loss.detach()) & (first_bad < 0)
            first_bad = torch.where(newly, step, first_bad)
            bad_loss = torch.where(newly, loss.detach().float(), bad_loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            for key, value in parts.items():  # summed on the device, in float64
                value = value.detach().double()
                sums[key] = sums[key] + value if key in sums else value
            seen += _batch_size(batch) * world
            done = step + 1
            if done % CHECK_EVERY == 0 or done == steps:
                _stop_if_nonfinite(trainer, first_bad, bad_loss, epoch)
            if rank == 0 and done % max(1, steps // 4) == 0:
                rate = seen / (time.perf_counter() - t0)
                trainer.log(
                    f"{name} epoch {epoch} step {done}/{steps} "
                    f"loss {float(loss.detach()):.4f} ({rate:.0f} pairs/s)"
                )
            trainer.step_done(
                epoch,
                done,
                steps,
                lambda seen=seen: {
                    "seen": seen,
                    "world": world,
                    "sums": {k: v.cpu() for k, v in sums.items()},
                    "position": batches.position,
                },
                lambda bad=first_bad, value=bad_loss: _stop_if_nonfinite(
                    trainer, bad, value, epoch
                ),
            )
    finally:
        stream.close()
    if done != steps:
        raise TrainingError(
            f"{name}: epoch {epoch} gave {done} batches, {steps} were planned; rebuild the "
            "shards (vse shards build) or train from the stores (train.shards: null)"
        )
    _stop_if_nonfinite(trainer, first_bad, bad_loss, epoch)
    row = {"epoch": epoch, **{k: float(v) / steps for k, v in sums.items()}}
    row["lr"] = optimizer.param_groups[0]["lr"]
    return row, time.perf_counter() - t0, seen


def _batch_size(batch: dict) -> int:
    for value in batch.values():
        if torch.is_tensor(value) and value.dim():
            return int(value.shape[0])
    return 0


def _stop_if_nonfinite(trainer: Trainer, first_bad, bad_loss, epoch: int) -> None:
    """Read the device's flag (all ranks agree under DDP); raise if a loss was not finite."""
    flag = (first_bad >= 0).to(torch.int64).reshape(1)
    if trainer.world > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if not flag.item():
        return
    kept = f"{trainer.last_path} (epoch {epoch - 1})" if epoch > 0 else "none yet"
    where = (
        f"loss is {bad_loss.item()} at epoch {epoch} step {first_bad.item()}"
        if first_bad.item() >= 0
        else f"loss is not finite on another rank at epoch {epoch}"
    )
    raise TrainingError(
        f"{trainer.name}: {where}; stopped. Kept the last good checkpoint: {kept}. Lower train.lr "
        "or raise train.warmup_steps, then rerun with --resume"
    )


def write_history(history: list[dict], metrics: Path | None, plot: Path | None) -> None:
    """The DVC metrics file (last epoch, best epoch) and the per-epoch plot table."""
    if not history:
        return
    if metrics is not None:
        best = max(history, key=lambda r: r.get("val_rsum", -math.inf))
        write_json(metrics, {"epochs": len(history), "last": history[-1], "best": best})
    if plot is not None:
        write_json(plot, [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in history])


def train_stage(
    name: str,
    model_config: Section,
    cfg: TrainConfig,
    sbert,
    paths,
    out_dir: Path,
    metrics: Path,
    plots: Path,
    *,
    resume: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Stage ``train@<name>``: the splits' data from the stores (or the train split streamed
    from ``train.shards``, checked against them), training with selection on val,
    checkpoints in ``out_dir``, the metrics and per-epoch plot files after each epoch."""
    from models.data.pairs import PairData
    from models.data.shards import ShardData

    def embed(names: list[str]) -> np.ndarray:  # class names for HUSE's graph, on the CPU
        from features.text.sbert_stats import sbert_encoder

        return sbert_encoder(sbert.model_copy(update={"device": "cpu"}))(names)

    inputs = model_inputs(name, model_config)
    train_data = PairData(
        paths, "train", inputs, class_embedder=embed if "labels" in inputs else None
    )
    val_data = PairData(paths, "val", inputs)
    log(
        f"train {name}: {len(train_data)} train captions ({train_data.n_images} images), "
        f"{len(val_data)} val captions; inputs {', '.join(sorted(inputs))}"
    )
    source = train_data
    if cfg.shards:  # the same samples, streamed from shards built from these stores
        source = ShardData(cfg.shards, train_data, cfg)
        log(f"train {name}: streaming {len(source.shards)} train shards from {cfg.shards}")

    def prepare(model):  # a model's own set-up from the data, e.g. UniVSE's GloVe vectors
        if hasattr(model, "prepare"):
            model.prepare(train_data, log)

    return train(
        name,
        model_config,
        cfg,
        source,
        val_data,
        out_dir,
        resume=resume,
        on_epoch=lambda history: write_history(history, metrics, plots),
        log=log,
        prepare_model=prepare,
    )
