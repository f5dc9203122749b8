"""Per-block fp16 gradient scales (:mod:`lean_transformer.optim.block_grad_scaler`) around a trainer's local steps.

The trainer's ``--block_grad_scaling`` replaces hivemind's one global ``GradScaler`` with DALL-E's scheme: the loss
is scaled by one dynamic scale ``S`` (the scale of the gradients outside the blocks: head, embeddings, final norm,
and of the residual stream), and each residual block's backward runs at ``S * s_i``, with ``s_i`` the block's own
scale relative to ``S`` (:class:`BlockGradScaler`'s scales, starting at 1). Without ``S`` the head's float16
backward would run unscaled and its gradients (about 1 / tokens per logit) would underflow.

hivemind averages whatever the ``.grad`` buffers hold when the swarm is ready (with ``reuse_grad_buffers`` they are
the epoch's accumulators, otherwise hivemind adds them to its own after every local step), so every local step ends
with its gradients unscaled, as on the global-scale path at averaging time: ``before_backward`` multiplies the
gradients already in ``.grad`` by their current scales (exact: the scales are powers of two), backward adds the new
gradients at those scales, and ``after_backward`` divides them all again. So the scales can change after any local
step.

What "skip" means in a swarm: one peer cannot skip a block's update, because every peer applies the same averaged
gradient (that is what keeps them identical). A block whose gradients overflow in a local step is zeroed in
``.grad`` instead, so this peer contributes zeros for that block and the true gradients for every other block; the
step's samples still count, so the swarm's average for that block is diluted by the share of samples whose step
overflowed in it (one step per ``growth_interval`` at most, once the scales have settled). With
``reuse_grad_buffers`` the block's ``.grad`` also held this peer's earlier steps of the epoch, which are lost with it
(the global-scale path loses every block's). The block's scale halves; the scale of a block finite for
``growth_interval`` local steps in a row doubles. If the gradients outside the blocks overflow, the step is an
overflow of ``S``, as on the global-scale path: the trainer drops the whole local step and ``S`` halves (the
blocks' scales stay: their overflow came from the stream); ``S`` doubles after ``loss_growth_interval`` clean steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lean_transformer.optim.block_grad_scaler import BlockGradScaler
from lean_transformer.optim.loss_scale import DynamicLossScale


@dataclass(frozen=True)
class LocalStepOutcome:
    overflowed_blocks: int  # blocks zeroed in .grad by this step
    others_finite: bool  # the gradients outside the blocks (else the whole step must be dropped)

    @property
    def finite(self) -> bool:
        return self.overflowed_blocks == 0 and self.others_finite


class SwarmBlockScaling:
    """Drives ``scaler`` (block scales relative to the loss scale) once per local step; see the module docstring."""

    def __init__(self, scaler: BlockGradScaler, loss_scale: DynamicLossScale):
        self.scaler, self.loss_scale = scaler, loss_scale

    @classmethod
    def for_lean_model(cls, model: nn.Module, init_scale: float = 2.0 ** 16, loss_growth_interval: int = 2000,
                       **block_options: Any) -> "SwarmBlockScaling":
        """Over a lean model's sub-layers, the loss scale starting at ``init_scale``, the blocks' at 1 (relative).
        Raises ValueError for models the scaler cannot split into blocks (``backward_chunks`` > 1, shared large
        matrices)."""
        block_options.setdefault("init_scale", 1.0)
        return cls(BlockGradScaler.for_lean_model(model, **block_options),
                   DynamicLossScale(init_scale, growth_interval=loss_growth_interval))

    @property
    def scales(self) -> list[float]:
        """Each block's absolute scale (loss scale times its own)."""
        return (self.scaler.scales * self.loss_scale.scale).tolist()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale.scale

    @torch.no_grad()
    def before_backward(self) -> None:
        """Scale the gradients already in ``.grad`` (none without ``reuse_grad_buffers``) by their current scales,
        once per local step, before its first backward."""
        self._mul_grads(self.scaler.scales * self.loss_scale.scale, self.loss_scale.scale)

    @torch.no_grad()
    def after_backward(self) -> LocalStepOutcome:
        """After the local step's last backward: unscale, zero the blocks that overflowed, update the scales."""
        scaler = self.scaler
        self._mul_grads(1.0 / (scaler.scales * self.loss_scale.scale), 1.0 / self.loss_scale.scale)
        # BlockGradScaler.unscale_'s check, on our unscaling; one device sync for all the blocks and the rest
        device = scaler.found_inf.device
        finite = torch.stack([_all_finite(group, device) for group in scaler.groups]
                             + [_all_finite(scaler.other_params, device)])
        scaler.found_inf += (~finite[:-1]).float()
        flags = torch.cat([scaler.found_inf > 0, finite[-1:]]).tolist()
        overflowed, others_finite = flags[:-1], flags[-1]
        self.loss_scale.update(overflow=not others_finite)
        if not others_finite:  # the stream overflowed before it reached the blocks: not theirs to back off
            scaler.found_inf.zero_()
            return LocalStepOutcome(overflowed_blocks=0, others_finite=False)
        for group, skip in zip(scaler.groups, overflowed):
            if skip:
                for param in group:
                    if param.grad is not None:
                        param.grad.zero_()
        scaler.update()
        return LocalStepOutcome(overflowed_blocks=sum(overflowed), others_finite=True)

    def _mul_grads(self, block_factors: torch.Tensor, other_factor: float) -> None:
        for index, group in enumerate(self.scaler.groups):
            grads = [param.grad for param in group if param.grad is not None]
            if grads:
                torch._foreach_mul_(grads, block_factors[index])
        others = [param.grad for param in self.scaler.other_params if param.grad is not None]
        if others:
            torch._foreach_mul_(others, other_factor)


def _all_finite(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([torch.isfinite(grad).all() for grad in grads]).all().to(device)
