"""Resumable training, shared by the detector (:mod:`features.detector.train`) and the
retrieval models (:mod:`models.train`): what ``last.pt`` holds besides the run's own
fields, and how a ``--resume`` run restores it, so that it ends bit-identical to an
uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from infra.config import UserError


def training_state(model: nn.Module, optimizer, scheduler, device: torch.device) -> dict:
    """Weights (on the CPU), optimizer, scheduler and the torch RNG (CUDA's too)."""
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
) -> dict:
    """Load ``path`` (``weights_only``), check that it was trained with the same
    ``identity`` (model, config, data; one line naming what differs, else ``error``),
    restore what :func:`training_state` saved and return the checkpoint (its epoch,
    history and other fields). Loaded onto the CPU: the RNG states must stay there (torch
    refuses a state on the GPU), and the model and optimizer copy theirs to ``device``."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    for key, value in identity.items():
        if ckpt.get(key) != value:
            raise error(
                f"{path}: was trained with another {key}; delete it or train without --resume"
            )
    model.load_state_dict(ckpt["state_dict"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device.type == "cuda" and ckpt["rng"].get("cuda"):
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return ckpt
