"""One batch's memory: arrays carved out of one reusable byte buffer.

A fresh 40 MB array costs ~10k page faults, more than the copy into it; a reused buffer
(shared memory for workers) costs none, and a worker sends where a batch's arrays lie
(:meth:`Arena.layout`) instead of the arrays.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64  # bytes; arrays start at cache-line boundaries in an arena


class Arena:
    """A reusable buffer (``shared`` memory for workers); a batch that does not fit takes
    fresh arrays for the rest and the buffer grows before the next batch."""

    def __init__(self, nbytes: int = 1 << 20, shared: bool = False):
        self.shared = shared
        self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> None:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.tensor = tensor.share_memory_() if self.shared else tensor
        self.buffer = self.tensor.numpy()
        self.changed = True  # a worker sends its new buffer with the next batch
        self.used = self.demand = 0

    def reset(self) -> None:
        """Start a new batch (the previous one's arrays are reused from here on)."""
        if self.demand > len(self.buffer):
            self._allocate(int(self.demand * 1.25) + (1 << 20))
        self.used = self.demand = 0

    def __call__(self, shape, dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` (the ``alloc`` of a build)."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = -(-self.demand // ALIGN) * ALIGN
        self.demand = start + nbytes
        if self.used > start or start + nbytes > len(self.buffer):  # full: fresh memory
            self.used = len(self.buffer) + 1
            return np.empty(shape, dtype)
        self.used = start + nbytes
        return self.buffer[start : start + nbytes].view(dtype).reshape(shape)

    def holds(self, value: np.ndarray) -> int | None:
        """Offset of a C-contiguous array that lies in this arena, else None."""
        if not value.flags.c_contiguous:
            return None
        offset = value.__array_interface__["data"][0] - self.buffer.__array_interface__["data"][0]
        return offset if 0 <= offset and offset + value.nbytes <= len(self.buffer) else None

    def adopt(self, batch: dict) -> dict:
        """``batch`` with every array (numpy or CPU tensor) in this arena, copying those
        that are not (e.g. built by a source that ignores ``alloc``)."""
        out = {}
        for key, value in batch.items():
            if torch.is_tensor(value):
                value = value.numpy(force=True) if value.device.type == "cpu" else value.cpu()
            if isinstance(value, np.ndarray) and self.holds(value) is None:
                copy = self(value.shape, value.dtype)
                copy[...] = value
                value = copy
            out[key] = value
        return out

    def layout(self, batch: dict) -> dict:
        """Where each array of ``batch`` lies: ``(dtype, shape, offset)``; other values
        (and arrays outside the arena) as they are."""
        out = {}
        for key, value in batch.items():
            offset = self.holds(value) if isinstance(value, np.ndarray) else None
            if offset is None:
                if isinstance(value, np.ndarray):
                    value = torch.from_numpy(value)  # sent through shared memory
                out[key] = ("value", value)
            else:
                out[key] = ("arena", value.dtype.str, value.shape, offset)
        return out


def from_layout(buffer: np.ndarray, layout: dict) -> dict:
    """The batch a worker described with :meth:`Arena.layout`, as views of ``buffer``."""
    out = {}
    for key, item in layout.items():
        if item[0] == "arena":
            _, dtype, shape, offset = item
            out[key] = np.ndarray(shape, np.dtype(dtype), buffer=buffer, offset=offset)
        else:
            out[key] = item[1]
    return out
