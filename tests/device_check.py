"""A second device on a CPU-only machine, for the one thing it can check: that code puts
the tensors it makes on its inputs' device. Inside :class:`made_elsewhere`, a tensor made
without a device (``torch.full(...)``, ``torch.as_tensor(numpy_array)``, ...) lands on the
meta device, which holds no data: code that drops a ``device=`` argument mixes it with
its CPU inputs and fails, as it would mix the CPU with CUDA on a GPU. ``torch.as_tensor``
of a tensor keeps that tensor's device, as it does outside. A ``.to()`` that names no
device, dtype or tensor (``t.to(None)``: a transfer whose device was lost on the way) is an
error: on a GPU the tensor would stay on the CPU, where ``torch.from_numpy`` made it."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors


def _names_no_target(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` (self excluded) names neither a device, a
    dtype nor a tensor to match."""
    return all(a is None for a in args) and all(
        kwargs.get(k) is None for k in ("device", "dtype", "other")
    )


class made_elsewhere(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and _names_no_target(args[1:], kwargs):
            raise AssertionError(
                "Tensor.to() with no device: on a GPU this tensor would stay where it was made"
            )
        keeps = func in (torch.as_tensor, torch.asarray) and isinstance(args[0], torch.Tensor)
        if func in _device_constructors() and kwargs.get("device") is None and not keeps:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)
