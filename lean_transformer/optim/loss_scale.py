"""Dynamic float16 loss scaling for gradients that are unscaled on the host.

torch's and hivemind's GradScalers unscale the ``.grad`` buffers of an optimizer's parameters; with
:class:`~lean_transformer.optim.grad_offload.HostGradients` those are empty (the gradients left during backward and
are unscaled on the host, in float32), so only the scale's schedule is needed: the usual one, halve on overflow,
double after ``growth_interval`` clean steps.
"""
from __future__ import annotations


class DynamicLossScale:
    """The loss scale for the next backward; ``update(overflow)`` after each local step."""

    def __init__(self, initial_scale: float = 2.0 ** 16, growth_interval: int = 2000, min_scale: float = 1.0):
        if initial_scale < min_scale or min_scale <= 0:
            raise ValueError(f"initial_scale must be >= min_scale > 0, got {initial_scale} and {min_scale}")
        if growth_interval <= 0:
            raise ValueError(f"growth_interval must be positive, got {growth_interval}")
        self.scale, self.growth_interval, self.min_scale = float(initial_scale), growth_interval, float(min_scale)
        self._clean_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self._clean_steps = max(self.scale / 2, self.min_scale), 0
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale, self._clean_steps = self.scale * 2, 0
