"""Batches staged on the device one step ahead.

On CUDA a host-to-device copy issued on the step's own stream when the step asks for its
batch waits behind the previous step's kernels, so copy and compute never overlap. Here
batch ``i + 1`` is copied (from pinned memory) and finished on a side stream while step
``i`` runs; the step's stream waits for the copy's event, and each tensor is marked as
used by that stream so the caching allocator does not hand its memory out early.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain, pairwise

import torch


def one_ahead(items: Iterator, start: Callable) -> Iterator[tuple[object, object]]:
    """``(item, start(item))`` in order, ``start`` called on item ``i + 1`` before item ``i``
    is handed out: the next item's work begins before the consumer's step."""
    begun = ((item, start(item)) for item in items)
    for current, _ in pairwise(chain(begun, [None])):  # (item i, item i + 1 begun)
        yield current


def staged_on_cuda(
    items: Iterator[tuple[object, dict]], ready: Callable[[dict], dict], device: torch.device
) -> Iterator[tuple[object, dict]]:
    """``(tag, ready(batch))`` for each ``(tag, batch)`` of host batches, ``ready`` (the copy
    to ``device`` and what finishes the batch there) run on a side stream one batch ahead
    of the consumer."""
    side = torch.cuda.Stream(device)

    def stage(item: tuple[object, dict]) -> tuple[dict, torch.cuda.Event]:
        with torch.cuda.stream(side):
            batch = ready(item[1])
        return batch, side.record_event()

    for (tag, _), (batch, copied) in one_ahead(items, stage):
        step = torch.cuda.current_stream(device)
        step.wait_event(copied)
        for value in batch.values():
            if torch.is_tensor(value) and value.device.type == "cuda":
                value.record_stream(step)
        yield tag, batch
