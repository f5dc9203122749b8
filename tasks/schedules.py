"""Schedules that depend on the swarm's epoch (never on the local step count, so that every peer agrees)."""
from __future__ import annotations

import math


def learning_rate_factor(epoch: int, warmup_steps: int, total_steps: int, kind: str = "linear") -> float:
    """LR multiplier: linear warmup reaching 1 at epoch ``warmup_steps - 1``, then linear or cosine decay to 0 at
    ``total_steps``. The first epoch already gets a non-zero LR, so no optimizer step is wasted."""
    if epoch < warmup_steps:
        return (epoch + 1) / warmup_steps
    if epoch >= total_steps:
        return 0.0
    progress = (epoch - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule must be 'linear' or 'cosine', got {kind!r}")


def sequence_length(epoch: int, initial: int, maximum: int, warmup_steps: int, multiple_of: int) -> int:
    """Sequence-length warmup: grows linearly from ``initial`` to ``maximum`` over ``warmup_steps`` epochs, rounded
    down to a multiple of ``multiple_of`` (but never below one multiple, nor above ``maximum``)."""
    fraction = min(1.0, epoch / warmup_steps) if warmup_steps > 0 else 1.0
    length = initial + (maximum - initial) * fraction
    return min(maximum, max(multiple_of, int(length) // multiple_of * multiple_of))
