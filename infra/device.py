"""Where a stage computes: ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``.

Params name a device with :data:`Device` (validated with the rest of params.yaml);
:func:`resolve_device` turns it into a ``torch.device`` in the stage's entry point;
:func:`autocast` runs in bf16 on CUDA and in full precision elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from infra.config import UserError

if TYPE_CHECKING:
    import torch

Device = Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA if available, else CPU; a CUDA device that is absent is an error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r}: CUDA is not available here; use auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA devices")
    return device


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op elsewhere (full precision)."""
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
