"""The learning-rate schedule of every trainer (the models' and the detector's)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def lr_factor(
    steps_per_epoch: int,
    warmup_steps: int,
    lr_decay: float,
    lr_decay_epochs: Sequence[int],
    *,
    cosine_epochs: int | None = None,
    warm_start: float = 0.0,
) -> Callable[[int], float]:
    """LR multiplier per optimizer step: a linear warm-up from ``warm_start`` over
    ``warmup_steps``, then x ``lr_decay`` at each of ``lr_decay_epochs`` or, with
    ``cosine_epochs``, a cosine from 1 to 0 over that many epochs."""
    total = (cosine_epochs or 0) * steps_per_epoch

    def factor(step: int) -> float:
        warm = min(1.0, warm_start + (step + 1) / warmup_steps) if warmup_steps else 1.0
        if cosine_epochs:
            return warm * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
        epoch = step // steps_per_epoch
        return warm * lr_decay ** sum(epoch >= e for e in lr_decay_epochs)

    return factor
