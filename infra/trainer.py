"""The one resumable training loop of the retrieval models (:mod:`models.train`), the
detector (:mod:`features.detector.train`) and the Graph-RISE head
(:mod:`features.images.graph_rise.model`).

:class:`Trainer` owns resuming from ``last.pt`` (checked against the run's identity), the
epoch loop, ``last.pt`` after and within epochs (:class:`infra.resume.StepCheckpoints`),
the history and the agreement of all ranks under DDP. A trainer gives its epoch (calling
:meth:`Trainer.step_done` after each step) and its own checkpoint fields. The shape is
detectron2's ``TrainerBase``, the epoch function and ``end_epoch`` being the hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import torch
from torch import nn

from infra.config import UserError
from infra.resume import StepCheckpoints, plain, restore_training, training_state


@dataclass(eq=False)
class Trainer:
    """One run's resumable epochs.

    ``identity`` (model, config, data) is saved in ``last.pt`` and must match on resume;
    ``fields()`` gives the run's own fields saved beside it (e.g. the best val score).
    Only rank 0 writes; every rank takes part in the agreement on when to write."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    _: KW_ONLY
    identity: dict
    last_path: Path | None
    device: torch.device
    error: type[UserError] = UserError
    log: Callable[[str], None] = print
    every_steps: int = 0
    every_minutes: float = 0
    rank: int = 0
    world: int = 1
    fields: Callable[[], dict] = dict
    # while fit() runs: its step checkpoints, which handle the stop signals
    checkpoints: StepCheckpoints | None = field(default=None, init=False)
    history: list[dict] = field(default_factory=list, init=False)
    start: int = field(default=0, init=False)  # the first epoch to run
    within: dict | None = field(default=None, init=False)  # the step checkpoint resumed from

    def resume(self, ckpt: dict | None = None) -> dict | None:
        """Restore ``last.pt`` (weights, optimizer, scheduler, RNG, history) when it exists
        (``ckpt``: its contents, when the caller read it already); returns the checkpoint
        (its own fields too), or None when there is none yet."""
        last = self.last_path
        if last is None or not last.exists():
            self.log(f"{self.name}: --resume, but no {last} yet: starting from scratch")
            return None
        parts = (self.model, self.optimizer, self.scheduler, self.device, self.error)
        ckpt = restore_training(last, self.identity, *parts, ckpt=ckpt)
        self.history, self.start = ckpt["history"], ckpt["epoch"] + 1
        self.within = ckpt.get("within")
        if self.within is not None:
            self.log(
                f"{self.name}: resuming from {last} at epoch {self.start} step "
                f"{self.within['step']}"
            )
        else:
            self.log(f"{self.name}: resuming from {last} after epoch {ckpt['epoch']}")
        return ckpt

    def save(self, epoch_done: int, within: dict | None = None, state: dict | None = None):
        """Write ``last.pt`` (in the background) after ``epoch_done`` (-1: none yet) and, for
        a step checkpoint, ``within`` (the step's position in the next epoch)."""
        if self.last_path is None:
            return
        if state is None:
            state = training_state(self.model, self.optimizer, self.scheduler, self.device)
        body = {"epoch": epoch_done, "history": self.history, "within": within}
        self.checkpoints.save({**self.identity, **state, **body, **self.fields()}, self.last_path)

    def agreed(self, due: bool) -> bool:
        """``due`` (write a checkpoint now) as all ranks agree under DDP: one rank's reason
        (its clock, or a signal: then every rank stops) holds for all."""
        if self.world == 1:
            return due
        stopping = self.checkpoints.stopping is not None
        flag = torch.tensor([2 if stopping else int(due)], dtype=torch.int64)
        if self.device.type == "cuda":
            flag = flag.to(self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        value = int(flag.item())
        if value == 2 and not stopping:
            self.checkpoints.stopping = "a signal on another rank"
        return value > 0

    def step_done(
        self, epoch: int, done: int, steps: int, within: Callable[[], dict], check=None
    ) -> None:
        """After step ``done`` of ``steps`` in ``epoch``: when a step checkpoint is due, and
        steps are left, ``check()`` (e.g. for a non-finite loss), then ``last.pt`` with
        ``within()`` (the epoch's sums, images seen, ...; a stream's ``position`` is
        gathered from every rank into ``positions``), then stop if a signal came."""
        if not (self.agreed(self.checkpoints.due(done)) and done < steps):
            return
        if check is not None:
            check()
        step = {"epoch": epoch, "step": done, **within()}
        if "position" in step:
            positions = [step.pop("position")]
            if self.world > 1:
                own, positions = positions[0], [None] * self.world
                torch.distributed.all_gather_object(positions, own)
            step["positions"] = plain(positions)
        if self.rank == 0:
            self.save(epoch - 1, step)
            self.log(f"{self.name}: wrote {self.last_path} at epoch {epoch} step {done}")
        if self.world > 1:
            torch.distributed.barrier()
        self.checkpoints.written()

    def fit(
        self,
        epochs: int,
        run_epoch: Callable[[int, dict | None], dict],
        end_epoch: Callable[[int, dict], None] | None = None,
        after_save: Callable[[int, dict, dict], None] | None = None,
    ) -> list[dict]:
        """Epochs from where the run stands to ``epochs``: ``run_epoch(epoch, within)``
        (``within``: the step checkpoint to go on from, in the first epoch only) returns
        the epoch's history row. On rank 0, ``end_epoch(epoch, row)`` adds to the row
        (e.g. val metrics), the row joins the history, ``last.pt`` is written, then
        ``after_save(epoch, row, state)`` (e.g. ``best.pt`` from ``state``, logging). A
        signal during an epoch stops the run after it, once ``last.pt`` is on disk."""
        self.checkpoints = StepCheckpoints(
            self.every_steps, self.every_minutes, self.log, self.error
        )
        try:
            for epoch in range(self.start, epochs):
                row = run_epoch(epoch, self.within if epoch == self.start else None)
                if self.rank == 0:
                    if end_epoch is not None:
                        end_epoch(epoch, row)
                    self.history.append(row)
                    state = training_state(self.model, self.optimizer, self.scheduler, self.device)
                    self.save(epoch, state=state)
                    if after_save is not None:
                        after_save(epoch, row, state)
                if self.world > 1:
                    torch.distributed.barrier()
                stopping = self.agreed(self.checkpoints.stopping is not None)
                if stopping and epoch + 1 < epochs:
                    self.checkpoints.written()  # stopped by a signal: last.pt is this epoch's
            self.checkpoints.wait()  # the last write is on disk
        finally:
            self.checkpoints.close()
        return self.history
