"""Activation checkpointing and reversible stacks as explicit autograd functions.

Both keep their inputs with ``save_for_backward`` (so ``saved_tensors_hooks`` see exactly what stays in memory)
and take the parameters they use as explicit inputs, so gradients reach them through the graph: this works with
``loss.backward()`` and ``torch.autograd.grad`` alike, and with parameters shared between layers. The recomputation
replays the forward's RNG state (dropout draws the same masks) and autocast state.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lean_transformer.modules.replay import AutocastState, RNGState

SubLayer = Callable[[Tensor], Tensor]


def _grads_or_none(outputs: Sequence[Tensor], inputs: Sequence[Tensor], grad_outputs: Sequence[Tensor]
                   ) -> list[Optional[Tensor]]:
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True) if wanted else ())
    return [next(grads) if t.requires_grad else None for t in inputs]


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function: Callable[..., Tensor], preserve_rng_state: bool, num_inputs: int, *args: Tensor):
        inputs = args[:num_inputs]
        ctx.function, ctx.num_inputs = function, num_inputs
        ctx.rng = RNGState.capture(*inputs) if preserve_rng_state else None
        ctx.autocast = AutocastState.capture()
        ctx.save_for_backward(*inputs)
        ctx.params = args[num_inputs:]  # parameters, not activations: referencing them costs no memory
        return function(*inputs)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with ctx.autocast.restore(), torch.enable_grad():
            if ctx.rng is not None:
                with ctx.rng.replay():
                    output = ctx.function(*inputs)
            else:
                output = ctx.function(*inputs)
        grads = _grads_or_none([output], [*inputs, *ctx.params], [grad_output])
        return None, None, None, *grads


def checkpoint(function: Callable[..., Tensor], inputs: Sequence[Tensor], params: Sequence[Tensor] = (),
               preserve_rng_state: bool = True) -> Tensor:
    """``function(*inputs)`` keeping only ``inputs`` for backward and recomputing the rest there.

    ``params`` must list every parameter ``function`` uses that needs a gradient.
    """
    return _Checkpoint.apply(function, preserve_rng_state, len(inputs), *inputs, *params)


def reversible_couple(sublayers: Sequence[SubLayer], x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    """The RevNet recurrence ``(a, b) -> (b, a + f(b))`` over ``sublayers``, by plain autograd (the reference)."""
    for sublayer in sublayers:
        x0, x1 = x1, x0 + sublayer(x1)
    return x0, x1


class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sublayers: Sequence[SubLayer], num_params: int, x0: Tensor, x1: Tensor, *params: Tensor):
        ctx.sublayers, ctx.params = sublayers, params
        ctx.autocast = AutocastState.capture()
        ctx.rng_states = []
        for sublayer in sublayers:
            ctx.rng_states.append(RNGState.capture(x1))
            x0, x1 = x1, x0 + sublayer(x1)
        ctx.save_for_backward(x0, x1)  # the only activations kept, whatever the depth
        return x0, x1

    @staticmethod
    def backward(ctx, grad0: Tensor, grad1: Tensor):
        y0, y1 = ctx.saved_tensors
        grad0 = torch.zeros_like(y0) if grad0 is None else grad0
        grad1 = torch.zeros_like(y1) if grad1 is None else grad1
        param_grads: list[Optional[Tensor]] = [None] * len(ctx.params)
        for sublayer, rng in zip(reversed(ctx.sublayers), reversed(ctx.rng_states)):
            # this step mapped (a, b) to (y0, y1) = (b, a + f(b)): recompute f(b), invert, then backprop through f
            b = y0.detach().requires_grad_()
            with ctx.autocast.restore(), torch.enable_grad(), rng.replay():
                f_b = sublayer(b)
            a = y1 - f_b.detach()
            grad_b, *grads = _grads_or_none([f_b], [b, *ctx.params], [grad1])
            param_grads = [g if acc is None else acc if g is None else acc + g for acc, g in zip(param_grads, grads)]
            grad0, grad1 = grad1, grad0 + grad_b
            y0, y1 = a.to(y0.dtype), b.detach()
        return None, None, grad0, grad1, *param_grads


def reversible(sublayers: Sequence[SubLayer], x0: Tensor, x1: Tensor, params: Sequence[Tensor]
               ) -> tuple[Tensor, Tensor]:
    """``reversible_couple`` keeping only the two final streams: in backward each sub-layer's input is rebuilt
    from its output (``a = y1 - f(y0)``), so activation memory does not grow with depth.

    ``params`` must list every parameter the sub-layers use that needs a gradient.
    """
    return _Reversible.apply(sublayers, len(params), x0, x1, *params)
