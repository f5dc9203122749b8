"""Activation checkpointing and reversible stacks as explicit autograd functions.

Both keep their inputs with ``save_for_backward`` (so ``saved_tensors_hooks`` see exactly what stays in memory)
and take the parameters they use as explicit inputs, so gradients reach them through the graph: this works with
``loss.backward()`` and ``torch.autograd.grad`` alike, and with parameters shared between layers. The recomputation
replays the forward's RNG state (dropout draws the same masks) and autocast state.

In a reversible stack, a sub-layer that has ``backward_pieces(x)`` returning a list of ``(index, function)`` is
recomputed and backpropagated one piece at a time (``set_optimizations(backward_chunks=N)``): piece i reads
``x[index]`` and adds ``function(x[index])`` to ``output[index]`` (token chunks of the feed-forward), so the peak
memory of backward holds one piece's activations and gradients instead of the whole sub-layer's. A sub-layer
whose ``backward_in_place(x, grad_out, residual, grad_x)`` returns ``(parameter, gradient)`` pairs rather than None
does the whole step itself (attention in head groups: ``head_groups.py``), updating ``residual`` and ``grad_x`` in
place.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lean_transformer.modules.replay import AutocastState, RNGState

SubLayer = Callable[[Tensor], Tensor]
Piece = tuple[tuple, Callable[[Tensor], Tensor]]


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


def _add_grads(totals: list[Optional[Tensor]], grads: Sequence[Optional[Tensor]], keep: Tensor
               ) -> list[Optional[Tensor]]:
    """``totals + grads``, in place: a weight-sized temporary per parameter and piece would otherwise dominate the
    peak of a chunked backward. A first gradient that shares storage with ``keep`` (the incoming gradient, which is
    still needed) is copied before anything is added to it."""
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        if totals[i] is not None:
            totals[i].add_(grad)
        elif grad.untyped_storage().data_ptr() == keep.untyped_storage().data_ptr():
            totals[i] = grad.clone()
        else:
            totals[i] = grad
    return totals


def _sublayer_vjp(sublayer: SubLayer, x: Tensor, grad_out: Tensor, params: Sequence[Tensor], residual: Tensor,
                  grad_x: Tensor) -> list[Optional[Tensor]]:
    """Recompute ``f = sublayer(x)`` and backpropagate ``grad_out`` through it, one piece at a time where the
    sub-layer splits itself: subtracts f from ``residual`` and adds the input gradient to ``grad_x``, both in place
    (so no whole-size output or input gradient is held besides them); returns the parameter gradients."""
    totals: list[Optional[Tensor]] = [None] * len(params)
    in_place = getattr(sublayer, "backward_in_place", None)
    pairs = in_place(x, grad_out, residual, grad_x) if in_place is not None else None
    if pairs is not None:
        position = {id(p): i for i, p in enumerate(params)}
        for param, grad in pairs:
            totals[position[id(param)]] = grad
        return totals
    pieces: Optional[list[Piece]] = getattr(sublayer, "backward_pieces", lambda _: None)(x)
    for index, function in pieces or [((...,), sublayer)]:
        part = x[index].detach().requires_grad_()
        with torch.enable_grad():
            part_out = function(part)
        residual[index] -= part_out.detach()
        part_grad, *grads = _grads_or_none([part_out], [part, *params], [grad_out[index]])
        del part_out
        grad_x[index] += part_grad
        totals = _add_grads(totals, grads, keep=grad_out)
        del part, part_grad, grads  # not alive during the next piece's backward: a weight-sized temporary each
    return totals


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
        # y1 and grad0 become a and the new grad1 in place, once they are tensors this loop made (not the saved
        # outputs or the incoming gradients, which may be aliased): a whole-size tensor less at the peak
        y0_ours = y1_ours = grad0_ours = grad1_ours = False
        for sublayer, rng in zip(reversed(ctx.sublayers), reversed(ctx.rng_states)):
            # this step mapped (a, b) to (y0, y1) = (b, a + f(b)): recompute f(b), invert, then backprop through f
            b = y0.detach()
            a = y1 if y1_ours else y1.clone()
            grad_a = grad0 if grad0_ours else grad0.clone()
            with ctx.autocast.restore(), rng.replay():
                grads = _sublayer_vjp(sublayer, b, grad1, ctx.params, residual=a, grad_x=grad_a)
            param_grads = _add_grads(param_grads, grads, keep=grad1)
            del grads  # a shared parameter's gradient of this step is not kept through the next
            grad0, grad1, grad0_ours, grad1_ours = grad1, grad_a, grad1_ours, True
            y0, y1, y0_ours, y1_ours = a, b, True, y0_ours
        return None, None, grad0, grad1, *param_grads


def reversible(sublayers: Sequence[SubLayer], x0: Tensor, x1: Tensor, params: Sequence[Tensor]
               ) -> tuple[Tensor, Tensor]:
    """``reversible_couple`` keeping only the two final streams: in backward each sub-layer's input is rebuilt
    from its output (``a = y1 - f(y0)``), so activation memory does not grow with depth.

    ``params`` must list every parameter the sub-layers use that needs a gradient.
    """
    return _Reversible.apply(sublayers, len(params), x0, x1, *params)
