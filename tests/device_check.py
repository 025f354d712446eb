"""A second device on a CPU-only machine, for the one thing it can check: that code puts
the tensors it makes on its inputs' device. Inside :class:`made_elsewhere`, a tensor made
without a device (``torch.full(...)``, ``torch.as_tensor(numpy_array)``, ...) lands on the
meta device, which holds no data: code that drops a ``device=`` argument mixes it with
its CPU inputs and fails, as it would mix the CPU with CUDA on a GPU. ``torch.as_tensor``
of a tensor keeps that tensor's device, as it does outside."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors


class made_elsewhere(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keeps = func in (torch.as_tensor, torch.asarray) and isinstance(args[0], torch.Tensor)
        if func in _device_constructors() and kwargs.get("device") is None and not keeps:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)
