"""Resumable training (:mod:`infra.trainer`): what ``last.pt`` holds besides the run's own
fields, how ``--resume`` restores it (bit-identical to an uninterrupted run), and when a
run writes it mid-epoch (:class:`StepCheckpoints`)."""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from infra.config import UserError, one_line
from infra.files import save_torch

# Exit status of a run stopped by SIGTERM/SIGINT after it wrote ``last.pt``: rerun the same
# command with --resume (EX_TEMPFAIL of sysexits.h: "try again later").
RESUMABLE_EXIT = 75


class Preempted(UserError):
    """Stopped by a signal after writing a resumable ``last.pt``."""

    exit_code = RESUMABLE_EXIT


def read_checkpoint(
    path: str | Path, error: type[UserError] = UserError, hint: str = "", needs=()
) -> dict:
    """The plain data in ``path`` (``weights_only``: a pickled object is refused, never
    run); a file torch cannot read that way (truncated, damaged, not a checkpoint, made
    by a pickling tool), or one without the keys ``needs``, is one line ``error`` naming
    it, followed by ``hint`` (what to do)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file: one line naming it
        raise error(
            f"{path}: not a checkpoint torch can read as plain data ({type(err).__name__}: "
            f"{one_line(err)}); {hint}"
        ) from None
    return _holding(ckpt, needs, path, error, hint)


def _holding(ckpt, needs, path, error: type[UserError], hint: str) -> dict:
    """``ckpt`` if it is a dict with the keys ``needs``, else one line ``error``."""
    missing = [k for k in needs if not isinstance(ckpt, dict) or k not in ckpt]
    if not isinstance(ckpt, dict) or missing:
        raise error(f"{path}: not a checkpoint of this trainer (no {', '.join(missing)}); {hint}")
    return ckpt


def training_state(model: nn.Module, optimizer, scheduler, device: torch.device) -> dict:
    """Weights (on the CPU), optimizer, scheduler and the torch RNG (CUDA's too): the
    only global generator training draws from (batch orders are seeded by ``(seed,
    epoch)``, a stream's generator is kept in its position)."""
    rng = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng,
    }


def restore_training(
    path: Path,
    identity: dict,
    model: nn.Module,
    optimizer,
    scheduler,
    device: torch.device,
    error: type[UserError] = UserError,
    needs: tuple[str, ...] = ("epoch", "history"),
    ckpt: dict | None = None,
) -> dict:
    """Load ``path`` (:func:`read_checkpoint`, unless ``ckpt`` is what the caller read from
    it already; besides :func:`training_state`'s keys it must hold ``needs``, the run's own
    fields), check that it was trained with the same ``identity`` (model, config, data; one
    line naming what differs, else ``error``), restore what :func:`training_state` saved
    and return the checkpoint (its epoch, history and other fields). Loaded onto the CPU:
    the RNG states must stay there (torch refuses a state on the GPU), and the model and
    optimizer copy theirs to ``device``."""
    hint = "delete it or train without --resume"
    keys = ("state_dict", "optimizer", "scheduler", "rng", *needs)
    if ckpt is None:
        ckpt = read_checkpoint(path, error, hint)
    _holding(ckpt, keys, path, error, hint)
    for key, value in identity.items():
        if ckpt.get(key) != value:
            raise error(f"{path}: was trained with another {key}; {hint}")
    try:
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"].get("cuda"):
            torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    except Exception as err:  # noqa: BLE001 - weights or states that do not fit
        raise error(f"{path}: its training state does not load ({one_line(err)}); {hint}") from None
    return ckpt


def plain(value):
    """``value`` with numpy arrays as tensors, so that ``weights_only`` loads it."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return value


def init_worker(*_args) -> None:
    """The start of a data-loading worker process (a ``worker_init_fn``: its arguments are
    ignored). It ignores SIGTERM and SIGINT, which a queue or Ctrl-C sends to the whole
    process group: the trainer handles them (:class:`StepCheckpoints`) and ends its workers
    itself.

    And it drops the thread-exit hooks that objects of the parent registered (a forked
    worker inherits them, not their threads). Prefect's services register one each: run
    at the worker's exit, it raises, and multiprocessing then ends the worker with status
    1 and no message (torch: "DataLoader worker exited unexpectedly") at the end of every
    epoch of a process that has run a flow; anyio's would unregister the parent's sockets
    from the epoll instance the two processes share. A module's hook is kept:
    ``concurrent.futures`` stops the worker's own thread pools with it."""
    for sig in StepCheckpoints.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    hooks = getattr(threading, "_threading_atexits", [])
    hooks[:] = [h for h in hooks if not inspect.ismethod(getattr(h, "func", h))]


def snapshot(value, memo: dict | None = None):
    """A copy of ``value`` (nested dicts, lists, tuples) whose tensors are new CPU tensors:
    what a checkpoint holds at this moment, safe to write while training changes the
    weights and optimizer states in place. A tensor met twice (tied weights) is copied
    once, so the file keeps them shared, as ``torch.save`` of the originals would."""
    memo = {} if memo is None else memo
    if torch.is_tensor(value):
        if id(value) not in memo:
            memo[id(value)] = value.detach().to("cpu", copy=True)
        return memo[id(value)]
    if isinstance(value, dict):
        return {k: snapshot(v, memo) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(v, memo) for v in value)
    return value


class StepCheckpoints:
    """When a run writes ``last.pt`` within an epoch: every ``every_steps`` steps and every
    ``every_minutes`` minutes (0: never), and after the step in progress when SIGTERM or
    SIGINT arrives (:attr:`stopping`; the run then raises :class:`Preempted`); a second
    signal exits at once (status 128 + signal). Handlers are installed only in the main
    thread and restored by :meth:`close`.

    :meth:`save` writes in the background: training waits only for a :func:`snapshot`
    (a CPU copy). Each save, a stop by a signal (:meth:`written`) and the end of training
    (:meth:`wait`) wait for the write before; a write that failed is one line ``error``."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(
        self,
        every_steps: int = 0,
        every_minutes: float = 0,
        log=print,
        error: type[UserError] = UserError,
    ):
        self.every_steps, self.every_seconds = every_steps, every_minutes * 60
        self.log, self.stopping, self.last = log, None, time.monotonic()
        self.error = error
        self._writing: threading.Thread | None = None
        self._failed: str | None = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._signalled)

    def _signalled(self, signum, _frame) -> None:
        if self.stopping is not None:
            os._exit(128 + signum)
        self.stopping = signal.Signals(signum).name
        self.log(f"{self.stopping}: finishing this step, then writing last.pt (again: exit now)")

    def due(self, steps_done: int) -> bool:
        """Whether to write ``last.pt`` after ``steps_done`` steps of this epoch."""
        if self.stopping is not None:
            return True
        if self.every_steps and steps_done % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and time.monotonic() - self.last >= self.every_seconds

    def save(self, obj: dict, path: Path) -> None:
        """Write ``obj`` to ``path`` (atomically) in the background, after the write before
        it; returns once ``obj`` is copied (:func:`snapshot`)."""
        self.wait()
        copy = snapshot(obj)
        self._writing = threading.Thread(
            target=self._write, args=(copy, Path(path)), name="checkpoint-writer"
        )
        self._writing.start()

    def _write(self, obj: dict, path: Path) -> None:
        try:
            save_torch(obj, path)
        except Exception as err:  # noqa: BLE001 - reported by wait(), in the training thread
            self._failed = (
                f"{path}: writing the checkpoint failed ({type(err).__name__}: {one_line(err)}); "
                "free disk space or fix the folder, then rerun with --resume (the "
                "checkpoint before it is kept)"
            )

    def _join(self) -> None:
        if self._writing is not None:
            self._writing.join()
            self._writing = None

    def wait(self) -> None:
        """Wait for the write in progress; a failed write is one line ``error``."""
        self._join()
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise self.error(failed)

    def written(self) -> None:
        """A checkpoint was saved: the minutes count from now; if stopping, wait for its
        write and raise :class:`Preempted`."""
        self.last = time.monotonic()
        if self.stopping is not None:
            self.wait()
            raise Preempted(
                f"stopped by {self.stopping} after writing last.pt; rerun with --resume "
                f"to go on from there (exit status {RESUMABLE_EXIT})"
            )

    def close(self) -> None:
        """Restore the signal handlers; a write in progress finishes (a failure of it is
        not raised here: :meth:`wait` raises it; this runs on the way out of any error)."""
        self._join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
