"""What the image extractors share: the store fields they fill, the params and version that
enter the fingerprint, the checks on the weights they load, and the device-to-host copy
that lets an extractor's CPU work (selection, packing) run beside the next forward pass."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from features.detector.weights import WeightsError
from features.images.config import ExtractConfig

DEFAULT_TRUNK = "resnet152"  # VSE++, UniVSE


# Part of every store fingerprint: bump it with any change that alters extracted features,
# or a persisted store made by the old code is kept (its fingerprint still matches).
EXTRACTOR_VERSION = "2"  # 2: exact BUTD selection (classes of unsurvived proposals)


class ImageExtractor:
    """What the grid and regions extractors share: the model on ``device``, a batch run as
    ``finish(forward(items))``, the record of an unreadable image and the fingerprint's
    params. Subclasses give ``kind``, ``name``, ``fields``, ``prepare``, ``forward`` and
    ``finish``, which :func:`features.images.extract.extract_images` calls."""

    def __init__(self, model: torch.nn.Module, cfg: ExtractConfig, device: torch.device):
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device

    def __call__(self, items: list[dict]) -> list[dict[str, np.ndarray]]:
        return self.finish(items, self.forward(items))

    def empty(self) -> dict[str, np.ndarray]:
        """The record of an image that could not be read: zeros."""
        return {name: np.zeros(s.shape, dtype=s.dtype) for name, s in self.fields().items()}

    def provenance_params(self) -> dict:
        """The params that change the features (the weights enter as their digest; batch
        size, workers, device and error threshold do not change a feature)."""
        return self.cfg.model_dump(
            exclude={"batch_size", "num_workers", "device", "weights", "max_error_fraction"}
        )


def check_conflict(param: str, given, found, source: str) -> None:
    if given is not None and given != found:
        raise WeightsError(
            f"{param} is {given!r} but {source} says {found!r}; remove the param (it is "
            "taken from the checkpoint) or give a checkpoint that matches"
        )


def warn_random_init(what: str, seed: int) -> None:
    warnings.warn(
        f"{what}: NO WEIGHTS GIVEN, using RANDOM initialisation (seed {seed}). Features "
        "are only useful for testing the pipeline; set `weights:` to a local checkpoint "
        "for real runs. The store's fingerprint records the random init.",
        stacklevel=3,
    )


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; to CUDA through pinned memory without making the host wait
    (the DataLoader pins what it hands over; a batch stacked or padded here is not)."""
    if device.type != "cuda":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class HostCopy:
    """Device outputs on their way to host memory: on CUDA copied into pinned buffers behind
    the kernels queued so far, so the host goes on queueing the next batch, and
    :meth:`wait` blocks (in the thread that needs them) until they have arrived; on the CPU
    the tensors themselves. Values are tensors, lists of tensors or ``None``."""

    def __init__(self, device: torch.device, **outputs):
        self.event = None
        if device.type == "cuda":
            outputs = {name: _pinned_copy(value) for name, value in outputs.items()}
            self.event = torch.cuda.Event()
            self.event.record()
        self.outputs = outputs

    def wait(self) -> dict:
        if self.event is not None:
            self.event.synchronize()
        return self.outputs


def _pinned_copy(value):
    if value is None:
        return None
    if isinstance(value, list):
        return [_pinned_copy(v) for v in value]
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    return host.copy_(value, non_blocking=True)
